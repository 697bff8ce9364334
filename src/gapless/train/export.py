"""`gapless export`: a run, its adapter or one of its checkpoints -> a PEFT adapter or a merged HF folder."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from gapless.config import RunConfig, from_dict, read_yaml
from gapless.model.export import COPIED_FILES, copy_tokenizer_files, save_pretrained
from gapless.model.loading import build, load_model, load_weights, resolve_dtype
from gapless.model.lora import ADAPTER_CONFIG, load_adapter, merge_lora, read_adapter_config, save_adapter
from gapless.model.method import Qlora, method_of
from gapless.train.checkpoint import latest_complete, load


def run_config_of(run_dir: Path) -> RunConfig:
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{path}: not found; is {run_dir} a gapless run folder?")
    return from_dict(RunConfig, read_yaml(path), str(path))


def _resolve(source: Path) -> tuple[Path | None, Path | None, Path]:
    """(adapter folder or None, checkpoint folder or None, run folder) for what the user named."""
    if not source.exists():
        raise ValueError(f"{source}: not found; give a run folder, its adapter/ or checkpoints/step-N")
    if (source / ADAPTER_CONFIG).is_file():
        return source, None, source.parent
    if (source / "manifest.json").is_file():  # runs/x/checkpoints/step-N
        return None, source, source.parent.parent
    if (source / "adapter" / ADAPTER_CONFIG).is_file():
        return source / "adapter", None, source
    if (source / "checkpoints").is_dir():
        latest = latest_complete(source / "checkpoints")
        if latest is not None:
            return None, latest, source
    if (source / "model" / "config.json").is_file() and (source / "config.yaml").is_file():
        return None, None, source  # a full fine-tuning run without checkpoints (checkpoint.every: 0): its model/
    raise ValueError(f"{source}: holds no adapter (adapter_config.json), checkpoint (manifest.json) or run folder "
                     "with either (or a full run's model/); give a run folder, its adapter/ or checkpoints/step-N")


def export(source: str | Path, out: str | Path, *, merge: bool = False, dtype: str | None = None) -> Path:
    source, out = Path(source), Path(out)
    adapter_dir, checkpoint, run_dir = _resolve(source)
    cfg = run_config_of(run_dir) if (run_dir / "config.yaml").is_file() else None
    if adapter_dir is not None:
        base_path = Path(json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or "")
        if cfg is not None and not (base_path / "config.json").is_file():
            base_path = Path(cfg.model.path)
        if not (base_path / "config.json").is_file():
            raise ValueError(f"{adapter_dir / ADAPTER_CONFIG}: base_model_name_or_path {str(base_path)!r} is not a "
                             "local model folder; export from the run folder, whose config names the base")
    else:
        assert cfg is not None
        base_path = Path(cfg.model.path)
    tokenizer_dir = Path(cfg.data.tokenizer or cfg.model.path) if cfg is not None else base_path
    if cfg is None and adapter_dir is not None and (adapter_dir / "tokenizer_config.json").is_file():
        # the tokenizer a PEFT adapter was trained with, saved beside it (TRL's trainer and Unsloth save it there,
        # with the chat template the training set): the one `gapless generate ADAPTER` reads; the base's was written
        tokenizer_dir = adapter_dir

    merged_dtype = resolve_dtype(dtype, None) if dtype else None
    if adapter_dir is None and checkpoint is None:  # a full run's final HF folder, in the dtype asked for
        model = load_model(run_dir / "model")
        save_pretrained(model.to(merged_dtype or resolve_dtype("auto", model.config_dict)), out,
                        source_dir=run_dir / "model")
        copy_tokenizer_files(tokenizer_dir, out)
        return out
    # merging happens in float32 so the bf16 rounding happens once, at the end
    if adapter_dir is not None and (cfg is None or cfg.method != "qlora"):
        model, lora_cfg = load_adapter(load_model(base_path, dtype=torch.float32), adapter_dir)
    elif adapter_dir is not None:
        # trained on the NF4 base: merged into its dequantised weights in float32, the NF4 codes the run trained on
        # (quantised from its model.dtype's values, or a 4-bit checkpoint's as stored: Qlora.load_final)
        model, _ = method_of(cfg).load_final(adapter_dir, base_path, torch.float32, "cpu")
        lora_cfg = read_adapter_config(adapter_dir, build(base_path))
    else:
        tensors, _ = load(checkpoint)
        method = method_of(cfg)
        if isinstance(method, Qlora):  # dequantise to float32, not the run's dtype; quantised as the run did
            method.compute_dtype = torch.float32
        model = method.transform(build(base_path))  # as the run assembled it: the weights stream through its hook
        model = method.initialise(load_weights(model, torch.float32, "cpu", hook=method.load_hook), torch.device("cpu"))
        method.load_checkpoint_state(model, tensors["model"], str(checkpoint))
        lora_cfg = cfg.lora
        if cfg.method == "full":  # every weight trained: the checkpoint's model is the export, an HF folder
            with torch.no_grad():
                for name, master in tensors.get("master", {}).items():  # float32 masters, when bf16/fp16 trained
                    model.get_parameter(name).copy_(master)
            save_pretrained(model.to(merged_dtype or resolve_dtype("auto", model.config_dict)), out,
                            source_dir=base_path)
            _tokenizer_over_the_bases(tokenizer_dir, base_path, out)
            return out

    if not merge:
        save_adapter(model, out, lora_cfg, base_model_name_or_path=str(base_path.resolve()))
        copy_tokenizer_files(tokenizer_dir, out)
        return out
    model = merge_lora(model)
    target = merged_dtype or resolve_dtype("auto", model.config_dict)
    save_pretrained(model.to(target), out, source_dir=base_path)
    _tokenizer_over_the_bases(tokenizer_dir, base_path, out)
    return out


def _tokenizer_over_the_bases(tokenizer_dir: Path, base_path: Path, out: Path) -> None:
    """The tokenizer the model trained with (a run's data.tokenizer, a PEFT adapter's own) written whole in place of
    the base's files that save_pretrained copied into `out`: a base's chat_template.jinja left there wins over the
    template in the other tokenizer's tokenizer_config.json (transformers reads the .jinja file first)."""
    if tokenizer_dir.resolve() != base_path.resolve():
        for name in set(COPIED_FILES) - {"generation_config.json", "preprocessor_config.json", "processor_config.json"}:
            (out / name).unlink(missing_ok=True)
    copy_tokenizer_files(tokenizer_dir, out)
