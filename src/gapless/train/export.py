"""`gapless export`: a run, its adapter or one of its checkpoints -> a PEFT adapter or a merged HF folder."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from gapless.config import RunConfig, from_dict, read_yaml
from gapless.model.export import copy_tokenizer_files, save_pretrained
from gapless.model.loading import load_model, resolve_dtype
from gapless.model.lora import ADAPTER_CONFIG, load_adapter, merge_lora, save_adapter
from gapless.model.method import Qlora, method_of
from gapless.model.qlora import to_qlora
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

    merged_dtype = resolve_dtype(dtype, None) if dtype else None
    if adapter_dir is None and checkpoint is None:  # a full run's final HF folder, in the dtype asked for
        model = load_model(run_dir / "model")
        save_pretrained(model.to(merged_dtype or resolve_dtype("auto", model.config_dict)), out,
                        source_dir=run_dir / "model")
        copy_tokenizer_files(tokenizer_dir, out)
        return out
    # merging happens in float32 so the bf16 rounding happens once, at the end
    model = load_model(base_path, dtype=torch.float32 if merge else None)
    if adapter_dir is not None:
        model, lora_cfg = load_adapter(model, adapter_dir)
        if cfg is not None and cfg.method == "qlora":
            # trained on the NF4 base: merged into its dequantised weights, in the dtype loaded (float32 to merge),
            # quantised from the values the run quantised (its model.dtype's)
            to_qlora(model, model.model.embed_tokens.weight.dtype, resolve_dtype(cfg.model.dtype, model.config_dict))
    else:
        tensors, _ = load(checkpoint)
        method = method_of(cfg)
        if isinstance(method, Qlora):  # dequantise to the dtype loaded (float32 to merge), not the run's
            method.compute_dtype = model.model.embed_tokens.weight.dtype
        model = method.transform(model)
        method.load_checkpoint_state(model, tensors["model"], str(checkpoint))
        lora_cfg = cfg.lora
        if cfg.method == "full":  # every weight trained: the checkpoint's model is the export, an HF folder
            with torch.no_grad():
                for name, master in tensors.get("master", {}).items():  # float32 masters, when bf16/fp16 trained
                    model.get_parameter(name).copy_(master)
            save_pretrained(model.to(merged_dtype or resolve_dtype("auto", model.config_dict)), out,
                            source_dir=base_path)
            copy_tokenizer_files(tokenizer_dir, out)
            return out

    if not merge:
        save_adapter(model, out, lora_cfg, base_model_name_or_path=str(base_path.resolve()))
        copy_tokenizer_files(tokenizer_dir, out)
        return out
    model = merge_lora(model)
    target = merged_dtype or resolve_dtype("auto", model.config_dict)
    save_pretrained(model.to(target), out, source_dir=base_path)
    copy_tokenizer_files(tokenizer_dir, out)
    return out
