"""`gapless eval RUN`: loss and perplexity through the run's data path, GSM8K exact match of `#### N`, written to
RUN/eval.json."""
import json
import math

import pytest

import torch

from gapless.cli import main
from gapless.config import load_config
from gapless.demo import DEMO_ARCH
from gapless.meter.report import write_report
from gapless.model.decoder import CausalLM
from gapless.model.export import save_pretrained
from gapless.model.loading import model_args_from_config
from gapless.train.evaluate import final_number, read_problems
from gapless.train.loop import train
from conftest import SHARED


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama (hidden 64) with the Llama 3 tokenizer, LoRA-trained 2 steps on 40 GSM8K conversations."""
    shared_dir = SHARED
    if not shared_dir.is_dir():
        pytest.skip("../shared is not present")
    root = tmp_path_factory.mktemp("eval")
    config = dict(DEMO_ARCH, hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=128256,
                  bos_token_id=128000, eos_token_id=128009, pad_token_id=None)
    torch.manual_seed(0)
    model = CausalLM(model_args_from_config(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    model.config_dict = config
    save_pretrained(model, root / "base", source_dir=shared_dir / "tokenizers" / "llama3")
    lines = (shared_dir / "data" / "messages" / "gsm8k_train.jsonl").read_text().splitlines()
    (root / "train.jsonl").write_text("\n".join(lines[:40]) + "\n")
    (root / "heldout.jsonl").write_text("\n".join(lines[40:60]) + "\n")
    cfg = load_config(data={
        "model": {"path": str(root / "base"), "dtype": "float32", "device": "cpu"},
        "data": {"sources": [{"path": str(root / "train.jsonl")}], "max_seq_len": 512, "tokens_per_batch": 1024,
                 "cache_dir": str(root / "cache"), "num_workers": 0},
        "lora": {"r": 4}, "train": {"steps": 2, "log_every": 1}, "output_dir": str(root / "run"), "progress": False})
    train(cfg)
    return {"run": root / "run", "data": root / "heldout.jsonl"}


def test_final_number():
    assert final_number("so 3 + 4 = 7\n#### 7") == "7"
    assert final_number("#### 1,234") == "1234"
    assert final_number("#### -2.0") == "-2"
    assert final_number("#### $18") == "18"
    assert final_number("first #### 3 then #### 4") == "4"
    assert final_number("the answer is 7") is None


def test_loss_and_gsm8k_written_to_the_run(trained, shared, tmp_path, capsys):
    run = trained["run"]
    gsm8k = shared / "data" / "raw" / "gsm8k" / "train.jsonl"
    assert main(["eval", str(run), "--data", str(trained["data"]), "--gsm8k", str(gsm8k), "--limit", "2",
                 "--max-new-tokens", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out and "exact match 0/2" in out  # a 12-step character model cannot do arithmetic
    records = json.loads((run / "eval.json").read_text())
    loss, em = records[-2], records[-1]
    assert loss["kind"] == "loss" and math.isclose(loss["perplexity"], math.exp(loss["loss"]))
    assert loss["tokens"] > 0 and loss["documents"] == 20
    page = write_report(run).read_text()  # the report shows the evaluations and the sample generations
    assert "Evaluations (gapless eval)" in page and "exact match 0/2" in page and "Sample generations" in page
    assert em["total"] == 2 and len(em["samples"]) == 2 and em["samples"][0]["expected"] == \
        final_number(json.loads(gsm8k.read_text().splitlines()[0])["answer"])


def test_gsm8k_records_of_both_shapes(shared):
    raw = read_problems(shared / "data" / "raw" / "gsm8k" / "train.jsonl", 3)
    msgs = read_problems(shared / "data" / "messages" / "gsm8k_train.jsonl", 3)
    assert len(raw) == len(msgs) == 3
    assert final_number(raw[0][1]) == final_number(msgs[0][1]) is not None


def test_eval_needs_something(trained, capsys):
    assert main(["eval", str(trained["run"])]) == 2
    assert "--data" in capsys.readouterr().err


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """The demo's tiny Llama QLoRA-trained 6 steps on its task, evaluated on 40 held-out examples (every 3 steps and
    at the end): a run folder with adapter/ and its eval losses in metrics.jsonl."""
    from gapless import demo_task
    from gapless.demo import write_base_model

    root = tmp_path_factory.mktemp("qlora_eval")
    base = write_base_model(root / "base", seed=0)
    data = demo_task.write_jsonl(demo_task.make_examples(200, seed=1), root / "train.jsonl")
    heldout = demo_task.write_jsonl(demo_task.make_examples(40, seed=2), root / "heldout.jsonl")
    cfg = load_config(data={
        "model": {"path": str(base), "dtype": "float32", "device": "cpu"}, "method": "qlora",
        "data": {"sources": [{"path": str(data)}], "eval_sources": [{"path": str(heldout)}], "max_seq_len": 64,
                 "tokens_per_batch": 128, "cache_dir": str(root / "cache"), "num_workers": 0},
        "lora": {"r": 4, "alpha": 8}, "optim": {"lr": 1e-2}, "checkpoint": {"every": 0},
        "train": {"steps": 6, "log_every": 3, "eval_every": 3}, "output_dir": str(root / "run"), "progress": False})
    train(cfg)
    evals = [r["eval_loss"] for r in map(json.loads, open(root / "run" / "metrics.jsonl")) if "eval_loss" in r]
    return {"run": root / "run", "base": base, "data": data, "heldout": heldout, "eval_loss": evals[-1]}


def test_eval_of_a_qlora_run_equals_its_own_evaluation(qlora_run, capsys):
    """`gapless eval` rebuilds the NF4 base the run trained on: on the run's eval data it reports the loss the run's
    last evaluation wrote (float32 on the CPU, the same model and batches: equal to the bit here; 1e-6 leaves room for
    another summation order, far below the 1e-2 the unquantised base was off by). The unquantised base, asked for
    explicitly, gives another loss and says so."""
    run, heldout = qlora_run["run"], str(qlora_run["heldout"])
    assert main(["eval", str(run), "--data", heldout, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    record = json.loads((run / "eval.json").read_text())[-1]
    assert math.isclose(record["loss"], qlora_run["eval_loss"], rel_tol=1e-6), (record["loss"],
                                                                                 qlora_run["eval_loss"])
    assert "NF4" in record["model"] and "NF4" in out.splitlines()[0]

    assert main(["eval", str(run), "--data", heldout, "--device", "cpu", "--unquantised-base"]) == 0
    out = capsys.readouterr().out
    unquantised = json.loads((run / "eval.json").read_text())[-1]
    # the quantisation error of this tiny model's base shows in the loss, so the equality above means something
    assert abs(unquantised["loss"] - qlora_run["eval_loss"]) > 1e-3, (unquantised["loss"], qlora_run["eval_loss"])
    assert "float32" in unquantised["model"] and "unquantised" in unquantised["model"]
    assert "unquantised" in out.splitlines()[0]
