"""gapless.readahead: the files a start reads from disk, handed to the kernel before the process needs them."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gapless import demo_task, readahead
from gapless.demo import write_base_model

needs_fadvise = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this OS")


def test_weight_files_largest_first(tmp_path):
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 30)
    (tmp_path / "config.json").write_text("{}")
    assert [f.name for f in readahead.weight_files(tmp_path)] == ["model-00002-of-00002.safetensors",
                                                                  "model-00001-of-00002.safetensors"]
    assert readahead.weight_files(tmp_path / "missing") == []
    assert readahead.weight_files(tmp_path / "config.json") == []


@needs_fadvise
def test_advise_counts_what_it_handed_over_and_skips_what_it_cannot_open(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(b"x" * 4096)
    b.write_bytes(b"y" * 100)
    assert readahead.advise([a, tmp_path / "gone.safetensors", b]) == 4196


@needs_fadvise
def test_start_runs_in_a_daemon_thread_unless_turned_off(tmp_path, monkeypatch):
    (tmp_path / "m.safetensors").write_bytes(b"x" * 10)
    thread = readahead.read_ahead(tmp_path)
    assert thread is not None and thread.daemon
    thread.join(10)
    assert not thread.is_alive()
    monkeypatch.setenv(readahead.OFF, "0")
    assert readahead.read_ahead(tmp_path) is None


SCRIPT = """
import json, sys
from gapless import readahead
calls = []
real = readahead.read_ahead
def read_ahead(path):
    calls.append([str(path), "torch" in sys.modules])
    return real(path)
readahead.read_ahead = read_ahead
from gapless import cli
code = cli.main(sys.argv[1:])
print("CALLS " + json.dumps(calls))
sys.exit(code)
"""


@needs_fadvise
def test_train_hands_over_the_weights_before_importing_torch(tmp_path):
    """`gapless train` starts the weights' readahead as soon as the config names the model, before torch is
    imported; the run then trains as before."""
    base = write_base_model(tmp_path / "base", seed=1)
    data = demo_task.write_jsonl(demo_task.make_examples(20, seed=7), tmp_path / "train.jsonl")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(base), "dtype": "float32", "device": "cpu", "compile": False},
        "data": {"sources": [{"path": str(data), "format": "messages"}], "max_seq_len": 64,
                 "tokens_per_batch": 128, "cache_dir": str(tmp_path / "cache"), "num_workers": 0},
        "train": {"steps": 1}, "output_dir": str(tmp_path / "run"), "progress": False,
    }))
    env = {**os.environ, "PYTHONPATH": str(Path(readahead.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", SCRIPT, "train", str(config)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("CALLS "))[6:])
    assert calls == [[str(base), False]]
