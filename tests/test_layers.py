"""The imports point one way (ARCHITECTURE.md, "Layers and their imports"): a lower layer never imports a higher
one, model and data never import each other, and model, data and kernels never import torch.distributed. Every
import in src/gapless is read with ast, lazy ones inside functions too: a lazy upward import is still one."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gapless"
# lower number = lower layer; cli and the commands (bench, demo, diagnosis, convert, ...) sit on top
RANKS = {"kernels": 0, "config": 1, "config_reference": 1, "bytecode": 1, "model": 2, "data": 2, "meter": 3,
         "train": 4}
TOP = 9


def layer_of(module: str) -> str:
    """gapless.model.lora -> model; gapless.config -> config; gapless -> gapless (the package: __version__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "gapless"


def imports(path: Path):
    """(line, imported module) for every gapless or torch.distributed import in `path`."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "gapless":  # from gapless import config: the submodule named
                for alias in node.names:
                    yield node.lineno, f"gapless.{alias.name}"
            else:
                yield node.lineno, node.module


def violations(path: Path) -> list[str]:
    module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
    mine = layer_of(module)
    found = []
    for line, name in imports(path):
        where = f"{path.relative_to(SRC.parent)}:{line} imports {name}"
        if name.startswith("torch.distributed") and mine in ("kernels", "model", "data"):
            found.append(where)
        if not name.startswith("gapless.") or name == "gapless.__version__":
            continue
        other = layer_of(name)
        if other == mine:
            continue
        if RANKS.get(other, TOP) > RANKS.get(mine, TOP) or {mine, other} == {"model", "data"}:
            found.append(where)
    return found


def test_no_module_imports_a_higher_layer():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 40
    assert [v for path in files for v in violations(path)] == []


@pytest.mark.parametrize("source, bad", [
    ("from gapless.train.loop import resolve_device\n", True),  # model -> train, the one this test was written for
    ("def f():\n    from gapless.data.tokenize import x\n", True),  # model -> data, lazily
    ("import torch.distributed as dist\n", True),
    ("from gapless.config import RunConfig\nfrom gapless.kernels.lora import y\n", False),
    ("from gapless import __version__\n", False),
])
def test_the_check_finds_an_upward_import(tmp_path, monkeypatch, source, bad):
    fake = tmp_path / "gapless" / "model" / "fake.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path / "gapless")
    assert bool(violations(fake)) == bad
