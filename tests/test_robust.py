"""Faults injected into the final outputs and the data cache, and the security rules (issue robust:), CPU, tiny:

- the PEFT adapter, the merged export and report.html are written atomically: a write that fails midway (a full
  disk) leaves the previous output as it was and no folder that looks complete;
- SIGKILL during tokenization leaks no temporary cache folder past the next run's start;
- a tokenizer folder whose auto_map names its own code is refused without running it or prompting;
- a chat template that reaches for Python internals is refused by the Jinja sandbox;
- the HTML report escapes strings from data, config and paths.
"""
import builtins
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from gapless import demo_task
from gapless.config import DataConfig, from_dict
from gapless.data import cache
from gapless.data.pipeline import build_data
from gapless.data.tokenize import load_tokenizer
from gapless.meter import report
from gapless.model import export, lora
from gapless.model.loading import load_model
from gapless.model.lora import apply_lora, save_adapter

GOOD = {"messages": [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "bcd"}]}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from gapless.demo import write_base_model

    return write_base_model(tmp_path_factory.mktemp("robust") / "base", seed=0)


def disk_full_after(nbytes: int):
    """A safetensors save_file that writes `nbytes` of the file, then fails as a full disk does."""
    def save_file(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * nbytes)
        raise OSError(28, "No space left on device", str(path))
    return save_file


def lora_model(base: Path, fill: float):
    model = load_model(base, dtype="float32")
    apply_lora(model, from_dict(lora.LoraConfig, {"r": 2, "alpha": 4}, "lora"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.fill_(fill)
    return model


def test_adapter_write_is_atomic(base, tmp_path, monkeypatch):
    out = tmp_path / "adapter"
    save_adapter(lora_model(base, 1.0), out)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    monkeypatch.setattr(lora, "save_file", disk_full_after(100))
    with pytest.raises(OSError, match="No space left"):
        save_adapter(lora_model(base, 2.0), out)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # the previous adapter, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no temporary folder left
    with pytest.raises(OSError):
        save_adapter(lora_model(base, 2.0), tmp_path / "new")
    assert not (tmp_path / "new").exists()  # a first write that fails leaves nothing that looks like an adapter


def test_merged_export_is_atomic(base, tmp_path, monkeypatch):
    model = load_model(base, dtype="float32")
    out = tmp_path / "merged"
    export.save_pretrained(model, out, source_dir=base / "tokenizer")
    (out / "notes.txt").write_text("the user's own file")
    monkeypatch.setattr(export, "save_file", disk_full_after(1000))
    with pytest.raises(OSError, match="No space left"):
        export.save_pretrained(model, out, source_dir=base / "tokenizer")
    assert (out / "config.json").is_file() and (out / "notes.txt").is_file()
    torch.testing.assert_close(load_model(out, dtype="float32").lm_head.weight, model.lm_head.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]
    monkeypatch.undo()
    export.save_pretrained(model, out, source_dir=base / "tokenizer")  # replacing an export keeps other files
    assert (out / "notes.txt").is_file() and (out / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="is a file"):
        export.save_pretrained(model, out / "notes.txt", source_dir=base / "tokenizer")


def test_report_write_is_atomic_and_escapes(tmp_path, monkeypatch):
    run = tmp_path / "<script>alert('dir')"  # a folder name cannot hold the closing tag's slash
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({
        "model": {"path": "/models/<script>alert(1)</script>"},
        "data": {"sources": [{"path": "<img src=x onerror=alert(2)>.jsonl"}]}, "output_dir": str(run)}))
    records = [{"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "real_tokens": 10, "trained_tokens": 5,
                "tokens_per_s": 10.0, "elapsed_s": 1.0},
               {"kind": "compile", "step": 1, "frames_not_compiled": 1, "message": "<script>alert(3)</script>"}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page = report.write_report(run).read_text()
    assert "<script" not in page.lower() and "<img src=x" not in page  # the plots are <img src="data:...
    assert "&lt;script&gt;" in page  # shown, escaped

    def broken(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "render", broken)
    with pytest.raises(OSError):
        report.write_report(run)
    assert (run / "report.html").read_text() == page
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "metrics.jsonl", "report.html"]


def test_sigkill_during_tokenization_leaks_no_cache_folder(tmp_path):
    tok = demo_task.write_tokenizer(tmp_path / "tok")
    data = tmp_path / "big.jsonl"
    data.write_text((json.dumps(GOOD) + "\n") * 60_000)
    cfg = {"sources": [{"path": str(data), "format": "messages"}], "tokenizer": str(tok),
           "cache_dir": str(tmp_path / "cache"), "max_seq_len": 64, "tokens_per_batch": 128, "num_workers": 0}
    code = ("import json,sys; from gapless.config import DataConfig, from_dict; "
            "from gapless.data.pipeline import build_data; "
            "build_data(from_dict(DataConfig, json.loads(sys.argv[1]), 'data'))")
    env = {**os.environ, "PYTHONPATH": str(Path(cache.__file__).parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(cfg)], env=env)
    deadline = time.monotonic() + 120
    leaked = []
    while not leaked and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
        leaked = list((tmp_path / "cache").glob(".*-*-*-*")) if (tmp_path / "cache").is_dir() else []
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert leaked, "the child finished before it could be killed mid-write"
    assert leaked[0].is_dir()  # the killed writer's folder
    _, _, summary = build_data(from_dict(DataConfig, cfg, "data"))  # the next run removes it
    assert not leaked[0].exists() and summary.sources[0].cache == "miss"
    assert not list((tmp_path / "cache").glob(".*-*-*-*"))


def test_a_live_writers_temporary_folder_is_left_alone(tmp_path):
    live = tmp_path / f".{'a' * 16}-{cache._HOST}-{os.getpid()}-xyz"
    dead = tmp_path / f".{'b' * 16}-{cache._HOST}-{2 ** 22 + 12345}-xyz"  # above any pid_max in use here
    other_host = tmp_path / f".{'c' * 16}-00000000-{2 ** 22 + 12345}-xyz"
    for d in (live, dead, other_host):
        d.mkdir()
    assert cache.clean_stale(tmp_path) == [dead]
    assert live.is_dir() and other_host.is_dir()


def test_a_tokenizer_folder_with_custom_code_is_refused_without_running_it(tmp_path, monkeypatch):
    folder = demo_task.write_tokenizer(tmp_path / "evil")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(auto_map={"AutoTokenizer": ["evil_code.EvilTokenizer", "evil_code.EvilTokenizer"]},
                  tokenizer_class="EvilTokenizer")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    marker = tmp_path / "code_ran"
    (folder / "evil_code.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                         "from transformers import PreTrainedTokenizerFast\n"
                                         "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")

    def no_prompt(*args):
        raise AssertionError("an interactive prompt was shown")

    monkeypatch.setattr(builtins, "input", no_prompt)
    with pytest.raises(ValueError, match="asks to run its own Python code"):
        load_tokenizer(folder)
    assert not marker.exists()


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{% for m in messages %}{{ m.update({'role': 'x'}) }}{% endfor %}",  # the sandbox is immutable too
])
def test_a_chat_template_reaching_python_internals_is_refused(tmp_path, template, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tok = demo_task.write_tokenizer(tmp_path / "tok")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(GOOD) + "\n")
    cfg = from_dict(DataConfig, {"sources": [{"path": str(data), "format": "messages"}], "tokenizer": str(tok),
                                 "chat_template": template, "cache_dir": str(tmp_path / "cache"), "max_seq_len": 64,
                                 "tokens_per_batch": 128, "num_workers": 0}, "data")
    with pytest.raises(ValueError, match=r"d.jsonl:1: messages: the chat template failed: .*unsafe"):
        build_data(cfg)
    assert not (tmp_path / "MARKER").exists()
