"""docs/config.md is the reference generated from the dataclasses, and it is current: every field with its type,
default and meaning."""
import dataclasses
import typing
from pathlib import Path

from gapless.config import RunConfig
from gapless.config_reference import reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def all_fields(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = tp if dataclasses.is_dataclass(tp) else (typing.get_args(tp)[0] if typing.get_origin(tp) is list
                                                         and dataclasses.is_dataclass(typing.get_args(tp)[0]) else None)
        yield f"{prefix}{f.name}"
        if inner is not None and not f.name.startswith("eval_sources"):
            yield from all_fields(inner, f"{prefix}{f.name}{'[]' if inner is not tp else ''}.")


def test_docs_config_md_is_current():
    assert DOC.read_text() == reference(), \
        "docs/config.md is out of date: python -m gapless.config_reference > docs/config.md"


def test_every_field_has_a_row_with_a_meaning():
    rows = {line.split("|")[1].strip().strip("`"): line for line in reference().splitlines()
            if line.startswith("| `")}
    for name in all_fields(RunConfig):
        assert name in rows, name
        meaning = rows[name].rstrip().rstrip("|").split(" | ")[-1].strip()
        assert meaning, f"{name}: no comment in config.py says what it means"
    assert "| `optim.lr` | `float` | `0.0002` | the peak learning rate (after warmup) |" in rows["optim.lr"]
    assert rows["model.path"].split(" | ")[2] == "required"
