"""A model -> an HF checkpoint folder that transformers.AutoModelForCausalLM.from_pretrained loads.

Used after full fine-tuning and after `merge_lora`. The config is the source's config.json with only the dtype
updated (and a 4-bit source's quantization_config dropped: the weights written are dequantised), weights are
safetensors (sharded with model.safetensors.index.json above `max_shard_bytes`, named as transformers names them),
and generation_config.json plus the tokenizer files are copied from the source folder when it has them.

Final outputs are written atomically (`atomic_folder`): into a temporary folder beside the output, then one rename
when the output folder is new; into an existing folder, its config file is removed first and moved back in last,
so a kill or a full disk never leaves a folder that looks complete (config present) with missing or short weights.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from gapless.model.families import family
from gapless.model.loading import decoder_headers, read_config, read_weight_headers
from gapless.model.prequantized import StoredParts, fold
from gapless.model.prequantized import read as read_stored

# transformers 4.x defaulted to 5 GB shards (5.x to 50 GB); 5 GB files suit hub uploads and older readers
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
# preprocessor_config.json and processor_config.json: an image-text checkpoint's processor (Gemma 3's image size and
# image tokens per image), which its merged folder keeps its vision tower for: without them AutoProcessor, and so
# vLLM and transformers' image-text pipeline, cannot load that folder
COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                "chat_template.json", "preprocessor_config.json", "processor_config.json")


def save_pretrained(model: nn.Module, out_dir: str | Path, source_dir: str | Path | None = None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write `model` (a CausalLM without LoRA layers) as an HF folder; source_dir defaults to where it was loaded from."""
    if any(".lora_A." in name for name, _ in model.named_parameters()):
        raise ValueError("the model still has LoRA layers; call merge_lora(model) before saving a merged folder "
                         "(or save_adapter for a PEFT adapter)")
    source = Path(source_dir) if source_dir is not None else getattr(model, "source_dir", None)
    config = dict(model.config_dict) if getattr(model, "config_dict", None) else (
        read_config(source) if source is not None else None)
    if config is None:
        raise ValueError("save_pretrained: pass source_dir (the base model's folder) for its config.json")
    out = Path(out_dir)
    if source is not None and out.resolve() == Path(source).resolve():
        raise ValueError(f"{out}: is the source folder; write the model to a new folder")

    state = model.state_dict()
    if model.args.tie_word_embeddings:  # transformers re-ties lm_head to the embedding on load
        del state["lm_head.weight"]
    dtype = state["model.embed_tokens.weight"].dtype
    if family(model.args.model_type).checkpoint_prefix:
        # an image-text checkpoint (Gemma 3): the decoder under the source's key names (its layout), the rest copied
        # through untouched
        if source is None:
            raise ValueError("save_pretrained: pass source_dir (the base model's folder) for its vision tower")
        headers, stored = fold(read_weight_headers(source))
        names = {ours: value[2] for ours, value in decoder_headers(headers, model.args).items()}
        state = {names[k]: v for k, v in state.items()}
        state.update(_tensors_outside(headers, stored, set(names.values())))
    # the weights written are plain tensors: a 4-bit source's quantization_config (gapless.model.prequantized) would
    # make transformers look for its quant states
    config.pop("quantization_config", None)
    dtype_name = str(dtype).removeprefix("torch.")
    config["torch_dtype"] = dtype_name  # transformers 4.x reads this key
    config["dtype"] = dtype_name  # and 5.x this one

    shards: list[list[str]] = [[]]
    size = 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    # shards of an earlier export would otherwise mix with these
    with atomic_folder(out, "config.json", stale=("model*.safetensors", "model.safetensors.index.json")) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name, keys in zip(names, shards):
            # one shard at a time on the CPU: the peak extra memory is one shard, not the model
            save_file({k: state[k].detach().to("cpu").contiguous() for k in keys}, tmp / name,
                      metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                     "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        if source is not None:
            copy_tokenizer_files(source, tmp)
    return out


def _tensors_outside(headers: dict[str, tuple[Path, tuple[int, ...]]], stored: dict[str, StoredParts],
                     decoder: set[str]) -> dict:
    """The tensors of a checkpoint (prequantized.fold's headers) whose keys are not in `decoder`, as stored; a 4-bit
    one dequantised to the dtype it was quantised from."""
    def get(path: Path, key: str):
        with safe_open(path, framework="pt") as st:
            return st.get_tensor(key)

    return {key: read_stored(key, stored[key], get).dequantize() if key in stored else get(path, key)
            for key, (path, _) in headers.items() if key not in decoder}


@contextmanager
def atomic_folder(out: Path, last: str, stale: tuple[str, ...] = ()) -> Iterator[Path]:
    """Yields a temporary folder beside `out` to write into; on success its files become `out`'s (see the module
    doc): `last` (the file that makes the folder look complete) is moved in last, and `out`'s files matching a
    `stale` glob are removed. On an exception the temporary folder is removed and `out` holds no `last`."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is a file; give a folder to write to")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        for f in tmp.iterdir():  # durable before the rename makes them visible (power loss, not only kills)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if not out.exists():
            os.rename(tmp, out)
            return
        (out / last).unlink(missing_ok=True)  # from here on `out` does not look complete until the end
        for pattern in stale:
            for f in out.glob(pattern):
                f.unlink()
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == last):
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)




def copy_tokenizer_files(source: str | Path, out: str | Path) -> list[str]:
    """Copy generation_config.json and the tokenizer files that `source` has into `out`; returns their names."""
    copied = []
    for name in COPIED_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, Path(out) / name)
            copied.append(name)
    return copied
