"""Axolotl and TRL configs, written from their public documentation (Axolotl's config reference and dataset
formats pages; TRL's SFTConfig and `trl sft --config` YAML), convert to gapless configs and train a few steps on
the demo's tiny Llama; what gapless cannot honour is refused, every key named at once."""
import io
import json
import typing
from pathlib import Path

import pytest
import yaml

from gapless import demo_task
from gapless.cli import main
from gapless.config import ALL_LINEAR, from_dict, RunConfig
from gapless.convert import check_local, check_run_paths, convert, detect, load_any
from gapless.data.chat_templates import LLAMAFACTORY as LF_JINJA, LLAMAFACTORY_UNCUT as LF_JINJA_UNCUT
from gapless.data.chat_templates import TEMPLATES
from gapless.data.formats import read_source
from gapless.demo import write_base_model
from gapless.train.loop import train

# Axolotl's documented keys (docs.axolotl.ai/docs/config-reference.html), a LoRA run as its examples write it
AXOLOTL = """
base_model: {model}
model_type: AutoModelForCausalLM
tokenizer_type: AutoTokenizer
load_in_8bit: false
load_in_4bit: false
strict: false
chat_template: tokenizer_default
datasets:
  - path: {alpaca}
    type: alpaca
  - path: {sharegpt}
    type: sharegpt
    roles:
      user: [human]
      assistant: [gpt]
  - path: {chat}
    type: chat_template
    field_messages: conversation
    message_property_mappings:
      role: speaker
      content: text
    roles_to_train: ["assistant"]
dataset_prepared_path:
val_set_size: 0.05
output_dir: {out}
sequence_len: 64
sample_packing: true
pad_to_sequence_len: true
adapter: lora
lora_model_dir:
lora_r: 4
lora_alpha: 8
lora_dropout: 0.0
lora_target_linear: true
wandb_project:
wandb_entity:
gradient_accumulation_steps: 2
micro_batch_size: 2
num_epochs: 1
max_steps: 3
optimizer: adamw_torch
lr_scheduler: cosine
learning_rate: 0.0002
weight_decay: 0.0
warmup_steps: 1
train_on_inputs: false
group_by_length: false
bf16: false
fp16: false
tf32: false
gradient_checkpointing: true
logging_steps: 1
flash_attention: false
eval_steps: 2
save_steps: 2
"""

# TRL's SFTConfig / TrainingArguments fields as `trl sft --config sft.yaml` reads them, with the script and
# PEFT model arguments (huggingface.co/docs/trl/sft_trainer, clis)
TRL = """
model_name_or_path: {model}
dataset_name: {chat}
output_dir: {out}
max_length: 64
packing: true
per_device_train_batch_size: 2
gradient_accumulation_steps: 1
learning_rate: 2.0e-4
lr_scheduler_type: linear
warmup_ratio: 0.1
num_train_epochs: 1
max_steps: 3
optim: adamw_torch
weight_decay: 0.01
max_grad_norm: 1.0
bf16: false
gradient_checkpointing: false
logging_steps: 1
save_strategy: steps
save_steps: 3
eval_strategy: "no"
seed: 7
report_to: none
assistant_only_loss: true
use_peft: true
lora_r: 4
lora_alpha: 8
lora_dropout: 0.0
lora_target_modules: all-linear
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("convert")
    examples = demo_task.make_examples(60, seed=1)
    pairs = [(e["messages"][0]["content"], e["messages"][1]["content"]) for e in examples]
    alpaca = root / "alpaca.jsonl"
    alpaca.write_text("".join(json.dumps({"instruction": q, "input": "", "output": a}) + "\n" for q, a in pairs))
    sharegpt = root / "sharegpt.jsonl"
    sharegpt.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": q},
                                                              {"from": "gpt", "value": a}]}) + "\n"
                                for q, a in pairs))
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps({"conversation": [{"speaker": "user", "text": q},
                                                         {"speaker": "assistant", "text": a}]}) + "\n"
                            for q, a in pairs))
    trl_chat = root / "trl_chat.jsonl"
    demo_task.write_jsonl(examples, trl_chat)
    return {"root": root, "model": write_base_model(root / "base", seed=0), "alpaca": alpaca,
            "sharegpt": sharegpt, "chat": chat, "trl_chat": trl_chat}


def write(files, text: str, name: str, **fmt) -> Path:
    path = files["root"] / name
    path.write_text(text.format(**{**{k: v for k, v in files.items()}, **fmt}))
    return path


def cpu(files) -> list[str]:
    return ["model.device=cpu", "model.dtype=float32", f"data.cache_dir={files['root'] / 'cache'}",
            "data.num_workers=0", "progress=false"]


def test_axolotl_converts_every_key_and_trains(files, capsys):
    path = write(files, AXOLOTL, "axolotl.yaml", out=files["root"] / "run_axolotl")
    raw = yaml.safe_load(path.read_text())
    assert detect(raw) == "axolotl"
    cfg = load_any(path, cpu(files))
    printed = capsys.readouterr().err
    assert "axolotl config -> gapless" in printed and "lora_r: 4" in printed and "lora.r: 4" in printed
    assert cfg.model.path == str(files["model"])
    assert [s.format for s in cfg.data.sources] == ["alpaca", "sharegpt", "messages"]
    assert cfg.data.sources[1].roles == {"human": "user", "gpt": "assistant"}
    assert cfg.data.sources[2].columns == {"messages": "conversation", "role": "speaker", "content": "text"}
    assert (cfg.data.max_seq_len, cfg.data.batching, cfg.data.tokens_per_batch) == (64, "packed", 128)
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.target_modules) == (4, 8.0, list(ALL_LINEAR))
    assert (cfg.train.grad_accum, cfg.train.steps, cfg.train.eval_every, cfg.checkpoint.every) == (2, 3, 2, 2)
    assert (cfg.optim.lr, cfg.schedule.kind, cfg.schedule.warmup_steps) == (2e-4, "cosine", 1)
    assert cfg.data.eval_fraction == 0.05 and cfg.model.activation_checkpointing == 1
    assert cfg.data.train_on == "assistant"
    # every key of the file appears in the printed mapping
    for key in raw:
        assert f"\n  {key}" in printed or f"\n  {key}:" in printed, key
    result = train(cfg)
    assert result.steps == 3 and len(result.losses) == 3 and (result.run_dir / "adapter").is_dir()


def test_trl_converts_and_trains(files, capsys):
    path = write(files, TRL, "trl.yaml", out=files["root"] / "run_trl", chat=files["trl_chat"])
    assert detect(yaml.safe_load(path.read_text())) == "trl"
    cfg = load_any(path, cpu(files))
    assert "trl config -> gapless" in capsys.readouterr().err
    assert (cfg.data.max_seq_len, cfg.data.batching, cfg.data.tokens_per_batch) == (64, "packed", 128)
    assert (cfg.schedule.kind, cfg.schedule.warmup_ratio, cfg.optim.weight_decay) == ("linear", 0.1, 0.01)
    assert (cfg.train.seed, cfg.train.steps, cfg.checkpoint.every, cfg.data.train_on) == (7, 3, 3, "assistant")
    assert cfg.lora.target_modules == list(ALL_LINEAR) and cfg.method == "lora"
    result = train(cfg)
    assert len(result.losses) == 3 and (result.run_dir / "adapter").is_dir()


def test_refuses_every_key_it_cannot_honour(files):
    text = AXOLOTL.replace("adapter: lora", "adapter: qlora").replace("optimizer: adamw_torch",
                                                                       "optimizer: adafactor")
    text = text.format(**files, out="x").replace("wandb_project:\n", "wandb_project: mine\nwandb_watch: all\n")
    raw = yaml.safe_load(text + "deepspeed: deepspeed_configs/zero2.json\nlr_scheduler_kwargs: {a: 1}\n")
    with pytest.raises(ValueError) as e:
        convert(raw)
    msg = str(e.value)
    for key in ("optimizer", "deepspeed", "wandb_watch", "lr_scheduler_kwargs"):
        assert f"\n  {key}:" in msg, key
    if "qlora" not in typing.get_args(typing.get_type_hints(RunConfig)["method"]):  # until QLoRA lands
        assert "adapter: qlora" in msg and "method 'qlora'" in msg


def test_low_memory_adamw_is_adamw_for_an_adapter_and_refused_for_full_fine_tuning(files):
    """Axolotl's and TRL's usual paged_adamw_8bit: an adapter's moments are small, so plain AdamW stands in (said in
    the mapping); full fine-tuning, whose moments are 8 bytes a weight, refuses it."""
    text = AXOLOTL.format(**files, out="x").replace("optimizer: adamw_torch", "optimizer: paged_adamw_8bit")
    ax = yaml.safe_load(text)
    conv = convert(ax)
    assert any(k == "optimizer: paged_adamw_8bit" and "AdamW with float32 moments" in v for k, v in conv.applied)
    assert from_dict(RunConfig, conv.config).method == "lora"
    with pytest.raises(ValueError, match=r"optimizer: paged_adamw_8bit: full fine-tuning keeps float32 AdamW"):
        convert({k: v for k, v in ax.items() if k != "adapter"})
    trl = yaml.safe_load(TRL.format(**files, out="x"))
    assert trl.get("use_peft")
    conv = convert({**trl, "optim": "adamw_8bit"})
    assert any(k == "optim: adamw_8bit" for k, _ in conv.applied)


def test_axolotl_tracking_keys_become_report_to(files):
    text = AXOLOTL.format(**files, out="x").replace(
        "wandb_project:\n", "wandb_project: mine\nwandb_name: first\nwandb_watch: false\nuse_tensorboard: true\n")
    raw = yaml.safe_load(text)
    conv = convert(raw)
    cfg = from_dict(RunConfig, conv.config)
    assert cfg.train.report_to == ["tensorboard", "wandb"]
    assert (cfg.train.wandb.project, cfg.train.wandb.name, cfg.train.wandb.mode) == ("mine", "first", "offline")
    assert "train.wandb.mode: offline  (gapless's default, no network; Axolotl uploads" in conv.format()
    assert from_dict(RunConfig, convert({**raw, "wandb_mode": "disabled"}).config).train.report_to == ["tensorboard"]
    assert from_dict(RunConfig, convert({**raw, "wandb_mode": "online"}).config).train.wandb.mode == "online"
    with pytest.raises(ValueError, match="wandb_log_model: checkpoint: gapless logs scalars to W&B"):
        convert({**raw, "wandb_log_model": "checkpoint"})


def test_trl_report_to_and_run_name(files):
    raw = yaml.safe_load(TRL.format(**files, out="x"))
    conv = convert({**raw, "report_to": ["tensorboard", "wandb"], "run_name": "r1"})
    cfg = from_dict(RunConfig, conv.config)
    assert cfg.train.report_to == ["tensorboard", "wandb"]
    assert (cfg.train.wandb.name, cfg.train.wandb.mode) == ("r1", "offline")
    cfg = from_dict(RunConfig, convert({**raw, "report_to": "tensorboard", "run_name": "r1"}).config)
    assert cfg.train.report_to == ["tensorboard"] and cfg.train.wandb.name is None  # run_name names a W&B run
    for value, why in (("mlflow", r"not \['mlflow'\]"), (["wandb", "all"], "name them instead of all")):
        with pytest.raises(ValueError, match=f"report_to: .*gapless reports to tensorboard and wandb .*{why}"):
            convert({**raw, "report_to": value})


def test_dataset_keys_refused_by_entry(files):
    raw = {"base_model": str(files["model"]), "datasets": [{"path": "x.jsonl", "type": "oasst"},
                                                            {"path": "y.jsonl", "type": "alpaca", "split": "test"}],
           "adapter": "lora"}
    with pytest.raises(ValueError, match=r"(?s)datasets\[0\]\.type.*datasets\[1\]\.split"):
        convert(raw)


def test_hub_ids_name_the_field():
    cfg = from_dict(RunConfig, {"model": {"path": "meta-llama/Llama-3.2-1B"},
                                "data": {"sources": [{"path": "./train.jsonl"}, {"path": "HuggingFaceH4/ultrachat"}]}})
    with pytest.raises(ValueError) as e:
        check_run_paths(cfg)
    msg = str(e.value)
    assert msg.startswith("model.path: 'meta-llama/Llama-3.2-1B' looks like a Hugging Face hub id")
    assert "local folder" in msg and "data.sources[1].path" in msg and "sources[0]" not in msg


def test_train_cli_hub_id(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {path: meta-llama/Llama-3.2-1B}\ndata: {sources: [{path: train.jsonl}]}\n")
    assert main(["train", str(cfg)]) == 2
    assert "model.path: 'meta-llama/Llama-3.2-1B' looks like a Hugging Face hub id" in capsys.readouterr().err


def converted_by_cli(src: Path, fmt: str, tmp_path: Path, capsys) -> RunConfig:
    """`gapless convert-config SRC --out OUT`: the config OUT holds, which reads as a gapless one."""
    out = tmp_path / "gapless.yaml"
    assert main(["convert-config", str(src), "--out", str(out)]) == 0
    assert f"{fmt} config -> gapless" in capsys.readouterr().out
    written = yaml.safe_load(out.read_text())
    assert detect(written) == "gapless"
    return from_dict(RunConfig, written)


def test_convert_config_cli_writes_gapless_yaml(files, tmp_path, capsys):
    path = write(files, TRL, "trl2.yaml", out=tmp_path / "run", chat=files["trl_chat"])
    cfg = converted_by_cli(path, "trl", tmp_path, capsys)
    assert cfg.model.path == str(files["model"]) and cfg.lora.r == 4


def test_a_converted_configs_errors_name_its_file(files, tmp_path):
    """TRL evaluating every 10 steps on a single file (no test split): the error named `config.train.eval_every`, a
    file that does not exist; it names the TRL file, as converted (the printed mapping ties eval_steps to it)."""
    path = write(files, TRL.replace('eval_strategy: "no"', "eval_strategy: steps\neval_steps: 10"), "trl_eval.yaml",
                 out=tmp_path / "run", chat=files["trl_chat"])
    with pytest.raises(ValueError, match=f"^{path} \\(trl config, as converted above\\): train.eval_every: 10 asks "
                                         "for evaluation but there is no held-out data"):
        load_any(path, cpu(files), out=io.StringIO())
    assert load_any(path, cpu(files) + ["data.eval_fraction=0.1"], out=io.StringIO()).train.eval_every == 10


def test_data_doctor_and_plan_read_a_peer_config_as_train_does(files, tmp_path, capsys):
    """`gapless data`, `doctor` and `plan` on a TRL config: each read its keys as gapless fields (model: required
    field is missing; data.use_peft: unknown key), where train converts it."""
    path = write(files, TRL, "trl_cmds.yaml", out=tmp_path / "run", chat=files["trl_chat"])
    assert main(["data", str(path), f"data.cache_dir={tmp_path / 'cache'}", "--set", "max_seq_len=32"]) == 0
    out, err = capsys.readouterr()
    assert "trl config -> gapless" in err and "max_seq_len 32" in out
    assert main(["plan", str(path), "--gpus", "H100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["workload"]["method"] == "lora"
    assert main(["doctor", str(path), *cpu(files)]) in (0, 1)  # findings, not a config error (exit 2)
    assert "cfg.tokens_per_step" in capsys.readouterr().out


def test_convert_config_cli_names_the_hub_ids_to_download(files, tmp_path, capsys):
    # axolotl examples/llama-3/qlora-1b.yml: a hub model and a hub dataset, written as they are, said before training
    raw = yaml.safe_load(AXOLOTL.format(**files, out=tmp_path / "run"))
    raw["base_model"] = "NousResearch/Llama-3.2-1B"
    raw["datasets"] = [{"path": "teknium/GPT4-LLM-Cleaned", "type": "alpaca"}]
    (tmp_path / "ax.yml").write_text(yaml.safe_dump(raw))
    assert main(["convert-config", str(tmp_path / "ax.yml"), "--out", str(tmp_path / "g.yaml")]) == 0
    said = capsys.readouterr().out.split("wrote ")[1].splitlines()
    assert said[1].startswith("before `gapless train") and "local folders" in said[1]
    assert said[2].startswith("  model.path: 'NousResearch/Llama-3.2-1B' looks like a Hugging Face hub id")
    assert said[3].startswith("  data.sources[0].path: 'teknium/GPT4-LLM-Cleaned' looks like") and len(said) == 4
    assert yaml.safe_load((tmp_path / "g.yaml").read_text())["model"]["path"] == "NousResearch/Llama-3.2-1B"
    path = write(files, TRL, "trl2.yaml", out=tmp_path / "run", chat=files["trl_chat"])  # local paths: nothing said
    assert main(["convert-config", str(path), "--out", str(tmp_path / "g2.yaml")]) == 0
    assert "before `gapless train" not in capsys.readouterr().out


def test_step_ratios_are_refused_or_mapped(files):
    """TrainingArguments reads save/eval/logging_steps below 1 as a ratio of the run: int() made save_steps 0.25
    checkpoint.every 0 (no checkpoints); transformers 5's warmup_steps below 1 is the warmup ratio."""
    raw = yaml.safe_load(TRL.format(**files, out="x"))
    for key in ("save_steps", "logging_steps"):
        with pytest.raises(ValueError, match=f"{key}: 0.25: a ratio of the run's steps"):
            convert({**raw, key: 0.25})
    with pytest.raises(ValueError, match="eval_steps: 0.1: a ratio"):
        convert({**raw, "eval_strategy": "steps", "eval_steps": 0.1})
    ax = yaml.safe_load(AXOLOTL.format(**files, out="x"))
    with pytest.raises(ValueError, match="save_steps: 0.5: a ratio"):
        convert({**ax, "save_steps": 0.5})
    trl = {k: v for k, v in raw.items() if k != "warmup_ratio"}
    cfg = from_dict(RunConfig, convert({**trl, "warmup_steps": 0.05}).config)
    assert (cfg.schedule.warmup_ratio, cfg.schedule.warmup_steps) == (0.05, 0)
    assert from_dict(RunConfig, convert({**trl, "warmup_steps": 2}).config).schedule.warmup_steps == 2


def test_unset_keys_take_the_peers_defaults(files):
    """An unset key means the peer's default, not gapless's: TRL trains 3 epochs at 2e-5 with a linear schedule
    and 8 rows per device; Axolotl one row (micro_batch_size 1) and requires learning_rate."""
    raw = {"model_name_or_path": str(files["model"]), "dataset_name": str(files["trl_chat"]), "max_length": 64}
    conv = convert(raw)
    cfg = from_dict(RunConfig, conv.config)
    assert (cfg.optim.lr, cfg.train.epochs, cfg.schedule.kind) == (2e-5, 3.0, "linear")
    assert (cfg.data.tokens_per_batch, cfg.data.batching) == (8 * 64, "padded")
    for key in ("learning_rate", "num_train_epochs", "lr_scheduler_type", "per_device_train_batch_size"):
        assert f"{key}: (unset)" in conv.format(), key
    ax = {k: v for k, v in yaml.safe_load(AXOLOTL.format(**files, out="x")).items() if k != "micro_batch_size"}
    cfg = from_dict(RunConfig, convert(ax).config)
    assert cfg.data.tokens_per_batch == 64  # one row of sequence_len
    del ax["learning_rate"]
    with pytest.raises(ValueError, match="learning_rate: missing"):
        convert(ax)


def test_unpacked_batch_sizes_are_documents_per_batch(files):
    """TRL's per_device_train_batch_size and Axolotl's micro_batch_size with packing off are that many examples per
    batch: data.rows_per_batch, within as many rows of slots. Mapped to the slots alone, gapless's padded batches
    held as many documents as fit (5 of the demo's ~21-token chats in 2 x 64 slots, 39 of 100 tokens in TRL's
    2 x 2048): another number of examples per optimizer step than the peer's. Packed, it stays rows of slots."""
    trl = yaml.safe_load(TRL.format(**{**files, "out": files["root"] / "run_trl_unpacked", "chat": files["trl_chat"]}))
    conv = convert({**trl, "packing": False})
    cfg = from_dict(RunConfig, conv.config)
    assert (cfg.data.batching, cfg.data.tokens_per_batch, cfg.data.rows_per_batch) == ("padded", 2 * 64, 2)
    assert ("per_device_train_batch_size: 2", "data.rows_per_batch: 2  (2 documents per batch, not as many as fit "
                                              "in the slots)") in conv.applied
    ax = yaml.safe_load(AXOLOTL.format(**files, out="x"))
    cfg = from_dict(RunConfig, convert({**ax, "sample_packing": False}).config)
    assert (cfg.data.batching, cfg.data.tokens_per_batch, cfg.data.rows_per_batch) == ("padded", 2 * 64, 2)
    # unset: the peers' defaults, TRL's 8 and Axolotl's 1, whose sample_packing is off unless set
    trl_default = convert({k: v for k, v in trl.items() if k not in ("packing", "per_device_train_batch_size")})
    assert "per_device_train_batch_size: (unset)" in trl_default.format()
    assert (trl_default.config["data"]["tokens_per_batch"], trl_default.config["data"]["rows_per_batch"]) == (512, 8)
    ax_default = convert({k: v for k, v in ax.items() if k not in ("sample_packing", "micro_batch_size")}).config
    assert (ax_default["data"]["batching"], ax_default["data"]["tokens_per_batch"],
            ax_default["data"]["rows_per_batch"]) == ("padded", 64, 1)
    for packed in (trl, ax):
        cfg = from_dict(RunConfig, convert(packed).config)
        assert (cfg.data.batching, cfg.data.tokens_per_batch, cfg.data.rows_per_batch) == ("packed", 128, None)
    # a max_length off the padding multiple (8): 2 documents of 63 tokens are padded to 64 each, so 2 x 64 slots
    odd = from_dict(RunConfig, convert({**trl, "packing": False, "max_length": 63}).config).data
    assert (odd.tokens_per_batch, odd.rows_per_batch, odd.max_seq_len) == (128, 2, 63)
    # a run of the converted TRL config trains, and keeps the cap in its resume state
    cfg = from_dict(RunConfig, {**conv.config, "model": {**conv.config["model"], "device": "cpu", "dtype": "float32"},
                                "data": {**conv.config["data"], "cache_dir": str(files["root"] / "cache"),
                                         "num_workers": 0}, "progress": False})
    result = train(cfg)
    assert result.steps == 3
    (meta,) = [json.loads(p.read_text()) for p in result.run_dir.glob("checkpoints/*/meta.json")]
    assert meta["sampler"]["rows_per_batch"] == 2


def test_harmless_keys_are_listed_and_their_harmful_values_refused(files):
    ax = yaml.safe_load(AXOLOTL.format(**files, out="x"))
    text = convert({**ax, "adapter": "qlora", "load_in_4bit": True, "special_tokens": {"pad_token": "<pad>"},
                    "gradient_checkpointing_kwargs": {"use_reentrant": False}}).format()
    for line in ("load_in_4bit: true", "special_tokens: {'pad_token': '<pad>'}",
                 "gradient_checkpointing_kwargs: {'use_reentrant': False}"):
        assert f"\n  {line}" in text, line
    with pytest.raises(ValueError, match=r"special_tokens: .*only pad_token may be set"):
        convert({**ax, "special_tokens": {"pad_token": "<pad>", "eos_token": "<|im_end|>"}})


def test_trl_prompt_completion_trains_the_completion(files, tmp_path):
    """TRL's completion_only_loss (None) trains only the completion of prompt-completion data, whatever
    assistant_only_loss says: train_on all trained the prompts too."""
    pc = tmp_path / "pc.jsonl"
    pc.write_text(json.dumps({"prompt": "shift: ab", "completion": "bc"}) + "\n")
    raw = {"model_name_or_path": str(files["model"]), "dataset_name": str(pc), "max_length": 64,
           "learning_rate": 1e-4}
    conv = convert(raw)
    assert conv.config["data"]["train_on"] == "assistant"
    assert "completion_only_loss: null" in conv.format()
    assert convert({**raw, "completion_only_loss": False}).config["data"]["train_on"] == "all"
    chat = convert({**raw, "dataset_name": str(files["trl_chat"]), "completion_only_loss": True})
    assert chat.config["data"]["train_on"] == "all"  # conversational data: everything, as TRL
    assert "completion_only_loss: true" in chat.format()


def test_evals_and_saves_per_epoch_map_to_per_epoch_fields(files):
    """Axolotl's evals_per_epoch / saves_per_epoch become train.evals_per_epoch / checkpoint.per_epoch, resolved to
    step intervals once the data is read (test_loop); with eval_steps / save_steps beside them they are refused."""
    ax = {k: v for k, v in yaml.safe_load(AXOLOTL.format(**files, out="x")).items()
          if k not in ("eval_steps", "save_steps")}
    conv = convert({**ax, "evals_per_epoch": 4, "saves_per_epoch": 2})
    cfg = from_dict(RunConfig, conv.config)
    assert (cfg.train.evals_per_epoch, cfg.train.eval_every) == (4, 0)
    assert (cfg.checkpoint.per_epoch, cfg.checkpoint.every) == (2, "auto")
    assert "evals_per_epoch: 4" in conv.format() and "train.eval_every = max(1, optimizer steps per epoch // 4)" \
        in conv.format()
    with pytest.raises(ValueError, match=r"(?s)evals_per_epoch: 4: eval_steps and evals_per_epoch are both set.*"
                                         r"saves_per_epoch: 2: save_steps and saves_per_epoch are both set"):
        convert({**ax, "evals_per_epoch": 4, "eval_steps": 2, "saves_per_epoch": 2, "save_steps": 2})
    with pytest.raises(ValueError, match="evals_per_epoch: 0.5: expected a whole number of times per epoch"):
        convert({**ax, "evals_per_epoch": 0.5})
    assert from_dict(RunConfig, convert({**ax, "saves_per_epoch": None}).config).checkpoint.per_epoch is None


def test_drop_system_message_maps_for_chat_template_datasets(files):
    """Axolotl's per-dataset drop_system_message (read by its chat_template strategy only) becomes the source's
    drop_system_message; on another dataset type Axolotl trains with the system turn, so it is refused there."""
    ax = yaml.safe_load(AXOLOTL.format(**files, out="x"))
    ax["datasets"][2]["drop_system_message"] = True
    conv = convert(ax)
    sources = from_dict(RunConfig, conv.config).data.sources
    assert [s.drop_system_message for s in sources] == [False, False, True]
    assert "leading system turn is dropped" in conv.format()
    ax["datasets"][0]["drop_system_message"] = True
    with pytest.raises(ValueError, match=r"datasets\[0\]\.drop_system_message: true: Axolotl drops the system turn "
                                         r"for type: chat_template only"):
        convert(ax)


@pytest.mark.parametrize("top, own, accepted", [("llama3", "llama3", True), ("gemma", "gemma", True),
                                                (None, "tokenizer_default", True), ("chatml", "llama3", False),
                                                ("chatml", "tokenizer_default", False), (None, "llama3", False)])
def test_a_datasets_own_chat_template_may_repeat_the_top_level_one(files, top, own, accepted):
    """Axolotl's instruct-lora-8b and gemma2 qlora examples name the template twice (top level and dataset): that
    was refused as 'a per-dataset template'; one that differs from the top-level one is (gapless has one)."""
    ax = yaml.safe_load(AXOLOTL.format(**files, out="x"))
    ax["chat_template"] = top
    ax["datasets"][2]["chat_template"] = own
    if accepted:
        conv = convert(ax)
        assert f"chat_template {own}: the top-level one" in conv.format()
        from_dict(RunConfig, conv.config)
    else:
        with pytest.raises(ValueError, match=rf"datasets\[2\]\.chat_template: {own}: differs from the top-level"):
            convert(ax)


@pytest.mark.parametrize("bf16, dtype", [("full", "bfloat16"), ("auto", "bfloat16"), (True, "bfloat16"),
                                         (False, "float32")])
def test_axolotl_bf16_values(files, bf16, dtype):
    """Axolotl's `bf16: full` (bf16 training and evaluation) became float32 ('neither bf16 nor fp16 is on')."""
    ax = yaml.safe_load(AXOLOTL.format(**files, out="x"))
    assert from_dict(RunConfig, convert({**ax, "bf16": bf16}).config).model.dtype == dtype


# keys of the peers' own examples and common configs that change nothing of what trains, or map: (format, key,
# value, a line of the mapping); each was refused as having no gapless equivalent
HARMLESS = [
    ("axolotl", "loss_watchdog_threshold", 5.0, "gapless does not stop a run whose finite loss stays high"),
    ("axolotl", "loss_watchdog_patience", 3, "see loss_watchdog_threshold"),
    ("axolotl", "plugins", ["axolotl.integrations.liger.LigerPlugin"], "kernel plugins (the same sums)"),
    ("axolotl", "liger_rms_norm", True, "a kernel choice"),
    ("axolotl", "liger_fused_linear_cross_entropy", True, "a kernel choice"),
    ("axolotl", "cut_cross_entropy", True, "a kernel choice"),
    ("axolotl", "xformers_attention", False, "a kernel choice"),
    ("axolotl", "flash_attn_rms_norm", True, "a kernel choice"),
    ("axolotl", "s2_attention", False, "off"),
    ("axolotl", "lora_fan_in_fan_out", False, "off"),
    ("axolotl", "gradient_checkpointing", "offload", "model.activation_checkpointing: 1  (every layer; the "
                                                     "checkpointed activations stay on the GPU"),
    ("axolotl", "torch_compile", True, "model.compile: true"),
    ("axolotl", "auto_resume_from_checkpoints", True, "resume: true"),
    ("axolotl", "is_llama_derived_model", True, "read from the checkpoint's config.json"),
    ("axolotl", "max_steps", -1, "-1: the epochs decide"),
    ("axolotl", "ddp_timeout", 1800, "parallel.timeout_s: 1800"),
    ("axolotl", "dataloader_num_workers", 4, "how batches are loaded"),
    ("trl", "use_liger_kernel", True, "a kernel choice"),
    ("trl", "push_to_hub", False, "off"),
    ("trl", "remove_unused_columns", True, "gapless reads only the fields"),
    ("trl", "torch_compile", False, "model.compile: false"),
]


@pytest.mark.parametrize("fmt, key, value, line", HARMLESS)
def test_harmless_keys_of_real_configs_are_listed(files, fmt, key, value, line):
    text = AXOLOTL if fmt == "axolotl" else TRL
    raw = yaml.safe_load(text.format(**files, out="x"))
    raw.pop("max_steps") if key == "max_steps" else None
    conv = convert({**raw, key: value})
    assert any(s.startswith(f"{key}:") and line in t for s, t in conv.applied), conv.format()
    from_dict(RunConfig, conv.config)


@pytest.mark.parametrize("key, value, why", [
    ("plugins", ["axolotl.integrations.kd.KDPlugin"], "the others have no gapless equivalent"),
    ("s2_attention", True, "shifted sparse attention"), ("peft_use_dora", True, "not DoRA"),
    ("hub_model_id", "me/model", "gapless does not upload"), ("tokens", ["<tool>"], "new embedding rows"),
    ("resume_from_checkpoint", "out/checkpoint-10", "not a Trainer checkpoint folder"),
    ("gradient_checkpointing", "sometimes", "expected true, false, offload or offload_disk")])
def test_keys_that_change_training_are_refused_saying_why(files, key, value, why):
    raw = yaml.safe_load(AXOLOTL.format(**files, out="x"))
    with pytest.raises(ValueError, match=f"\n  {key}: .*{why}"):
        convert({**raw, key: value})


@pytest.mark.parametrize("fmt, extra, kind, min_lr_ratio", [
    ("axolotl", {"lr_scheduler": "cosine", "cosine_min_lr_ratio": 0.1}, "cosine", 0.1),
    ("trl", {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}, "cosine", 0.1),
    ("trl", {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 2e-5}}, "cosine", 0.1),
    ("trl", {"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"num_cycles": 0.5}}, "cosine", 0.0)])
def test_a_cosine_to_a_floor_maps_to_min_lr_ratio(files, fmt, extra, kind, min_lr_ratio):
    """Axolotl's cosine_min_lr_ratio and transformers' cosine_with_min_lr (open-r1's recipes) decay to a fraction of
    the peak, which is schedule.min_lr_ratio: both were refused."""
    raw = yaml.safe_load((AXOLOTL if fmt == "axolotl" else TRL).format(**files, out="x"))
    cfg = from_dict(RunConfig, convert({**raw, **extra}).config)
    assert (cfg.schedule.kind, cfg.schedule.min_lr_ratio) == (kind, pytest.approx(min_lr_ratio))


def test_constant_schedule_has_no_warmup_as_in_transformers(files):
    """transformers' constant schedule ignores warmup_steps/warmup_ratio (constant_with_warmup reads them): the
    warmup was applied."""
    raw = yaml.safe_load(TRL.format(**files, out="x"))
    conv = convert({**raw, "lr_scheduler_type": "constant", "warmup_ratio": 0.1})
    cfg = from_dict(RunConfig, conv.config)
    assert (cfg.schedule.kind, cfg.schedule.warmup_ratio, cfg.schedule.warmup_steps) == ("constant", 0.0, 0)
    assert ("warmup_ratio: 0.1", "no effect: lr_scheduler_type constant has no warmup in transformers "
                                 "(constant_with_warmup has)") in conv.applied
    cfg = from_dict(RunConfig, convert({**raw, "lr_scheduler_type": "constant_with_warmup"}).config)
    assert (cfg.schedule.kind, cfg.schedule.warmup_ratio) == ("constant", 0.1)
    ax = yaml.safe_load(AXOLOTL.format(**files, out="x"))
    assert from_dict(RunConfig, convert({**ax, "lr_scheduler": "constant"}).config).schedule.warmup_steps == 0


@pytest.mark.parametrize("val_set_size", [0, 0.0, None])
def test_axolotl_evaluation_without_held_out_data_is_unused(files, val_set_size):
    """Axolotl does not evaluate without held-out data, and its examples keep evals_per_epoch beside
    val_set_size: 0: that became train.evals_per_epoch, which gapless refuses without eval data."""
    raw = yaml.safe_load(AXOLOTL.format(**files, out="x"))
    for extra in ({"eval_steps": 2}, {"eval_steps": None, "evals_per_epoch": 4}):
        conv = convert({**raw, "val_set_size": val_set_size, **extra})
        cfg = from_dict(RunConfig, conv.config)
        assert (cfg.train.eval_every, cfg.train.evals_per_epoch, cfg.data.eval_fraction) == (0, None, 0.0)
        key = next(iter(k for k, v in extra.items() if v))
        assert any(s.startswith(key) and "unused: no held-out data" in t for s, t in conv.applied)


def test_trl_epoch_strategies_and_packing_keys(files):
    """TrainingArguments' save_strategy / eval_strategy epoch are checkpoint.per_epoch / train.evals_per_epoch 1;
    TRL's packing_strategy bfd and padding_free are what gapless's packing does. All four were refused."""
    raw = yaml.safe_load(TRL.format(**files, out="x"))
    conv = convert({**raw, "save_strategy": "epoch", "eval_strategy": "epoch", "packing_strategy": "bfd",
                    "padding_free": True})
    conv.config["data"]["eval_fraction"] = 0.1  # held-out data, as an override gives it
    cfg = from_dict(RunConfig, conv.config)
    assert (cfg.checkpoint.per_epoch, cfg.checkpoint.every, cfg.train.evals_per_epoch) == (1, "auto", 1)
    assert ("save_steps: 3", "unused: save_strategy is epoch") in conv.applied
    assert cfg.data.batching == "packed"
    with pytest.raises(ValueError, match="packing_strategy: wrapped: gapless packs whole documents"):
        convert({**raw, "packing_strategy": "wrapped"})
    assert any(s == "packing_strategy: wrapped" and "unused: packing is off" in t
               for s, t in convert({**raw, "packing": False, "packing_strategy": "wrapped"}).applied)


def test_trl_peft_defaults_are_trls(files):
    """use_peft without lora_dropout / lora_target_modules: TRL's ModelConfig trains dropout 0.05 and PEFT adapts
    q_proj and v_proj of a Llama-family model; gapless's own defaults (0.0, every linear layer) were used."""
    raw = {k: v for k, v in yaml.safe_load(TRL.format(**files, out="x")).items()
           if k not in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")}
    conv = convert(raw)
    lora = from_dict(RunConfig, conv.config).lora
    assert (lora.r, lora.alpha, lora.dropout, lora.target_modules) == (16, 32.0, 0.05, ["q_proj", "v_proj"])
    assert "lora_target_modules: (unset)" in conv.format()


def test_trl_dataset_text_field_is_for_plain_text_only(files, tmp_path):
    """TRL applies the chat template to conversational records whatever dataset_text_field says (its default,
    "text", is often written out): the conversations were read as format text, whose field they lack."""
    raw = {**yaml.safe_load(TRL.format(**{**files, "chat": files["trl_chat"]}, out="x")), "dataset_text_field": "text"}
    conv = convert(raw)
    source = from_dict(RunConfig, conv.config).data.sources[0]
    assert (source.format, source.columns) == ("auto", {})
    assert any(s == "dataset_text_field: text" and "unused: the records are messages" in t for s, t in conv.applied)
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"body": "shift: ab bc"}) + "\n")
    source = from_dict(RunConfig, convert({**raw, "dataset_name": str(plain), "dataset_text_field": "body"}).config)
    assert (source.data.sources[0].format, source.data.sources[0].columns) == ("text", {"text": "body"})


@pytest.mark.parametrize("types, extra, overlong", [
    (["alpaca"], {}, "drop"), (["alpaca"], {"excess_length_strategy": "truncate"}, "truncate"),
    (["completion"], {}, "split"), (["completion", "alpaca"], {}, "split")])
def test_axolotl_over_long_records(files, types, extra, overlong):
    """Axolotl drops rows longer than sequence_len (excess_length_strategy's default) and cuts completion text into
    sequence_len pieces: gapless's default, truncate, trained the start of each, silently."""
    raw = yaml.safe_load(AXOLOTL.format(**files, out="x"))
    raw["datasets"] = [{"path": str(files["alpaca"]), "type": t} for t in types]
    conv = convert({**raw, **extra})
    assert from_dict(RunConfig, conv.config).data.overlong == overlong
    if len(types) > 1:
        assert "an over-long conversation is truncated (Axolotl drops it)" in conv.format()


def test_axolotl_warms_up_3_percent_by_default(files):
    """Axolotl warms up min(3% of the steps, 100) when neither warmup_steps nor warmup_ratio is set: no warmup
    was applied."""
    raw = {k: v for k, v in yaml.safe_load(AXOLOTL.format(**files, out="x")).items() if k != "warmup_steps"}
    conv = convert(raw)
    assert from_dict(RunConfig, conv.config).schedule.warmup_ratio == 0.03
    assert "warmup_ratio: (unset)" in conv.format()
    assert from_dict(RunConfig, convert({**raw, "warmup_steps": 0}).config).schedule.warmup_ratio == 0.0


def test_a_missing_data_file_is_not_a_hub_id():
    # the example config's `data/train.jsonl`, not there yet: "looks like a hub id ... hf download data/train.jsonl"
    # sent the user to the hub for a file of their own
    cfg = from_dict(RunConfig, {"model": {"path": "/nonexistent/model"},
                                "data": {"sources": [{"path": "data/train.jsonl"}, {"path": "data/eval.json.gz"}]}})
    check_run_paths(cfg)  # no error here: reading the data says the file is not found
    assert check_local("data/train.jsonl", "data.sources[0].path", "data files") is None
    assert check_local("HuggingFaceH4/ultrachat_200k", "data.sources[0].path", "data files")


@pytest.mark.parametrize("hub", [False, True])
def test_trl_dataset_folder_of_splits_trains_on_its_train_split(files, tmp_path, hub):
    """TRL's dataset_name a folder with train.jsonl beside test.jsonl (or a Hub dataset's data/ shards): TRL trains on
    dataset_train_split and evaluates on dataset_test_split; gapless took the folder whole, test split included."""
    raw = yaml.safe_load(TRL.format(**{**files, "chat": files["trl_chat"]}, out="x"))
    folder = tmp_path / "ds"
    data = folder / "data" if hub else folder
    data.mkdir(parents=True)
    chat = Path(files["trl_chat"]).read_text()
    names = (["train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl", "test-00000-of-00001.jsonl"] if hub else
             ["train.jsonl", "test.jsonl", "validation.jsonl"])
    for name in names:
        (data / name).write_text(chat)
    train = str(data / ("train-0000*-of-00002.jsonl" if hub else "train.jsonl"))
    test = str(data / ("test-00000-of-00001.jsonl" if hub else "test.jsonl"))
    conv = convert({**raw, "dataset_name": str(folder)})
    cfg = from_dict(RunConfig, conv.config)
    assert cfg.data.sources[0].path == train and cfg.data.eval_sources == []
    assert "the 'test' split is not read: TRL evaluates nothing with eval_strategy no" in conv.format()
    conv = convert({**raw, "dataset_name": str(folder), "eval_strategy": "steps", "eval_steps": 2})
    cfg = from_dict(RunConfig, conv.config)
    assert cfg.data.sources[0].path == train and [s.path for s in cfg.data.eval_sources] == [test]
    assert cfg.train.eval_every == 2
    if not hub:
        conv = convert({**raw, "dataset_name": str(folder), "dataset_train_split": "validation",
                        "dataset_test_split": "train", "eval_strategy": "epoch"})
        cfg = from_dict(RunConfig, conv.config)
        assert (cfg.data.sources[0].path, cfg.data.eval_sources[0].path) == (str(data / "validation.jsonl"),
                                                                              str(data / "train.jsonl"))
    with pytest.raises(ValueError, match=r"dataset_train_split: dev: no 'dev' split in .*ds \(its files name the "
                                         r"splits: train, (validation, )?test\)"):
        convert({**raw, "dataset_name": str(folder), "dataset_train_split": "dev"})
    with pytest.raises(ValueError, match=r"dataset_train_split: validation: gapless reads the whole file"):
        convert({**raw, "dataset_train_split": "validation"})


def test_axolotl_dataset_folder_of_splits_reads_its_split(files, tmp_path):
    """An Axolotl dataset whose path is a folder of a dataset's splits: its `split` (default train) picks the files;
    the folder read whole would have trained on the test split too."""
    raw = yaml.safe_load(AXOLOTL.format(**files, out="x"))
    folder = tmp_path / "ds"
    folder.mkdir()
    for name in ("train.jsonl", "test.jsonl"):
        (folder / name).write_text(Path(files["alpaca"]).read_text())
    conv = convert({**raw, "datasets": [{"path": str(folder), "type": "alpaca"}]})
    assert [s.path for s in from_dict(RunConfig, conv.config).data.sources] == [str(folder / "train.jsonl")]
    assert "the 'train' split's files of" in conv.format()
    conv = convert({**raw, "datasets": [{"path": str(folder), "type": "alpaca", "split": "test"}]})
    assert from_dict(RunConfig, conv.config).data.sources[0].path == str(folder / "test.jsonl")
    with pytest.raises(ValueError, match=r"split: validation: no 'validation' split in .*ds \(its files name the "
                                         r"splits: train, test\)"):
        convert({**raw, "datasets": [{"path": str(folder), "type": "alpaca", "split": "validation"}]})


def _ax_chat(files, **keys) -> dict:
    """AXOLOTL with its chat_template dataset alone, `keys` added to that dataset."""
    raw = yaml.safe_load(AXOLOTL.format(**files, out="x"))
    raw["datasets"] = [{**raw["datasets"][2], **keys}]
    return raw


@pytest.mark.parametrize("keys, said", [
    # Axolotl drops a key set to null before reading it (utils/config validate_config: model_dump(exclude_none=True)),
    # so null is the default: roles_to_train [assistant], train_on_eos turn (prompt_strategies/chat_template.py)
    ({"roles_to_train": None, "train_on_eos": None}, None),
    ({"roles_to_train": ["gpt"]}, None),  # read through the default role names: gpt is assistant
    ({"roles_to_train": ["assistant", "gpt"], "train_on_eos": "turn", "train_on_eot": "turn"}, None),
    ({"field_thinking": "thinking", "template_thinking_key": "thinking"}, None),
    ({"preprocess_shards": 4}, "preprocess_shards 4: Axolotl tokenizes the dataset in that many sequential pieces"),
    ({"trust_remote_code": True}, "trust_remote_code true: gapless reads data files and runs no dataset loading"),
    ({"revision": "abc123", "name": "default"}, "revision abc123: a Hub dataset's commit, tag or branch; a local "
                                                "path is read as it is"),
    ({"field": "conversation"}, "field conversation: unused (Axolotl reads it for completion datasets only)"),
    ({"field_thinking": "thinking"}, "unused beside message_property_mappings"),
])
def test_axolotl_chat_template_keys_that_train_the_same(files, keys, said):
    conv = convert(_ax_chat(files, **keys))
    source = from_dict(RunConfig, conv.config).data.sources[0]
    assert source.format == "messages" and conv.config["data"]["train_on"] == "assistant"
    if said:
        assert said in conv.format()


@pytest.mark.parametrize("keys, refused", [
    ({"roles_to_train": ["assistant", "user"]}, r"roles_to_train: \['assistant', 'user'\]: trains user turns too; "
                                                r"gapless trains assistant turns only"),
    ({"roles_to_train": []}, r"roles_to_train: \[\]: trains no assistant turn"),
    ({"roles": {"assistant": ["bot"]}, "roles_to_train": ["gpt"]}, r"roles_to_train: .*trains gpt turns too|"
                                                                    r"roles_to_train: .*trains no assistant turn"),
    ({"train_on_eos": "all"}, r"train_on_eos: all: Axolotl trains the end-of-turn token after every turn, user turns"),
    ({"train_on_eos": "last"}, r"train_on_eos: last: .*of the conversation's last turn only"),
    ({"message_field_training": "train"}, r"message_field_training: train: a turn's own train flag"),
    ({"message_field_training_detail": "train_detail"}, r"message_field_training_detail: train_detail: character"),
    ({"message_property_mappings": None, "field_thinking": "thinking"}, r"field_thinking: thinking: Axolotl renders a turn's thinking as "
                                     r"reasoning_content"),
    ({"split_thinking": True}, r"split_thinking: true: gapless does not move <think>"),
    ({"shards": 4, "shards_idx": 1}, r"shards: 4: Axolotl trains one contiguous piece of the records"),
    ({"path": "org/some-dataset", "revision": "v2"}, r"revision: v2: picks the Hub dataset's commit, tag or branch: "
                                                     r"download that one \(hf download org/some-dataset --repo-type "
                                                     r"dataset --revision v2\)"),
    ({"field_system": "sys"}, r"field_system: sys: gapless reads a conversation's system turn from its messages"),
    ({"chat_template_jinja": "{{ messages }}"}, r"chat_template_jinja: .*a dataset's own Jinja template"),
    ({"input_transform": "x"}, r"input_transform: x: no gapless equivalent for this key of a chat_template dataset"),
])
def test_axolotl_chat_template_keys_that_train_otherwise_are_refused(files, keys, refused):
    """prompt_strategies/chat_template.py (ChatTemplateStrategy): these train other tokens than gapless's assistant
    turns through their end-of-turn token; they were passed as harmless ('known') or read silently."""
    with pytest.raises(ValueError, match=rf"datasets\[0\]\.{refused}"):
        convert(_ax_chat(files, **keys))


def test_axolotl_train_on_inputs_with_chat_template_is_refused(files):
    """With train_on_inputs Axolotl's chat_template trains each turn's text and end-of-turn token, never the template's
    headers (find_turn); data.train_on: all trains every token. Other types train every token: all."""
    with pytest.raises(ValueError, match=r"train_on_inputs: true: with chat_template datasets Axolotl trains every "
                                         r"turn's text"):
        convert({**_ax_chat(files), "train_on_inputs": True})
    raw = yaml.safe_load(AXOLOTL.format(**files, out="x"))
    conv = convert({**raw, "datasets": raw["datasets"][:1], "train_on_inputs": True})
    assert conv.config["data"]["train_on"] == "all"


@pytest.mark.parametrize("train_on_inputs, train_on", [(False, "assistant"), (True, "all")])
def test_axolotl_input_output_is_format_segments(files, tmp_path, train_on_inputs, train_on):
    """Axolotl's template-free input_output type (docs/dataset-formats/template_free.qmd) trains the segments of label
    true, every segment with train_on_inputs; it was refused."""
    data = tmp_path / "io.jsonl"
    rows = [json.loads(line) for line in Path(files["alpaca"]).read_text().splitlines()]  # the demo vocabulary's
    data.write_text("".join(json.dumps({"segments": [{"label": False, "text": r["instruction"]},
                                                     {"label": True, "text": r["output"]}]}) + "\n" for r in rows))
    raw = yaml.safe_load(AXOLOTL.format(**files, out=tmp_path / "run"))
    raw.update(datasets=[{"path": str(data), "type": "input_output"}], train_on_inputs=train_on_inputs, max_steps=2,
               warmup_steps=0, val_set_size=0)
    conv = convert(raw)
    cfg = from_dict(RunConfig, conv.config)
    assert (cfg.data.sources[0].format, cfg.data.train_on) == ("segments", train_on)
    (tmp_path / "io.yaml").write_text(yaml.safe_dump(raw))
    assert train(load_any(tmp_path / "io.yaml", cpu(files))).steps == 2


# axolotl-ai-cloud/axolotl examples/llama-3/lora-1b-kernels.yml, trimmed: Axolotl's Triton LoRA kernels (and
# examples/qwen3/8b-lora-fused-attn.yaml's fused q/k norm + RoPE kernel)
AXOLOTL_LORA_KERNELS = """
base_model: {model}
datasets:
  - path: {alpaca}
    type: alpaca
output_dir: {out}
adapter: lora
sequence_len: 64
sample_packing: true
lora_r: 16
lora_alpha: 32
lora_target_modules: [gate_proj, down_proj, up_proj, q_proj, v_proj, k_proj, o_proj]
lora_mlp_kernel: true
lora_qkv_kernel: true
lora_o_kernel: true
fused_attn_kernel: true
micro_batch_size: 2
num_epochs: 1
optimizer: adamw_8bit
lr_scheduler: cosine
learning_rate: 0.0002
warmup_steps: 10
"""


def test_axolotl_lora_kernels_are_kernel_choices(files):
    """lora_mlp_kernel / lora_qkv_kernel / lora_o_kernel (Axolotl's fused LoRA autograd functions) and
    fused_attn_kernel compute the same function as the plain layers: they were refused as having no equivalent."""
    conv = convert(yaml.safe_load(AXOLOTL_LORA_KERNELS.format(**files, out="x")))
    for key in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "fused_attn_kernel"):
        assert any(s == f"{key}: true" and "a kernel choice" in t for s, t in conv.applied), conv.format()
    assert from_dict(RunConfig, conv.config).method == "lora"


# huggingface/open-r1 recipes/OlympicCoder-7B/sft/config_v00.00.yaml, trimmed (and use_flash_attention_2 of
# huggingface/alignment-handbook recipes/gemma-7b/sft/config_full_ultrachat.yaml): older TRL names of kernel switches
OPEN_R1_OLYMPIC_CODER = """
model_name_or_path: {model}
model_revision: main
torch_dtype: bfloat16
attn_implementation: flash_attention_2
use_flash_attention_2: true
dataset_name: {chat}
bf16: true
eval_strategy: 'no'
gradient_accumulation_steps: 8
gradient_checkpointing: true
learning_rate: 1.0e-05
lr_scheduler_type: cosine_with_min_lr
lr_scheduler_kwargs:
  min_lr_rate: 0.1
packing: false
max_grad_norm: 0.2
max_length: 64
num_train_epochs: 10
output_dir: {out}
per_device_train_batch_size: 2
save_strategy: "steps"
save_steps: 100
seed: 42
use_liger: true
warmup_ratio: 0.03
"""


def test_trl_older_kernel_switch_names_are_kernel_choices(files):
    """use_liger (SFTConfig's name before TrainingArguments.use_liger_kernel) and use_flash_attention_2 (the model
    arguments' name before attn_implementation) pick kernels, not what trains: both were refused."""
    conv = convert(yaml.safe_load(OPEN_R1_OLYMPIC_CODER.format(**{**files, "chat": files["trl_chat"]}, out="x")))
    assert any(s == "use_liger: true" and "a kernel choice" in t for s, t in conv.applied), conv.format()
    assert any(s == "use_flash_attention_2: true" and "model.attn_backend auto" in t for s, t in conv.applied)
    cfg = from_dict(RunConfig, conv.config)
    assert (cfg.optim.grad_clip, cfg.schedule.min_lr_ratio) == (0.2, 0.1)


# huggingface/alignment-handbook recipes/zephyr-7b-beta/sft/config_qlora.yaml, trimmed: the handbook's SFTConfig
# (and open-r1's) has chat_template, Jinja that its sft.py sets on the tokenizer
HANDBOOK_ZEPHYR_QLORA = r"""
model_name_or_path: {model}
torch_dtype: bfloat16
load_in_4bit: true
use_peft: true
lora_r: 16
lora_alpha: 16
lora_dropout: 0.05
lora_target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]
chat_template: "{{% for message in messages %}}\n{{% if message['role'] == 'user' %}}\n{{{{ '<|user|>\n' + message['content'] + eos_token }}}}\n{{% elif message['role'] == 'system' %}}\n{{{{ '<|system|>\n' + message['content'] + eos_token }}}}\n{{% elif message['role'] == 'assistant' %}}\n{{{{ '<|assistant|>\n'  + message['content'] + eos_token }}}}\n{{% endif %}}\n{{% if loop.last and add_generation_prompt %}}\n{{{{ '<|assistant|>' }}}}\n{{% endif %}}\n{{% endfor %}}"
dataset_name: {chat}
bf16: true
gradient_accumulation_steps: 2
learning_rate: 2.0e-04
lr_scheduler_type: cosine
max_length: 64
num_train_epochs: 1
output_dir: {out}
per_device_train_batch_size: 4
seed: 42
warmup_ratio: 0.1
"""


def test_trl_chat_template_jinja_is_the_data_chat_template(files):
    """alignment-handbook's and open-r1's chat_template (inline Jinja for the tokenizer) is data.chat_template: it was
    refused as having no gapless equivalent."""
    raw = yaml.safe_load(HANDBOOK_ZEPHYR_QLORA.format(**{**files, "chat": files["trl_chat"]}, out="x"))
    assert raw["chat_template"].startswith("{% for message in messages %}\n{% if message['role'] == 'user' %}")
    cfg = from_dict(RunConfig, convert(raw).config)
    assert (cfg.data.chat_template, cfg.method) == (raw["chat_template"], "qlora")
    with pytest.raises(ValueError, match="chat_template: chatml: expected the Jinja text"):
        convert({**raw, "chat_template": "chatml"})


# huggingface/alignment-handbook recipes/zephyr-7b-beta/sft/config_lora.yaml, trimmed: float16 weights, bf16 training
HANDBOOK_ZEPHYR_LORA = """
model_name_or_path: {model}
torch_dtype: float16
use_peft: true
lora_r: 16
lora_alpha: 16
lora_dropout: 0.05
lora_target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]
dataset_name: {chat}
bf16: true
gradient_accumulation_steps: 2
learning_rate: 2.0e-04
lr_scheduler_type: cosine
max_seq_length: 64
num_train_epochs: 1
output_dir: {out}
per_device_train_batch_size: 4
seed: 42
"""


@pytest.mark.parametrize("torch_dtype, bf16, dtype", [("float16", True, "bfloat16"), ("float32", True, "bfloat16"),
                                                      ("bfloat16", True, "bfloat16"), ("bfloat16", False, "bfloat16"),
                                                      ("float16", None, "float16")])
def test_trl_torch_dtype_loads_the_weights_and_bf16_computes(files, torch_dtype, bf16, dtype):
    """torch_dtype is the dtype the weights load in; bf16: true trains under bfloat16 autocast whatever it is.
    torch_dtype float16 beside bf16: true made model.dtype float16: float16 matmuls the peer never ran."""
    raw = yaml.safe_load(HANDBOOK_ZEPHYR_LORA.format(**{**files, "chat": files["trl_chat"]}, out="x"))
    raw = {**raw, "torch_dtype": torch_dtype, "bf16": bf16}
    conv = convert({k: v for k, v in raw.items() if v is not None})
    assert from_dict(RunConfig, conv.config).model.dtype == dtype
    if bf16 and torch_dtype != "bfloat16":
        assert any(s == f"torch_dtype: {torch_dtype}" and "bf16 autocast computes in bfloat16" in t
                   for s, t in conv.applied), conv.format()


# axolotl-ai-cloud/axolotl examples/phi/lora-3.5.yaml, trimmed: bfloat16 (the weights in bf16, no autocast) beside bf16
AXOLOTL_PHI_LORA = """
base_model: {model}
chat_template: tokenizer_default
datasets:
  - path: {chat}
    type: chat_template
    field_messages: conversation
    message_field_role: speaker
    message_field_content: text
val_set_size: 0.05
output_dir: {out}
sequence_len: 64
sample_packing: false
adapter: lora
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_linear: true
gradient_accumulation_steps: 4
micro_batch_size: 4
num_epochs: 2
optimizer: adamw_bnb_8bit
lr_scheduler: cosine
learning_rate: 0.0002
train_on_inputs: false
bfloat16: true
bf16: true
fp16:
tf32: false
warmup_steps: 10
"""


@pytest.mark.parametrize("extra, dtype", [({}, "bfloat16"), ({"bf16": False}, "bfloat16"),
                                          ({"bf16": None, "bfloat16": None, "float16": True}, "float16")])
def test_axolotl_bfloat16_and_float16_are_the_model_dtype(files, extra, dtype):
    """Axolotl's bfloat16 / float16 load the weights in that dtype and train without autocast: model.dtype. They
    were refused as having no gapless equivalent."""
    raw = {**yaml.safe_load(AXOLOTL_PHI_LORA.format(**files, out="x")), **extra}
    conv = convert(raw)
    assert from_dict(RunConfig, conv.config).model.dtype == dtype
    with pytest.raises(ValueError, match="bfloat16: true: .*fp16"):
        convert({**raw, "bf16": False, "fp16": True, "bfloat16": True})


def test_axolotl_prediction_tables_change_nothing_that_trains(files):
    """examples/qwen/lora.yml and examples/mistral/qlora.yml (axolotl-ai-cloud/axolotl) set eval_table_max_new_tokens:
    128 beside an empty eval_table_size: the prediction table Axolotl logs at evaluation, which trains nothing. It was
    refused as having no gapless equivalent (eval_max_new_tokens was accepted)."""
    raw = yaml.safe_load(AXOLOTL.format(**files, out="x"))
    for extra in ({"eval_table_size": None, "eval_table_max_new_tokens": 128}, {"eval_table_size": 5}):
        conv = convert({**raw, **extra})
        for key in extra:
            assert any(s.startswith(f"{key}:") for s, _ in conv.applied), conv.format()


def test_trl_preprocessing_num_workers_is_the_tokenizer_workers(files):
    """alignment-handbook's older recipes (recipes/zephyr-7b-beta/sft/config_lora.yaml, preprocessing_num_workers: 12)
    name dataset_num_proc so: how many processes tokenize, not what trains. It was refused as having no equivalent."""
    raw = yaml.safe_load(HANDBOOK_ZEPHYR_LORA.format(**{**files, "chat": files["trl_chat"]}, out="x"))
    cfg = from_dict(RunConfig, convert({**raw, "preprocessing_num_workers": 12}).config)
    assert cfg.data.num_workers == 12


# LLaMA-Factory's examples/train_lora/llama3_lora_sft.yaml (hiyouga/LLaMA-Factory), trimmed to the tiny model and
# a few steps; its datasets are named in dataset_info.json, as data/dataset_info.json there describes them
LLAMAFACTORY = """
### model
model_name_or_path: {model}
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 4
lora_target: all

### dataset
dataset: identity,chat_demo
dataset_dir: {dataset_dir}
template: llama3
cutoff_len: 64
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 0

### output
output_dir: {out}
logging_steps: 1
save_steps: 3
plot_loss: true
overwrite_output_dir: true
report_to: none

### train
per_device_train_batch_size: 2
gradient_accumulation_steps: 1
learning_rate: 1.0e-4
num_train_epochs: 1.0
max_steps: 3
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### eval
val_size: 0.1
per_device_eval_batch_size: 1
eval_strategy: steps
eval_steps: 2
"""


@pytest.fixture(scope="module")
def lf_dir(files) -> Path:
    """A dataset_dir: dataset_info.json (entries as in LLaMA-Factory's data/dataset_info.json: identity's alpaca file,
    mllm_demo's OpenAI-style sharegpt tags, ultrachat_200k's hub entry) and the local files it names."""
    folder = files["root"] / "lf_data"
    folder.mkdir(exist_ok=True)
    (folder / "identity.json").write_text(files["alpaca"].read_text())
    (folder / "chat.jsonl").write_text(files["trl_chat"].read_text())
    info = {"identity": {"file_name": "identity.json"},
            "chat_demo": {"file_name": "chat.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"},
                          "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                   "assistant_tag": "assistant"}},
            "speakers": {"file_name": "speakers.jsonl", "formatting": "sharegpt",
                         "columns": {"messages": "conversation"},
                         "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "human",
                                  "assistant_tag": "bot"}},
            "glaive_toolcall_en": {"hf_hub_url": "llamafactory/glaive_toolcall_en", "formatting": "sharegpt",
                                   "columns": {"messages": "conversations", "tools": "tools"}},
            "ultrachat_200k": {"hf_hub_url": "HuggingFaceH4/ultrachat_200k", "split": "train_sft",
                               "formatting": "sharegpt", "columns": {"messages": "messages"}},
            "deepctrl": {"ms_hub_url": "deepctrl/deepctrl-sft-data"},
            "dpo_en_demo": {"file_name": "dpo_en_demo.json", "ranking": True, "formatting": "sharegpt",
                            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}}}
    (folder / "dataset_info.json").write_text(json.dumps(info))
    return folder


def lf_raw(files, lf_dir, out="x", **changes) -> dict:
    raw = yaml.safe_load(LLAMAFACTORY.format(model=files["model"], dataset_dir=lf_dir, out=out))
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not ...}


def test_llamafactory_converts_and_trains(files, lf_dir, capsys):
    # the tiny model's word-level tokenizer has no Llama 3 header tokens: its own chat template (template unset)
    path = files["root"] / "lf.yaml"
    path.write_text(LLAMAFACTORY.replace("template: llama3\n", "").format(model=files["model"], dataset_dir=lf_dir,
                                                                           out=files["root"] / "run_lf"))
    raw = yaml.safe_load(path.read_text())
    assert detect(raw) == "llamafactory"
    cfg = load_any(path, cpu(files))
    printed = capsys.readouterr().err
    assert "llamafactory config -> gapless" in printed
    assert [(s.path, s.format) for s in cfg.data.sources] == [(str(lf_dir / "identity.json"), "alpaca"),
                                                             (str(lf_dir / "chat.jsonl"), "sharegpt")]
    assert cfg.data.sources[0].columns == {"system": None, "history": None}
    assert cfg.data.sources[1].columns == {"conversations": "messages", "system": None, "tools": None, "from": "role",
                                           "value": "content"}
    assert (cfg.data.max_seq_len, cfg.data.batching, cfg.data.rows_per_batch) == (64, "padded", 2)
    assert (cfg.method, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout) == ("lora", 4, 8.0, 0.0)  # alpha: rank * 2
    assert cfg.lora.target_modules == list(ALL_LINEAR) and cfg.data.train_on == "assistant"
    assert (cfg.optim.lr, cfg.schedule.kind, cfg.schedule.warmup_ratio) == (1e-4, "cosine", 0.1)
    assert (cfg.train.steps, cfg.train.eval_every, cfg.checkpoint.every, cfg.data.eval_fraction) == (3, 2, 3, 0.1)
    assert cfg.model.activation_checkpointing == 1 and cfg.data.chat_template is None
    assert "template: (unset)" in printed and "the tokenizer's own" in printed
    assert "max_samples: 1000" in printed and "no effect: each dataset holds at most 1000 records (60, 60)" in printed
    for key in raw:
        assert f"\n  {key}" in printed, key
    result = train(cfg)
    assert len(result.losses) == 3 and (result.run_dir / "adapter").is_dir()


@pytest.mark.parametrize("template, name", [("qwen", "qwen_25"), ("chatml", "chatml"), ("qwen3_nothink", "chatml")])
@pytest.mark.parametrize("changes", [{}, {"mask_history": True}, {"train_on_prompt": True}])
def test_llamafactory_chatml_templates_train_their_ids_and_say_the_newline(files, lf_dir, template, name, changes):
    """LLaMA-Factory's qwen (Qwen2.5's default system prompt), chatml and qwen3_nothink: gapless's template of the same
    ids (tests/test_llamafactory_templates.py) skipping records with tools or tool turns, the one token a turn it does
    not train said in the mapping; when some answers do not train, also skipping (and saying so) records whose
    untrained answer starts with a newline."""
    conv = convert(lf_raw(files, lf_dir, template=template, **changes))
    assert conv.config["data"]["chat_template"] == (LF_JINJA_UNCUT if changes else LF_JINJA)[template]
    assert conv.config["data"]["chat_template"].endswith(TEMPLATES[name]) or changes
    (said,) = [t for s, t in conv.applied if s.startswith("template:")]
    assert f"(gapless's {name} template: LLaMA-Factory's {template} token ids" in said
    assert "trains the newline it writes after each <|im_end|>" in said and "one token a turn" in said
    assert "records with tools or tool turns (LLaMA-Factory writes them as its own text) are skipped" in said
    assert ("untrained answer starting with a newline" in said) == bool(changes)


def test_a_gapless_config_with_a_key_a_peer_shares_is_still_gapless(tmp_path):
    """`dataset:` for `data:`, or a stray `template:`, in a gapless config are LLaMA-Factory's keys: the file was
    converted as LLaMA-Factory's (model_name_or_path missing, data/dataset_info.json not found) instead of naming the
    mistyped key."""
    for raw in ({"model": {"path": "m"}, "dataset": {"sources": [{"path": "x.jsonl"}]}},
                {"model": {"path": "m"}, "data": {"sources": [{"path": "x.jsonl"}]}, "template": "llama3"}):
        assert detect(raw) == "gapless"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"model": {"path": "m"}, "dataset": {"sources": []}}))
    with pytest.raises(ValueError, match="dataset: unknown key; did you mean 'data'"):
        load_any(tmp_path / "c.yaml")


@pytest.mark.parametrize("template", ["gemma", "gemma3"])
@pytest.mark.parametrize("changes", [{}, {"mask_history": True}])
def test_llamafactory_gemma_trains_its_ids_and_says_the_newline(files, lf_dir, template, changes):
    """LLaMA-Factory's gemma and gemma3: the Jinja of its ids (tests/test_llamafactory_templates.py), the one token a
    turn it trains and gapless does not said in the mapping."""
    conv = convert(lf_raw(files, lf_dir, template=template, **changes))
    assert conv.config["data"]["chat_template"] == (LF_JINJA_UNCUT if changes else LF_JINJA)[template]
    (said,) = [t for s, t in conv.applied if s.startswith("template:")]
    assert f"(LLaMA-Factory's {template} turns as Jinja: its token ids; " in said
    assert "trains the newline it writes after each <end_of_turn>" in said and "one token a turn" in said
    assert ("untrained answer" in said) == bool(changes)


def test_llamafactory_detection_is_not_trls(files, lf_dir):
    trl = yaml.safe_load(TRL.format(**files, out="x"))
    assert detect(trl) == "trl"
    # TrainingArguments' keys are TRL markers too; one of LLaMA-Factory's own decides
    raw = {k: v for k, v in lf_raw(files, lf_dir).items() if k not in ("stage", "finetuning_type", "template")}
    assert detect(raw) == "llamafactory"


@pytest.mark.parametrize("changes, expect", [
    ({}, {"data.chat_template": LF_JINJA["llama3"]}),
    ({"quantization_bit": 4, "quantization_method": "bnb", "double_quantization": True}, {"method": "qlora"}),
    ({"finetuning_type": "full"}, {"method": "full"}),
    ({"lora_alpha": 16, "lora_target": "q_proj,v_proj", "use_rslora": True},
     {"lora.alpha": 16.0, "lora.target_modules": ["q_proj", "v_proj"], "lora.use_rslora": True}),
    ({"neat_packing": True}, {"data.batching": "packed", "data.max_seq_len": 63, "data.tokens_per_batch": 126}),
    ({"train_on_prompt": True}, {"data.train_on": "all", "data.chat_template": LF_JINJA_UNCUT["llama3"]}),
    ({"mask_history": True}, {"data.train_on": "last_assistant", "data.chat_template": LF_JINJA_UNCUT["llama3"]}),
    ({"disable_gradient_checkpointing": True}, {"model.activation_checkpointing": 0}),
    ({"template": ..., "flash_attn": "fa2", "enable_liger_kernel": True, "use_unsloth": False},
     {"data.chat_template": None}),
    ({"val_size": ..., "eval_dataset": "identity", "eval_strategy": "steps"},
     {"data.eval_sources": [{"path": "identity.json", "format": "alpaca"}]}),
])
def test_llamafactory_mappings(files, lf_dir, changes, expect):
    cfg = from_dict(RunConfig, convert(lf_raw(files, lf_dir, **changes)).config)
    for dotted, value in expect.items():
        got = cfg
        for part in dotted.split("."):
            got = getattr(got, part)
        if dotted == "data.eval_sources":
            got = [{"path": Path(s.path).name, "format": s.format} for s in got]
        assert got == value, dotted


def test_llamafactory_sharegpt_tags_are_columns_and_roles(files, lf_dir):
    cfg = from_dict(RunConfig, convert(lf_raw(files, lf_dir, dataset="speakers", max_samples=...)).config)
    src = cfg.data.sources[0]
    assert (src.format, src.columns) == ("sharegpt", {"conversations": "conversation", "system": None, "tools": None,
                                                      "from": "speaker", "value": "text"})
    assert src.roles == {"bot": "assistant"}  # human is gapless's user already


def test_llamafactory_reads_only_the_columns_dataset_info_names(files, tmp_path):
    """LLaMA-Factory reads a dataset's system, tools and history columns only where dataset_info.json names them, and
    an entry with `columns` reads no column it leaves out (its query: no input); the converted sources, read by
    gapless's reader, leave them out too (columns mapped to null), and read those it names, a history under another
    name included. An entry without a column every record needs is refused."""
    system = {"instruction": "And 3?", "input": "x", "output": "9", "system": "S", "history": [["2?", "4"]],
              "turns": [["1?", "1"]]}
    (tmp_path / "a.json").write_text(json.dumps([system]))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    (tmp_path / "s.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "q"},
                                                                    {"from": "gpt", "value": "a"}],
                                                  "system": "S", "tools": json.dumps(tools)}]))
    info = {"plain": {"file_name": "a.json"},
            "named": {"file_name": "a.json", "columns": {"prompt": "instruction", "response": "output",
                                                          "system": "system", "history": "turns"}},
            "chat": {"file_name": "s.json", "formatting": "sharegpt"},
            "chat_named": {"file_name": "s.json", "formatting": "sharegpt",
                           "columns": {"messages": "conversations", "system": "system", "tools": "tools"}},
            "no_prompt": {"file_name": "a.json", "columns": {"query": "input", "response": "output"}}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))

    def read(name: str):
        conv = convert(lf_raw(files, tmp_path, dataset=name, dataset_dir=str(tmp_path), max_samples=...))
        (src,) = from_dict(RunConfig, conv.config).data.sources
        (said,) = [t for s, t in conv.applied if s == f"dataset: {name}"]
        return list(read_source(src))[0], said

    ex, said = read("plain")
    assert ex.messages == [{"role": "user", "content": "And 3?\n\nx"}, {"role": "assistant", "content": "9"}]
    assert "system, history: null, not read where a record has it" in said
    assert "instruction, a blank line and input (LLaMA-Factory joins them with one newline)" in said
    ex, said = read("named")
    assert [m["content"] for m in ex.messages] == ["S", "1?", "1", "And 3?", "9"]  # no query named: no input
    assert "a blank line" not in said  # no input, nothing joined
    ex, said = read("chat")
    assert (ex.messages, ex.tools) == ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], None)
    assert "system, tools: null" in said
    ex, _ = read("chat_named")
    assert ex.messages[0] == {"role": "system", "content": "S"} and ex.tools == tools
    with pytest.raises(ValueError, match=r"dataset: no_prompt: columns: .*: no prompt, so LLaMA-Factory reads no "
                                         r"instruction column .*name it \(prompt: instruction\)"):
        convert(lf_raw(files, tmp_path, dataset="no_prompt", dataset_dir=str(tmp_path), max_samples=...))


def test_llamafactory_hub_datasets_are_paths_and_dataset_dir_online(files, lf_dir):
    conv = convert(lf_raw(files, lf_dir, dataset="glaive_toolcall_en", max_samples=...))
    assert conv.config["data"]["sources"] == [{"path": "llamafactory/glaive_toolcall_en", "format": "sharegpt",
                                               "columns": {"system": None}}]
    conv = convert(lf_raw(files, lf_dir, dataset="tatsu-lab/alpaca", dataset_dir="ONLINE", max_samples=...))
    assert conv.config["data"]["sources"] == [{"path": "tatsu-lab/alpaca"}]


@pytest.mark.parametrize("changes, refused", [
    ({"stage": "dpo"}, "stage: dpo: gapless trains supervised fine-tuning"),
    ({"stage": "pt"}, "stage: pt: .*a source of format text"),
    ({"finetuning_type": "freeze"}, "finetuning_type: freeze: gapless trains lora"),
    ({"quantization_bit": 8}, "quantization_bit: 8: gapless quantizes the base to 4 bits"),
    ({"quantization_bit": 4, "quantization_method": "hqq"}, "quantization_method: hqq"),
    ({"quantization_bit": 4, "quantization_type": "fp4"}, "quantization_type: fp4: .*NF4, not FP4"),
    ({"finetuning_type": "full", "quantization_bit": 4}, "quantization_bit: 4: a quantized base trains LoRA only"),
    ({"lora_target": "q_proj,embed_tokens"}, "lora_target: q_proj,embed_tokens: gapless adapts only"),
    ({"additional_target": "embed_tokens,lm_head"}, "additional_target: .*linear layers only"),
    ({"use_dora": True}, "use_dora: true: gapless trains LoRA, not DoRA"),
    ({"pissa_init": True}, "pissa_init: true: PiSSA"),
    ({"loraplus_lr_ratio": 16.0}, "loraplus_lr_ratio: 16.0: LoRA\\+"),
    ({"packing": True}, "packing: true: LLaMA-Factory's packing lets each document attend .*neat_packing: true"),
    ({"template": "baichuan2"}, "template: baichuan2: gapless trains LLaMA-Factory's llama3, gemma, gemma3, qwen, "
                                "chatml, qwen3_nothink; for another"),
    ({"template": "qwen3"}, r"template: qwen3: .*newline .*<\|im_end\|>.*empty <think></think> block"),
    ({"template": "gemma2"}, "template: gemma2: efficient_eos"),
    ({"template": "default"}, "template: default: gapless ships no template that writes its turns .*newline it "
                              "writes after each answer's eos"),
    ({"template": "empty"}, "template: empty: .*tokenizes each on its own"),
    ({"template": "mistral"}, "template: mistral: .*system message into the first user turn"),
    ({"template": "llama2"}, r"template: llama2: .*right after ' \[/INST\]'"),
    ({"bf16": ...}, "bf16: null: neither bf16 nor fp16 is on"),
    ({"max_samples": 10}, "max_samples: 10: LLaMA-Factory trains the first 10 records"),
    ({"dataset": "ultrachat_200k"}, "dataset: ultrachat_200k: split: train_sft: gapless reads whole files"),
    ({"dataset": "deepctrl"}, "dataset: deepctrl: ms_hub_url: .*ModelScope"),
    ({"dataset": "dpo_en_demo"}, "dataset: dpo_en_demo: ranking: true: a preference dataset"),
    ({"dataset": "nope"}, "dataset: 'nope' is not described in"),
    ({"val_size": 10}, "val_size: 10: gapless holds out a fraction"),
    ({"deepspeed": "examples/deepspeed/ds_z3_config.json"}, "deepspeed: .*not DeepSpeed"),
    ({"resume_from_checkpoint": "saves/x/checkpoint-500"}, "resume_from_checkpoint: .*gapless resumes its own"),
    ({"mask_history": True, "train_on_prompt": True}, "mask_history: true: mask_history and train_on_prompt"),
])
def test_llamafactory_refusals_name_the_key(files, lf_dir, changes, refused):
    with pytest.raises(ValueError, match=refused):
        convert(lf_raw(files, lf_dir, **changes))


def test_convert_config_cli_writes_gapless_yaml_from_llamafactory(files, lf_dir, tmp_path, capsys):
    src = tmp_path / "llama3_lora_sft.yaml"
    src.write_text(LLAMAFACTORY.format(model=files["model"], dataset_dir=lf_dir, out=tmp_path / "run"))
    cfg = converted_by_cli(src, "llamafactory", tmp_path, capsys)
    assert cfg.model.path == str(files["model"]) and cfg.lora.r == 4 and len(cfg.data.sources) == 2
