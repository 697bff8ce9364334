"""`gapless demo` end to end, run once per session: it learns its task within the time it promises,
its adapter loads in PEFT with gapless's logits, and `gapless export` of the run (merged, or from a
checkpoint) gives folders that transformers and PEFT load with the same logits."""
import contextlib
import io
import json
import re
import time
from pathlib import Path

import pytest
import torch

from gapless import cli
from conftest import gapless_logits

DEMO_STEPS = 400
TIME_LIMIT_S = 180  # the demo's promise is "about a minute" on a laptop; 2 shared CI cores get 3


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> dict:
    """`gapless demo --out DIR --steps 400` through cli.main, its printed report parsed."""
    out = tmp_path_factory.mktemp("demo")
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["demo", "--out", str(out), "--steps", str(DEMO_STEPS)])
    seconds = time.perf_counter() - t0
    text = buf.getvalue()
    acc = {when: int(m.group(1)) / 100 for when in ("before", "after")
           if (m := re.search(rf"{when} fine-tuning:\s+exact match (\d+)%", text))}
    return {"rc": rc, "seconds": seconds, "text": text, "out": out, "base": out / "base", "run": out / "run",
            "adapter": out / "run" / "adapter", "accuracy": acc}


def logits_inputs(base: Path) -> torch.Tensor:
    """Chat-formatted prompts of the demo task, equal length so they batch without padding."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    ids = [tok.apply_chat_template([{"role": "user", "content": f"shift: {w}"}, {"role": "assistant", "content": a}],
                                   tokenize=True, return_dict=False)
           for w, a in [("hello", "ifmmp"), ("zebra", "afcsb"), ("quick", "rvjdl")]]
    return torch.tensor(ids)


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model.eval()(input_ids=ids).logits


def test_demo_learns_within_its_time(demo):
    assert demo["rc"] == 0, demo["text"][-2000:]
    assert demo["seconds"] < TIME_LIMIT_S, f"the demo took {demo['seconds']:.0f} s"
    acc = demo["accuracy"]
    assert acc.keys() == {"before", "after"}, demo["text"][-2000:]
    assert acc["before"] <= 0.05 and acc["after"] >= 0.9, acc
    assert "training throughput" in demo["text"] and str(demo["run"]) in demo["text"]


def test_demo_run_folder(demo):
    """The run folder of a real run: config.yaml, metrics with train and eval records, checkpoints, adapter,
    environment.json."""
    from gapless.config import load_config

    run = demo["run"]
    cfg = load_config(run / "config.yaml")
    assert cfg.train.steps == DEMO_STEPS and Path(cfg.model.path) == demo["base"]
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    train_steps = [r["step"] for r in records if "loss" in r]
    assert train_steps == list(range(cfg.train.log_every, DEMO_STEPS + 1, cfg.train.log_every))
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [100, 200, 300, 400]
    first_loss = next(r["loss"] for r in records if "loss" in r)  # records before it: environment, startup
    assert evals[-1]["eval_loss"] < 0.1 < first_loss
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000300", "step-00000400"]
    assert (demo["adapter"] / "adapter_model.safetensors").is_file()
    assert (demo["adapter"] / "tokenizer.json").is_file()
    # as every run folder: `gapless doctor --compare runs/demo/run RUN` compares its environment
    assert json.loads((run / "environment.json").read_text())["packages"]["torch"]


def test_demo_adapter_loads_in_peft_with_gapless_logits(demo):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = logits_inputs(demo["base"])
    hf = AutoModelForCausalLM.from_pretrained(str(demo["base"]), dtype=torch.float32)
    base_logits = hf_logits(hf, ids)
    peft_model = PeftModel.from_pretrained(hf, str(demo["adapter"]))
    ours = gapless_logits(demo["base"], demo["adapter"], ids)
    assert (hf_logits(peft_model, ids) - ours).abs().max().item() <= 1e-4
    assert (base_logits - ours).abs().max().item() > 1.0  # the adapter changes the model: the check has teeth


def test_export_merged_loads_in_transformers(demo, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    assert cli.main(["export", str(demo["run"]), "--merge", "--out", str(out)]) == 0
    assert "wrote merged model" in capsys.readouterr().out
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    ids = logits_inputs(demo["base"])
    ours = gapless_logits(demo["base"], demo["adapter"], ids)
    assert (hf_logits(merged, ids) - ours).abs().max().item() <= 1e-4
    assert AutoTokenizer.from_pretrained(str(out)).chat_template  # the tokenizer travels with the weights


def read_adapter(folder: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return (json.loads((folder / "adapter_config.json").read_text()),
            load_file(folder / "adapter_model.safetensors"))


def test_export_last_checkpoint_equals_final_adapter(demo, tmp_path):
    final_cfg, final = read_adapter(demo["adapter"])
    out = tmp_path / "from-checkpoint"
    assert cli.main(["export", str(demo["run"] / "checkpoints" / "step-00000400"), "--out", str(out)]) == 0
    cfg, tensors = read_adapter(out)
    assert cfg == final_cfg
    assert tensors.keys() == final.keys() and tensors
    for k in final:
        assert torch.equal(tensors[k], final[k]), k
    assert (out / "tokenizer.json").is_file()

    # an earlier checkpoint is another adapter: the comparison above has teeth
    earlier = tmp_path / "step-300"
    assert cli.main(["export", str(demo["run"] / "checkpoints" / "step-00000300"), "--out", str(earlier)]) == 0
    _, tensors = read_adapter(earlier)
    assert any(not torch.equal(tensors[k], final[k]) for k in final)

    # the run folder (no merge) exports its final adapter
    again = tmp_path / "from-run"
    assert cli.main(["export", str(demo["run"]), "--out", str(again)]) == 0
    cfg, tensors = read_adapter(again)
    assert cfg == final_cfg and all(torch.equal(tensors[k], final[k]) for k in final)
