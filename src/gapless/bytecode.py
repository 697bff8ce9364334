"""The bytecode of a gapless process's imports, kept where Python would otherwise compile it again on every start.

Python compiles a module's source to bytecode when it finds no .pyc for it, and writes the .pyc beside the source
unless PYTHONDONTWRITEBYTECODE is set (many Docker images set it) or the folder is read-only. A torch installed
without its .pyc files (`pip install --no-compile`, some images) in such an environment compiles its ~2,400
modules from source in every process: on the GPU machine a warm start's profile showed 10.8 s in `compile` (under
cProfile; its imports took 10.0 s of a 23.6 s start, bench/RESULTS.md tenth round). On the 2-core CPU box, importing
gapless's training path took 9-10 s against 4.6 s with the bytecode cached. There gapless keeps the bytecode in
its own cache folder (sys.pycache_prefix: a mirror tree of .pyc files, never beside the sources), for this process
and the ones it starts (torch.compile's workers, data workers). Nothing changes where the user set
PYTHONPYCACHEPREFIX, or where torch's own .pyc files exist.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

PYCACHE = Path("~/.cache/gapless/pycache")


def has_bytecode(package: str) -> bool:
    """Whether `package` (found, not imported) has a .pyc of its __init__ for this interpreter beside its source
    (True for a package that is not installed or has no source: nothing to compile)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return True
    source = Path(spec.origin)
    return (source.parent / "__pycache__" / f"{source.stem}.{sys.implementation.cache_tag}.pyc").is_file()


def cache_bytecode(folder: Path = PYCACHE, probe: str = "torch") -> Path | None:
    """Keep the bytecode of what this process imports from now on under `folder` when `probe` has no .pyc and none
    would be written beside its sources (module docstring); returns the folder, or None where nothing changed."""
    if sys.pycache_prefix is not None or has_bytecode(probe):
        return None
    folder = folder.expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # no writable cache: compile as before
        return None
    sys.pycache_prefix, sys.dont_write_bytecode = str(folder), False
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)  # the processes it starts
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return folder
