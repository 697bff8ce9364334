"""The config reference, docs/config.md, generated from the dataclasses of gapless.config.

Every field of a run's config, by its dotted name, with its type, its default and its meaning: the comment above
the field and the one after it in config.py (the schema's one source; tests/test_config_reference.py checks that
docs/config.md is current). Regenerate with `python -m gapless.config_reference > docs/config.md`.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import typing

from gapless import config as config_module
from gapless.config import RunConfig


def _comments(lines: list[str], node: ast.AnnAssign) -> str:
    """The comment lines directly above the field and the comment after it on its own line(s)."""
    above = []
    i = node.lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        above.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    after = []
    for line in lines[node.lineno - 1:node.end_lineno]:
        code, sep, comment = line.partition("  # ")
        if sep and code.count('"') % 2 == 0:
            after.append(comment.strip())
    return " ".join(above + after)


def _field_docs() -> dict[str, dict[str, tuple[str, str]]]:
    """class name -> field -> (annotation as written, meaning)."""
    source = inspect.getsource(config_module)
    lines = source.splitlines()
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            fields = {}
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    # an annotation written over several lines (a long Literal) on one line: a table row
                    annotation = " ".join(ast.get_source_segment(source, item.annotation).split())
                    fields[item.target.id] = (annotation, _comments(lines, item))
            out[node.name] = fields
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(section)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _nested(tp) -> type | None:
    """The dataclass a field holds (itself or as list items), if any."""
    if dataclasses.is_dataclass(tp):
        return tp
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _rows(cls: type, prefix: str, docs: dict, sections: list) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        annotation, meaning = docs[cls.__name__][f.name]
        inner = _nested(hints[f.name])
        name = f"{prefix}{f.name}"
        if inner is not None and inner is not cls:
            is_list = typing.get_origin(hints[f.name]) is list
            sections.append((f"{name}[]" if is_list else name, inner, meaning))
            rows.append(f"| `{name}` | {'list of ' if is_list else ''}{inner.__name__} | "
                        f"{'`[]`' if is_list else '(section)'} | {_cell(meaning) or f'see `{name}` below'} |")
            continue
        rows.append(f"| `{name}` | `{_cell(annotation)}` | {_default(f)} | {_cell(meaning)} |")
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference() -> str:
    docs = _field_docs()
    parts = ["# gapless config reference", "",
             "Generated from the dataclasses of `gapless/config.py` by `python -m gapless.config_reference > "
             "docs/config.md`; `tests/test_config_reference.py` fails when it is out of date. A YAML config maps one "
             "to one onto these fields; `key=value` overrides on the command line use the dotted names "
             "(`data.sources.0.path=train.jsonl` for a list entry). `gapless train` also reads Axolotl and TRL "
             "configs (`gapless convert-config` shows the mapping).", ""]
    queue = [("", RunConfig, "")]
    done: dict[type, str] = {}
    while queue:
        name, cls, meaning = queue.pop(0)
        sections: list = []
        title = f"`{name}`: {cls.__name__}" if name else "top level: RunConfig"
        if cls in done:  # a second list of the same entries (data.eval_sources): one table is enough
            parts += [f"## {title}", "", " ".join(p for p in (meaning, f"Fields as `{done[cls]}`.") if p), ""]
            continue
        done[cls] = name
        doc = inspect.getdoc(cls) if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}(") else ""
        parts += [f"## {title}", ""]
        intro = " ".join(p for p in dict.fromkeys([meaning, doc]) if p)  # the comment at its use, the docstring
        if intro:
            parts += [intro, ""]
        parts += ["| field | type | default | meaning |", "|---|---|---|---|"]
        parts += _rows(cls, f"{name}." if name else "", docs, sections)
        parts.append("")
        queue = sections + queue
    return "\n".join(parts)


if __name__ == "__main__":
    print(reference(), end="")
