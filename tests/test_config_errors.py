"""Every config error at once, each naming its field; `--resume` and overrides in any order."""
import pytest

from gapless.cli import build_parser, main
from gapless.config import ConfigError, load_config


def test_every_error_listed_at_once():
    raw = {"model": {"path": "/m", "dtyp": "float32", "activation_checkpointing": "two"},
           "data": {"sources": [{"path": "a.jsonl", "format": "alpacca"}, {"path": "b.jsonl", "weight": "x"}]},
           "lora": {"r": 0}, "optim": {"lr": "fast"}, "trian": {}}
    with pytest.raises(ConfigError) as e:
        load_config(data=raw)
    lines = e.value.errors
    assert str(e.value).startswith(f"{len(lines)} errors:\n")
    expected = ["config.trian: unknown key; did you mean 'train'?", "config.model.dtyp: unknown key",
                "config.model.activation_checkpointing: expected an integer",
                "config.data.sources[0].format: 'alpacca' is not one of",
                "config.data.sources[1].weight:", "config.lora.r: must be a positive integer",
                "config.optim.lr: expected a number"]
    for want in expected:
        assert any(line.startswith(want) for line in lines), (want, lines)
    assert len(lines) == len(expected)


def test_one_error_reads_as_one_line():
    with pytest.raises(ValueError) as e:
        load_config(data={"model": {"path": "/m"}, "data": {"sources": [{"path": "a"}]}, "lora": {"r": -1}})
    assert str(e.value) == "config.lora.r: must be a positive integer, got -1"


@pytest.mark.parametrize("argv", [["train", "c.yaml", "--resume", "a.b=1", "c=2"],
                                  ["train", "--resume", "c.yaml", "a.b=1", "c=2"],
                                  ["train", "c.yaml", "a.b=1", "--resume", "c=2"],
                                  ["train", "c.yaml", "a.b=1", "c=2", "--resume"]])
def test_resume_anywhere(argv, monkeypatch):
    seen = {}
    monkeypatch.setattr("gapless.cli.run_train", lambda args: seen.update(vars(args)) or 0)
    parser = build_parser()
    parser._subparsers._group_actions[0].choices["train"].set_defaults(func=lambda a: seen.update(vars(a)) or 0)
    monkeypatch.setattr("gapless.cli.build_parser", lambda: parser)
    assert main(argv) == 0
    assert seen["resume"] and seen["config"] == "c.yaml" and seen["overrides"] == ["a.b=1", "c=2"]


def test_stray_argument_is_an_error(capsys):
    with pytest.raises(SystemExit):
        main(["train", "c.yaml", "--resume", "stray"])
    assert "unrecognized arguments: stray" in capsys.readouterr().err


def test_a_key_given_twice_is_an_error_naming_it_and_its_lines(tmp_path):
    # PyYAML keeps the last of two equal keys: the second lora section would replace the first whole (r back to 16)
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: /m}\nlora:\n  r: 8\ndata: {sources: [{path: a.jsonl}]}\nlora:\n  dropout: 0.1\n")
    with pytest.raises(ValueError, match=r"c\.yaml: not valid YAML: 'lora' is given twice in one mapping "
                                         r"\(lines 2 and 5\)"):
        load_config(path)
    # anchors and merge keys still read, an explicit key overriding a merged one
    path.write_text("model: {path: /m}\ndata: {sources: [{path: a.jsonl}]}\nlora: &l {r: 8, alpha: 16}\n"
                    "optim: {lr: 1.0e-3}\nschedule: {kind: linear}\ntrain: {steps: 3}\n")
    assert load_config(path).lora.r == 8
    path.write_text("model: {path: /m}\ndata: {sources: [{path: a.jsonl}]}\nlora:\n  <<: {r: 8, alpha: 16}\n  r: 4\n")
    assert (load_config(path).lora.r, load_config(path).lora.alpha) == (4, 16)


def test_an_overrides_mistake_is_named_as_the_override_not_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: /m}\ndata: {sources: [{path: a.jsonl}]}\nlora: {r: 16}\ntrain: {stesp: 3}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["lora.r=16.5", "optim.learning_rate=1e-4", "data.sources.0.format=alpacca"])
    lines = e.value.errors
    # the file holds r: 16; "c.yaml.lora.r: expected an integer, got 16.5" sent the user to the wrong place
    assert "override lora.r: expected an integer, got 16.5" in lines
    assert any(line.startswith("override optim.learning_rate: unknown key; did you mean 'lr'?") for line in lines)
    assert any(line.startswith("override data.sources[0].format: 'alpacca' is not one of") for line in lines)
    assert any(line.startswith(f"{path}.train.stesp: unknown key") for line in lines)  # the file's own mistake
