"""The environment record: every run folder's environment.json, and `gapless doctor --compare RUN_A RUN_B`."""
import json

import yaml

from gapless.cli import main
from gapless.diagnosis import environment
from gapless.diagnosis.environment import (compare_runs, differences, env_vars, environment_record, kernel_imports,
                                           write_environment)


def test_record_holds_what_changes_a_run(tmp_path):
    path = write_environment(tmp_path / "run", environment_record(probe_kernels=False))
    record = json.loads(path.read_text())
    assert record["packages"]["torch"] and record["python"].count(".") == 2
    assert set(record["gpu"]) >= {"torch_cuda", "cuda_available", "driver", "gpus", "nccl", "cudnn"}
    assert set(record["torch_flags"]) >= {"tf32_matmul", "float32_matmul_precision", "cudnn_benchmark"}
    assert set(record["gapless"]) == {"path", "commit", "dirty", "install"}
    assert set(record["kernels"]) == {"flash-attn-4", "liger-kernel", "bitsandbytes"}


class EditableInstall:
    def __init__(self, checkout):
        self.checkout = checkout

    def read_text(self, name):
        return json.dumps({"dir_info": {"editable": True}, "url": self.checkout.as_uri()})


def test_install_is_the_one_that_holds_the_running_gapless(tmp_path, monkeypatch):
    here = tmp_path / "checkout" / "src" / "gapless" / "diagnosis" / "environment.py"
    here.parent.mkdir(parents=True)
    monkeypatch.setattr(environment, "__file__", str(here))
    metadata = environment.importlib.metadata
    monkeypatch.setattr(metadata, "distribution", lambda name: EditableInstall(tmp_path / "checkout"))
    assert environment.gapless_source()["install"] == "editable"
    # an editable install of another checkout, this one on PYTHONPATH: it said "editable from <this checkout>"
    monkeypatch.setattr(metadata, "distribution", lambda name: EditableInstall(tmp_path / "main"))
    assert environment.gapless_source()["install"] == "not installed (PYTHONPATH)"


def test_env_vars_keep_the_relevant_ones():
    environ = {"NCCL_P2P_DISABLE": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "HF_HUB_OFFLINE": "1",
               "CUDA_VISIBLE_DEVICES": "0,1", "OMP_NUM_THREADS": "4", "HOME": "/root", "AWS_SECRET": "x",
               "HF_TOKEN": "hf_abc"}
    record = env_vars(environ)
    assert set(record) == {"NCCL_P2P_DISABLE", "PYTORCH_CUDA_ALLOC_CONF", "HF_HUB_OFFLINE", "CUDA_VISIBLE_DEVICES",
                           "OMP_NUM_THREADS", "HF_TOKEN"}
    assert "hf_abc" not in json.dumps(record)  # a credential is recorded as set, never copied into a run folder


def test_differences_are_dotted_leaves():
    a = {"packages": {"torch": "2.11.0", "peft": "0.17"}, "env": {"NCCL_P2P_DISABLE": "1"}}
    b = {"packages": {"torch": "2.13.0", "peft": "0.17"}, "env": {}}
    assert differences(a, b) == [("env.NCCL_P2P_DISABLE", "1", None), ("packages.torch", "2.11.0", "2.13.0")]


def test_compare_two_runs(tmp_path, capsys):
    record = environment_record(probe_kernels=False)
    for name, torch_version, lr in (("a", "2.11.0+cu130", 2e-4), ("b", "2.13.0+cu130", 1e-4)):
        run = tmp_path / name
        write_environment(run, {**record, "packages": {**record["packages"], "torch": torch_version}})
        (run / "config.yaml").write_text(yaml.safe_dump({"optim": {"lr": lr}, "output_dir": str(run)}))
    cmp = compare_runs(tmp_path / "a", tmp_path / "b")
    assert cmp["environment"]["differences"] == [{"key": "packages.torch", "a": "2.11.0+cu130", "b": "2.13.0+cu130"}]
    assert cmp["config"]["differences"] == [{"key": "optim.lr", "a": 2e-4, "b": 1e-4}]  # output_dir is left out
    assert main(["doctor", "--compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "environment: 1 differences" in out and "packages.torch" in out and "optim.lr" in out
    (tmp_path / "b" / "environment.json").unlink()
    assert "missing" in compare_runs(tmp_path / "a", tmp_path / "b")["environment"]


def test_kernel_probe_imports_flash_attn_4_with_its_disk_cache_on(monkeypatch, tmp_path):
    """flash-attn-4 reads FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED once, when imported; `gapless train` probes the
    kernels (environment.json) before the attention backend is built, so the probe itself must turn the cache on
    (run s19-startup: it did not, and every warm start-up recompiled flash-attn-4's kernels). A stand-in package
    records what it saw at import."""
    import sys

    package = tmp_path / "flash_attn" / "cute"
    package.mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (package / "__init__.py").write_text(
        "import os\nSEEN = os.environ.get('FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED')\n")
    for name in ("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert kernel_imports(probe=True)["flash-attn-4"] == "ok"
    assert sys.modules["flash_attn.cute"].SEEN == "1"
    for name in ("flash_attn", "flash_attn.cute"):  # the stand-in leaves with the test
        sys.modules.pop(name, None)
