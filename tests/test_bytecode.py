"""gapless.bytecode: where a package has no .pyc and none would be written, the bytecode goes to gapless's cache."""
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run(tmp_path, probe_has_pyc: bool, env_extra: dict) -> tuple[str, Path]:
    pkg = tmp_path / "site" / "probepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 41 + 1\n")
    (pkg / "sub.py").write_text("OTHER = 'x'\n")
    if probe_has_pyc:
        import py_compile
        py_compile.compile(str(pkg / "__init__.py"), cfile=str(
            pkg / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc"))
    cache = tmp_path / "pycache"
    code = ("import os, sys; from pathlib import Path; from gapless.bytecode import cache_bytecode; "
            f"print(cache_bytecode(Path({str(cache)!r}), probe='probepkg')); "
            "import probepkg, probepkg.sub; print(probepkg.VALUE, sys.dont_write_bytecode, "
            "os.environ.get('PYTHONPYCACHEPREFIX'), 'PYTHONDONTWRITEBYTECODE' in os.environ)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX",)}
    env.update({"PYTHONPATH": os.pathsep.join([SRC, str(tmp_path / "site")]), "PYTHONDONTWRITEBYTECODE": "1",
                **env_extra})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    return out, cache


def test_no_bytecode_and_none_written_goes_to_the_cache(tmp_path):
    out, cache = run(tmp_path, probe_has_pyc=False, env_extra={})
    assert out.splitlines() == [str(cache), f"42 False {cache} False"]
    mirrored = {p.name for p in cache.rglob("*.pyc")}
    tag = sys.implementation.cache_tag
    assert {f"__init__.{tag}.pyc", f"sub.{tag}.pyc"} <= mirrored  # both modules' bytecode, under the prefix
    assert not (tmp_path / "site" / "probepkg" / "__pycache__").exists()  # nothing beside the sources


def test_existing_bytecode_or_a_prefix_the_user_set_changes_nothing(tmp_path):
    out, cache = run(tmp_path, probe_has_pyc=True, env_extra={})
    assert out.splitlines() == ["None", "42 True None True"] and not cache.exists()
    mine = tmp_path / "mine"
    out, cache = run(tmp_path / "b", probe_has_pyc=False, env_extra={"PYTHONPYCACHEPREFIX": str(mine)})
    assert out.splitlines() == ["None", f"42 True {mine} True"] and not cache.exists()
