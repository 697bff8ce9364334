"""The run config: every shipped config parses, dotted overrides reach any field (list entries too),
and each mistake raises a ValueError that names the field and says what to do (STYLE.md 4)."""
import copy
from pathlib import Path

import pytest
import yaml

from gapless.config import RunConfig, from_dict, load_config, to_dict

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))
MINIMAL = {"model": {"path": "models/tiny"}, "data": {"sources": [{"path": "train.jsonl"}]}}


def config(overrides=(), **sections) -> RunConfig:
    raw = copy.deepcopy(MINIMAL)
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(name), dict):
            raw[name].update(value)
        else:
            raw[name] = value
    return load_config(data=raw, overrides=list(overrides))


def test_shipped_examples_parse():
    assert len(EXAMPLES) >= 4, EXAMPLES
    for path in EXAMPLES:
        cfg = load_config(path)
        assert cfg.model.path and cfg.data.sources, path
        # the override the examples' header comments tell users to type
        cfg = load_config(path, ["model.path=/models/x", "data.sources.0.path=mine.jsonl", "optim.lr=1e-4"])
        assert (cfg.model.path, cfg.data.sources[0].path, cfg.optim.lr) == ("/models/x", "mine.jsonl", 1e-4), path
        # what the run folder's config.yaml holds parses back to the same config
        assert from_dict(RunConfig, yaml.safe_load(yaml.safe_dump(to_dict(cfg)))) == cfg, path


def test_minimal_config_defaults():
    cfg = config()
    assert cfg.method == "lora" and cfg.lora.r == 16 and cfg.train.grad_accum == 1
    assert cfg.data.sources[0].format == "auto" and cfg.checkpoint.every == "auto" and not cfg.resume


def test_dotted_overrides():
    cfg = config([
        "train.steps=100", "lora.r=8", "lora.target_modules=[q_proj, v_proj]", "optim.betas=[0.9, 0.95]",
        "data.sources.0.path=other.jsonl", "data.sources.0.columns.messages=conversation",
        "optim.lr=2e-4",  # YAML 1.1 reads 2e-4 as a string; a float field takes it as the number
        "resume=true", "data.chat_template='{{ x == 1 }}'",  # only the first '=' splits
        "checkpoint.every=50",
    ], data={"sources": [{"path": "a.jsonl"}, {"path": "b.jsonl", "weight": 2}]})
    assert cfg.train.steps == 100 and cfg.lora.r == 8 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.optim.betas == [0.9, 0.95] and cfg.optim.lr == 2e-4 and isinstance(cfg.optim.lr, float)
    assert [s.path for s in cfg.data.sources] == ["other.jsonl", "b.jsonl"]
    assert cfg.data.sources[0].columns == {"messages": "conversation"} and cfg.data.sources[1].weight == 2.0
    assert cfg.resume is True and cfg.data.chat_template == "{{ x == 1 }}"
    # a whole list entry, and a section that was not in the file
    cfg = config(["data.sources.1={path: c.jsonl, epochs: 2}", "schedule.kind=linear"],
                 data={"sources": [{"path": "a.jsonl"}, {"path": "b.jsonl"}]})
    assert cfg.data.sources[1].path == "c.jsonl" and cfg.data.sources[1].epochs == 2.0
    assert cfg.schedule.kind == "linear"


def test_yaml_file_with_exponent_floats(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: m}\ndata: {sources: [{path: t.jsonl}]}\noptim: {lr: 2e-4, eps: 1e-8}\n")
    cfg = load_config(path)
    assert (cfg.optim.lr, cfg.optim.eps) == (2e-4, 1e-8)


# (overrides, what the message must contain). Each entry is one mistake on the minimal config.
MISTAKES = [
    # unknown keys, with the closest field suggested
    (["trian.steps=3"], ["config.trian", "unknown key", "did you mean 'train'"]),
    (["train.step=3"], ["config.train.step", "did you mean 'steps'"]),
    (["lora.rank=8"], ["config.lora.rank", "unknown key"]),
    (["data.sources.0.pth=x"], ["config.data.sources[0].pth", "did you mean 'path'"]),
    # wrong types
    (["train.steps=ten"], ["config.train.steps", "expected an integer", "'ten'"]),
    (["train.steps=1.5"], ["config.train.steps", "expected an integer"]),
    (["train.steps=true"], ["config.train.steps", "expected an integer"]),
    (["optim.lr=fast"], ["config.optim.lr", "expected a number", "'fast'"]),
    (["resume=yes please"], ["config.resume", "expected true or false"]),
    (["lora.target_modules=q_proj"], ["config.lora.target_modules", "expected a list"]),
    (["model=models/tiny"], ["config.model", "expected a mapping of ModelConfig"]),
    (["data.sources.0=train.jsonl"], ["config.data.sources[0]", "expected a mapping of SourceConfig"]),
    (["data.sources.0.columns=[a]"], ["config.data.sources[0].columns", "expected a mapping"]),
    # bad Literal values, with a suggestion when one is close
    (["schedule.kind=cosin"], ["config.schedule.kind", "'cosin' is not one of", "did you mean 'cosine'"]),
    (["model.dtype=bf16"], ["config.model.dtype", "'bf16' is not one of"]),
    (["data.sources.0.format=jsonl"], ["config.data.sources[0].format", "'jsonl' is not one of"]),
    (["data.batching=pack"], ["config.data.batching", "did you mean 'packed'"]),
    (["method=qlora2"], ["config.method", "is not one of ['lora', 'qlora', 'full']", "did you mean 'qlora'"]),
    # impossible values and combinations
    (["train.eval_every=10"], ["config.train.eval_every", "no held-out data", "data.eval_fraction"]),
    (["train.steps=-1"], ["config.train.steps", "must be >= 0"]),
    (["train.grad_accum=0"], ["config.train.grad_accum", "must be >= 1"]),
    (["train.log_every=-5"], ["config.train.log_every", "must be >= 1"]),
    (["train.eval_every=-1"], ["config.train.eval_every", "must be >= 0"]),
    (["train.epochs=0"], ["config.train", "set steps > 0 or epochs > 0"]),
    (["train.evals_per_epoch=2"], ["config.train.evals_per_epoch", "no held-out data", "data.eval_fraction"]),
    (["train.evals_per_epoch=0", "data.eval_fraction=0.1"], ["config.train.evals_per_epoch", "integer >= 1"]),
    (["train.evals_per_epoch=1.5"], ["config.train.evals_per_epoch", "expected an integer"]),
    (["train.evals_per_epoch=2", "train.eval_every=10", "data.eval_fraction=0.1"],
     ["config.train", "eval_every=10 and evals_per_epoch=2 are both set; keep one"]),
    (["checkpoint.per_epoch=0"], ["config.checkpoint.per_epoch", "integer >= 1"]),
    (["checkpoint.per_epoch=2", "checkpoint.every=100"],
     ["config.checkpoint", "every=100 and per_epoch=2 are both set; keep one"]),
    (["checkpoint.per_epoch=2", "checkpoint.every=0"], ["config.checkpoint", "every=0 and per_epoch=2 are both set"]),
    (["lora.r=0"], ["config.lora.r", "positive"]),
    (["lora.r=-4"], ["config.lora.r", "positive"]),
    (["lora.dropout=1.0"], ["config.lora.dropout", "[0, 1)"]),
    (["lora.target_modules=[q_proj, lm_head]"], ["config.lora.target_modules", "lm_head"]),
    (["optim.lr=-1e-4"], ["config.optim.lr", "must be positive"]),
    (["optim.lr=0"], ["config.optim.lr", "must be positive"]),
    (["optim.weight_decay=-0.1"], ["config.optim.weight_decay", ">= 0"]),
    (["optim.grad_clip=-1"], ["config.optim.grad_clip", ">= 0"]),
    (["optim.betas=[0.9]"], ["config.optim.betas", "two numbers"]),
    (["schedule.warmup_steps=-10"], ["config.schedule.warmup_steps", ">= 0"]),
    (["schedule.warmup_steps=10", "schedule.warmup_ratio=0.1"], ["config.schedule", "both set"]),
    (["checkpoint.every=-1"], ["config.checkpoint.every", ">= 0"]),
    (["checkpoint.every=sometimes"], ["config.checkpoint.every", "'sometimes'", "'auto'"]),
    (["checkpoint.keep=0"], ["config.checkpoint.keep", ">= 1"]),
    (["data.max_seq_len=1"], ["config.data.max_seq_len", "at least 2"]),
    (["data.tokens_per_batch=100", "data.max_seq_len=4096"], ["config.data.tokens_per_batch", "max_seq_len"]),
    (["data.rows_per_batch=2"], ["config.data.rows_per_batch", "config.data.batching packed", "batching: padded"]),
    (["data.batching=padded", "data.rows_per_batch=0"], ["config.data.rows_per_batch", "at least 1"]),
    (["data.eval_fraction=-0.1"], ["config.data.eval_fraction", "[0, 1)"]),
    (["data.num_workers=-2"], ["config.data.num_workers", ">= 0"]),
    (["data.sources=[]"], ["config.data.sources", "at least one source"]),
    (["data.sources.0.weight=-1"], ["config.data.sources[0].weight", "must be positive"]),
    (["data.sources.0.weight=1", "data.sources.0.epochs=2"], ["config.data.sources[0]", "not both"]),
    (["data.sources.0.format=text", "data.sources.0.drop_system_message=true"],
     ["config.data.sources[0].drop_system_message", "format text has no system turn"]),
    (["data.sources.0.path= "], ["config.data.sources[0].path", "expected a string"]),
    (["data.sources.0.path=' '"], ["config.data.sources[0].path", "empty"]),
    (["model.path="], ["config.model.path", "empty"]),
    (["model.device=tpu"], ["config.model.device", "'tpu'"]),
    (["model.attn_backend=fa4op"], ["config.model.attn_backend", "'fa4op'", "did you mean 'fa4_op'"]),
    (["model.compile=fast"], ["config.model.compile", "'fast'", "true | false | 'auto'"]),
    # malformed overrides
    (["train.steps"], ["override 'train.steps'", "expected key=value"]),
    (["data.chat_template={{ x }}"], ["override 'data.chat_template={{ x }}'", "not valid YAML", "quote it"]),
    (["model.path.x=1"], ["override 'model.path.x=1'", "model.path is not a section"]),
    (["data.sources.3.path=x"], ["override 'data.sources.3.path=x'", "data.sources is a list of 1", "'3'"]),
    (["data.sources.first.path=x"], ["data.sources is a list of 1", "'first' is not an index"]),
]


@pytest.mark.parametrize("overrides,expected", MISTAKES, ids=[" ".join(o) for o, _ in MISTAKES])
def test_mistakes_name_their_field(overrides, expected):
    with pytest.raises(ValueError) as err:
        config(overrides)
    for text in expected:
        assert text in str(err.value), (text, str(err.value))


def test_missing_required_fields():
    with pytest.raises(ValueError, match=r"config\.model\.path: required field is missing"):
        load_config(data={"model": {"dtype": "float32"}, "data": MINIMAL["data"]})
    with pytest.raises(ValueError, match=r"config\.model: required field is missing"):
        load_config(data={"data": MINIMAL["data"]})
    with pytest.raises(ValueError, match=r"config\.data\.sources\[0\]\.path: required field is missing"):
        load_config(data={"model": {"path": "m"}, "data": {"sources": [{"format": "messages"}]}})
    with pytest.raises(ValueError, match=r"config\.data: required field is missing"):
        load_config(data={"model": {"path": "m"}})


def test_errors_name_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: m}\ndata: {sources: [{path: t.jsonl}]}\ntrain: {stesp: 3}\n")
    with pytest.raises(ValueError, match=rf"{path}\.train\.stesp: unknown key; did you mean 'steps'"):
        load_config(path)
    with pytest.raises(ValueError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    path.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="top level must be a mapping"):
        load_config(path)


def test_ignored_settings_warn():
    with pytest.warns(UserWarning, match="checkpoint.every is 0"):
        config(["resume=true", "checkpoint.every=0"])
    with pytest.warns(UserWarning, match="min_lr_ratio=0.1 is ignored"):
        config(["schedule.kind=constant", "schedule.min_lr_ratio=0.1"])


def test_round_trip_through_yaml():
    cfg = config(["lora.r=4", "data.eval_fraction=0.05", "train.eval_every=10", "optim.fused=false",
                  "data.sources.0.roles={human: user}", "data.sources.0.weight=0.5"])
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    assert load_config(data=yaml.safe_load(text)) == cfg


def test_every_path_field_expands_a_leading_tilde(monkeypatch, tmp_path):
    """YAML does not expand `~` as a shell does; every path field reads as the expanded path, so each reader of the
    config (the loader, the tokenizer, the run folder) sees the same one. output_dir was expanded by its check
    only, and the run folder itself was then made at ./~/..."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = config(model={"path": "~/models/x"}, output_dir="~/runs/r",
                 data={"sources": [{"path": "~/data/*.jsonl"}], "eval_sources": [{"path": "~/eval.jsonl"}],
                       "tokenizer": "~/tok", "cache_dir": "~/cache"})
    assert cfg.model.path == f"{tmp_path}/models/x" and cfg.output_dir == f"{tmp_path}/runs/r"
    assert cfg.data.sources[0].path == f"{tmp_path}/data/*.jsonl" and cfg.data.eval_sources[0].path == (
        f"{tmp_path}/eval.jsonl")
    assert (cfg.data.tokenizer, cfg.data.cache_dir) == (f"{tmp_path}/tok", f"{tmp_path}/cache")
    assert config().data.cache_dir == f"{tmp_path}/.cache/gapless/data"  # a default too: config.yaml reads back equal
    # through a dotted override too; a path without ~ stays as written (relative paths are the cwd's)
    assert config(["model.path=~/m"]).model.path == f"{tmp_path}/m"
    assert config(["model.path=models/~x"]).model.path == "models/~x"
