"""`gapless train` and `gapless export` through cli.main on the demo's tiny Llama: a YAML config with
overrides, --resume, export as a PEFT adapter or a merged HF folder from a run, its adapter/ or a
checkpoint, and one clear error line (exit 2) for the user's mistakes."""
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from gapless import cli, demo_task
from gapless.config import load_config
from gapless.demo import write_base_model
from gapless.train.loop import train
from conftest import gapless_logits, training_records

STEPS = 4



@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """The tiny base model, 100 messages records and a run config file of 4 steps (checkpoints at 2 and 4)."""
    root = tmp_path_factory.mktemp("cli")
    base = write_base_model(root / "base", seed=1)
    data = demo_task.write_jsonl(demo_task.make_examples(100, seed=7), root / "train.jsonl")
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(base), "dtype": "float32", "device": "cpu"},
        "data": {"sources": [{"path": str(data), "format": "messages"}], "max_seq_len": 64,
                 "tokens_per_batch": 128, "cache_dir": str(root / "cache"), "num_workers": 0},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.05, "target_modules": ["q_proj", "v_proj", "down_proj"]},
        "optim": {"lr": 2.0e-2},
        "checkpoint": {"every": 2, "keep": 3},
        "train": {"steps": STEPS, "log_every": 1},
        "output_dir": str(root / "runs" / "default"),
        "progress": False,
    }))
    return {"root": root, "base": base, "config": config}


@pytest.fixture(scope="module")
def run(setup) -> Path:
    """`gapless train run.yaml output_dir=... lora.r=8`: a finished run folder."""
    out = setup["root"] / "runs" / "cli"
    assert cli.main(["train", str(setup["config"]), f"output_dir={out}", "lora.r=8"]) == 0
    return out


def adapter_tensors(folder: Path) -> dict:
    return load_file(folder / "adapter_model.safetensors")


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_train_writes_the_run_folder_with_overrides(setup, run):
    cfg = load_config(run / "config.yaml")
    assert cfg.lora.r == 8 and cfg.output_dir == str(run)  # the overrides, resolved into the run's config
    # ... and "auto" resolved to what ran (the CPU: sdpa, no compile; LoRA dropout keeps the default concat_b)
    assert cfg == load_config(setup["config"], [f"output_dir={run}", "lora.r=8", "model.attn_backend=sdpa",
                                                "model.compile=false"])
    records = training_records(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    adapter_cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 8 and adapter_cfg["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    assert Path(adapter_cfg["base_model_name_or_path"]) == setup["base"].resolve()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]


def test_train_resume_flag_continues_a_stopped_run(setup, run, capsys):
    """A run stopped after step 3, then `gapless train run.yaml ... --resume`: the same final adapter."""
    out = setup["root"] / "runs" / "resumed"
    overrides = [f"output_dir={out}", "lora.r=8"]
    train(load_config(setup["config"], overrides), stop_after=3)
    assert not (out / "adapter").exists()
    capsys.readouterr()
    assert cli.main(["train", str(setup["config"]), *overrides, "--resume", "progress=true"]) == 0
    assert "step 3 done" in capsys.readouterr().err  # resumed from checkpoint 2: its first step is 3, not "step 1"
    assert load_config(out / "config.yaml").resume is True
    assert_same_tensors(adapter_tensors(out / "adapter"), adapter_tensors(run / "adapter"))


def test_train_config_mistake_is_one_line_exit_2(setup, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(setup["config"].read_text().replace("steps: 4", "stesp: 4"))
    assert cli.main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gapless train: error: ") and err.count("\n") == 1
    assert f"{bad}.train.stesp: unknown key; did you mean 'steps'?" in err
    assert cli.main(["train", str(setup["config"]), "optim.lr=fast"]) == 2
    assert "optim.lr: expected a number, got 'fast'" in capsys.readouterr().err
    assert cli.main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_export_adapter_from_run_adapter_dir_and_checkpoint(setup, run, tmp_path, capsys):
    final = adapter_tensors(run / "adapter")
    for source in (run, run / "adapter", run / "checkpoints" / "step-00000004"):
        out = tmp_path / source.name
        assert cli.main(["export", str(source), "--out", str(out)]) == 0
        assert "wrote PEFT adapter" in capsys.readouterr().out
        assert_same_tensors(adapter_tensors(out), final)
        assert json.loads((out / "adapter_config.json").read_text()) == \
            json.loads((run / "adapter" / "adapter_config.json").read_text())
        assert (out / "tokenizer.json").is_file()
    out = tmp_path / "step-2"
    assert cli.main(["export", str(run / "checkpoints" / "step-00000002"), "--out", str(out)]) == 0
    assert any(not torch.equal(t, final[k]) for k, t in adapter_tensors(out).items())


def test_export_of_a_stopped_run_takes_its_newest_complete_checkpoint(setup, tmp_path):
    """A run folder without adapter/ (stopped after step 3) and a step-4 checkpoint whose write was
    killed before its manifest: export warns and takes checkpoint 2."""
    stopped = setup["root"] / "runs" / "stopped"
    train(load_config(setup["config"], [f"output_dir={stopped}", "lora.r=8"]), stop_after=3)
    assert not (stopped / "adapter").exists()
    killed = stopped / "checkpoints" / "step-00000004"
    shutil.copytree(stopped / "checkpoints" / "step-00000002", killed)
    (killed / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="step-00000004: manifest.json is missing"):
        assert cli.main(["export", str(stopped), "--out", str(tmp_path / "a")]) == 0
    assert cli.main(["export", str(stopped / "checkpoints" / "step-00000002"), "--out", str(tmp_path / "b")]) == 0
    assert_same_tensors(adapter_tensors(tmp_path / "a"), adapter_tensors(tmp_path / "b"))


@pytest.mark.parametrize("source", ["run", "adapter", "checkpoint"])
def test_export_merged_has_the_adapted_logits(setup, run, tmp_path, source):
    from transformers import AutoModelForCausalLM

    src = {"run": run, "adapter": run / "adapter", "checkpoint": run / "checkpoints" / "step-00000004"}[source]
    out = tmp_path / "merged"
    assert cli.main(["export", str(src), "--merge", "--out", str(out)]) == 0
    ids = torch.randint(5, demo_task.vocab_size(), (2, 24), generator=torch.Generator().manual_seed(0))
    want = gapless_logits(setup["base"], run / "adapter", ids)
    assert (gapless_logits(setup["base"], None, ids) - want).abs().max() > 1e-2  # the adapter changes the logits
    torch.testing.assert_close(gapless_logits(out, None, ids), want, rtol=0, atol=1e-4)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("template_in", ["chat_template.jinja", "tokenizer_config.json"])
def test_export_of_a_peft_adapter_keeps_the_tokenizer_saved_with_it(setup, tmp_path, merge, template_in):
    """A PEFT adapter folder with the tokenizer it was trained with beside it (TRL's trainer saves it there: a
    Qwen2.5-72B SFT_LoRA folder holds tokenizer.json, tokenizer_config.json, vocab.json... beside adapter_config.json;
    here with a chat template the base lacks, in its own file or, as transformers 4 saved it, in
    tokenizer_config.json): export wrote the base's tokenizer instead, the one `gapless generate ADAPTER` does not
    use."""
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = tmp_path / "checkpoint-12"
    hf = AutoModelForCausalLM.from_pretrained(str(setup["base"]))
    peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])).save_pretrained(adapter)
    tokenizer = AutoTokenizer.from_pretrained(str(setup["base"]))
    tokenizer.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"
    tokenizer.save_pretrained(adapter)
    if template_in == "tokenizer_config.json":
        config = json.loads((adapter / "tokenizer_config.json").read_text())
        (adapter / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": tokenizer.chat_template}))
        (adapter / "chat_template.jinja").unlink()
    assert (setup["base"] / "chat_template.jinja").is_file()  # the base's, which a merged folder held beside
    out = tmp_path / "out"
    assert cli.main(["export", str(adapter), "--out", str(out), *(["--merge"] if merge else [])]) == 0
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == tokenizer.chat_template


def test_merged_export_of_a_run_keeps_its_data_tokenizer(setup, tmp_path):
    """A run whose data.tokenizer is not the base's (here the base's with another chat template, in
    tokenizer_config.json as transformers 4 saved it): the merged folder held the base's chat_template.jinja beside it,
    which transformers reads first, so the merged model chatted in the base's template, not the trained one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(setup["base"]))
    # the base's template without its bos token (every piece still in the demo tokenizer's word vocabulary)
    template = (setup["base"] / "chat_template.jinja").read_text().replace("{{ bos_token }}", "")
    tokenizer.chat_template = template
    tokenizer.save_pretrained(tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (tmp_path / "tok" / "chat_template.jinja").unlink()
    assert (setup["base"] / "chat_template.jinja").is_file()
    run = tmp_path / "run"
    assert cli.main(["train", str(setup["config"]), f"output_dir={run}", f"data.tokenizer={tmp_path / 'tok'}",
                     f"data.cache_dir={tmp_path / 'cache'}", "train.steps=2"]) == 0
    assert cli.main(["export", str(run), "--merge", "--out", str(tmp_path / "merged")]) == 0
    assert AutoTokenizer.from_pretrained(str(tmp_path / "merged")).chat_template == template


def test_export_merged_dtype(setup, run, tmp_path):
    out = tmp_path / "bf16"
    assert cli.main(["export", str(run), "--merge", "--dtype", "bfloat16", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", framework="pt") as st:
        assert {st.get_tensor(k).dtype for k in st.keys()} == {torch.bfloat16}
    ids = torch.randint(5, demo_task.vocab_size(), (1, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(gapless_logits(out, None, ids), gapless_logits(setup["base"], run / "adapter", ids),
                               rtol=0, atol=0.1)  # bf16 weights: ~3 significant digits


def test_export_mistakes_are_one_line_exit_2(setup, run, tmp_path, capsys):
    assert cli.main(["export", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gapless export: error: ") and "holds no adapter" in err and err.count("\n") == 1
    assert cli.main(["export", str(run), "--merge", "--dtype", "int8", "--out", str(tmp_path / "y")]) == 2
    assert "dtype: 'int8' is not known" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


def test_cli_without_a_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "export" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["export", "somewhere"])  # --out is required: argparse's own usage error
    assert e.value.code == 2
