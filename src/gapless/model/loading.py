"""An HF checkpoint folder -> a gapless CausalLM.

config.json gives the architecture (`read_model_args`), in either transformers 4.x form
(`rope_theta` + `rope_scaling`, what hub checkpoints carry) or 5.x form (`rope_parameters`).
Weights come from model.safetensors or the shards named by model.safetensors.index.json. The model
is built on the meta device (no memory), every key and shape is checked against the safetensors
headers before a tensor is read, and then tensors are read by a bounded pool of threads (on CUDA, with pread into
page-locked staging buffers and asynchronous copies to the GPU, _StagedReader; on the host, safetensors' memory
map), converted to the target dtype and handed over in
checkpoint order, one at a time, to be assigned or quantised, so there is never a second full copy of the
weights in memory: at most LOAD_INFLIGHT_BYTES of tensors are read ahead of the one being assigned.
Pickle checkpoints (*.bin, *.pt) are refused, never unpickled: unpickling can run arbitrary code. A checkpoint
that bitsandbytes saved in 4 bits (quantization_config; "-bnb-4bit" folders) loads too: gapless.model.prequantized.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from gapless.model.decoder import ROPE_TYPES, CausalLM, ModelArgs, RopeScaling
from gapless.model.families import FAMILIES, Family, family
from gapless.model.prequantized import StoredNF4, check_quantization_config, fold
from gapless.model.prequantized import read as read_stored

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
# state-dict keys some older conversions persisted; transformers ignores them on load, and so do we
IGNORED_KEY_SUFFIXES = ("rotary_emb.inv_freq",)
# config.json's `architectures` of a model with another head than an LM's (a classifier's or reward model's
# score.weight, a QA model's qa_outputs.weight), which gapless cannot train as a causal LM
NOT_CAUSAL_LM_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")

_MISSING = object()


def read_config(folder: str | Path) -> dict:
    """config.json of `folder` as a dict; a missing or unreadable file is a ValueError naming it."""
    folder = Path(folder)
    path = folder / "config.json"
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder; pass the path of an HF checkpoint folder "
                         "(config.json + model.safetensors)")
    if not path.is_file() and (folder / "adapter_config.json").is_file():
        # an adapter folder given as the model (a hub LoRA, a run's adapter/): copying a config.json in would not help
        try:
            base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
        except (json.JSONDecodeError, AttributeError):
            base = None
        raise ValueError(f"{folder}: a PEFT adapter (adapter_config.json), not a model; load its base model "
                         f"{base!r} (its base_model_name_or_path) and the adapter on it")
    if not path.is_file():
        raise ValueError(f"{path}: not found; an HF checkpoint folder needs config.json beside its "
                         "*.safetensors weights (copy it from the model's source)")
    return read_json_object(path)


def read_json_object(path: Path) -> dict:
    """A JSON file whose top level is an object (config.json, generation_config.json); else a ValueError naming it."""
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: the top level must be a JSON object, got {type(config).__name__}")
    return config


def read_model_args(folder: str | Path) -> ModelArgs:
    """The architecture of the checkpoint in `folder`, from its config.json."""
    return model_args_from_config(read_config(folder), where=str(Path(folder) / "config.json"))


class _Fields:
    """Typed reads from a config dict; every error names the file and the field."""

    def __init__(self, config: dict, where: str, prefix: str = ""):
        self.config, self.where, self.prefix = config, where, prefix  # prefix: "text_config." for a nested config

    def error(self, name: str, message: str) -> ValueError:
        return ValueError(f"{self.where}: {self.prefix}{name}: {message}")

    def get(self, name: str, default: Any = _MISSING, source: dict | None = None) -> Any:
        source = self.config if source is None else source
        if source.get(name) is None:
            if default is _MISSING:
                raise self.error(name, "required field is missing or null")
            return default
        return source[name]

    def integer(self, name: str, default: Any = _MISSING, source: dict | None = None) -> Any:
        value = self.get(name, default, source)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise self.error(name, f"expected a positive integer, got {value!r}")
        return value

    def number(self, name: str, default: Any = _MISSING, source: dict | None = None) -> Any:
        value = self.get(name, default, source)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise self.error(name, f"expected a positive number, got {value!r}")
        return None if value is None else float(value)

    def nullable(self, name: str, default: float | None) -> float | None:
        """A positive number where null means none (a soft-cap), and `default` only when the field is absent."""
        return self.number(name, None) if name in self.config else default

    def flag(self, name: str, default: Any = _MISSING, source: dict | None = None) -> bool:
        value = self.get(name, default, source)
        if not isinstance(value, bool):
            raise self.error(name, f"expected true or false, got {value!r}")
        return value


def model_args_from_config(config: dict, where: str = "config.json") -> ModelArgs:
    """ModelArgs from a config.json dict and its family's rules (gapless.model.families); `where` names the file
    in error messages."""
    f = _Fields(config, where)
    model_type = config.get("model_type")
    try:
        fam = family(model_type)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    check_quantization_config(config, where)  # bitsandbytes' 4-bit weights are read (gapless.model.prequantized)
    if fam.text_config:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise f.error("text_config", f"a {model_type} checkpoint keeps its decoder's fields here; got {text!r}")
        if config.get("vision_config") is not None:
            warnings.warn(f"{where}: the vision tower (vision_config) is ignored: gapless trains the text decoder "
                          "of this image-text checkpoint; the vision weights are not read", stacklevel=2)
        # tie_word_embeddings is the top-level config's in transformers' image-text classes
        text = {**text, **({"tie_word_embeddings": config["tie_word_embeddings"]}
                           if "tie_word_embeddings" in config else {})}
        f = _Fields(text, where, prefix="text_config.")
    top, config = config, f.config  # config: the decoder's fields (text_config's for an image-text checkpoint)
    defaults = fam.defaults
    tied = f.flag("tie_word_embeddings", defaults["tie_word_embeddings"])
    _check_architectures(top.get("architectures"), where, fam, tied)
    hf_name = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[fam.activation]  # transformers' ACT2FN names
    if f.get(fam.activation_field, hf_name) != hf_name:
        raise f.error(fam.activation_field, f"{config[fam.activation_field]!r} is not supported; the {model_type} "
                                            f"family uses {hf_name!r}")
    if config.get("attention_dropout"):
        warnings.warn(f"{where}: attention_dropout={config['attention_dropout']} is ignored; "
                      "gapless applies no dropout inside attention", stacklevel=2)
    if config.get("use_bidirectional_attention"):
        raise f.error("use_bidirectional_attention", "bidirectional attention (an embedding model) is not "
                                                     "supported; gapless trains causal language models")
    for name, applies in (("attn_logit_softcapping", fam.attn_softcap), ("final_logit_softcapping", fam.final_softcap)):
        if config.get(name) is not None and not applies:  # transformers' own model never applies it either
            warnings.warn(f"{where}: {f.prefix}{name}={config[name]} is ignored, as transformers' {model_type} "
                          "model ignores it", stacklevel=2)

    # the sizes are required unless the family's config class has defaults for them (Gemma 3's text_config)
    hidden = f.integer("hidden_size", defaults.get("hidden_size", _MISSING))
    heads = f.integer("num_attention_heads", defaults.get("num_attention_heads", _MISSING))
    layers = f.integer("num_hidden_layers", defaults.get("num_hidden_layers", _MISSING))
    kv_heads = f.integer("num_key_value_heads", defaults.get("num_key_value_heads", heads))
    if heads % kv_heads:
        raise f.error("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads={heads}")
    head_dim = f.integer("head_dim", defaults.get("head_dim"))
    if head_dim is None:
        if hidden % heads:
            raise f.error("head_dim", f"missing, and hidden_size={hidden} is not a multiple of "
                                      f"num_attention_heads={heads}")
        head_dim = hidden // heads
    if head_dim % 2:
        raise f.error("head_dim", f"RoPE needs an even head dimension, got {head_dim}")
    # transformers' default where it is left out (google/gemma-3-4b-it's text_config names none, and reads 131,072);
    # null is none, as the config class keeps it
    max_positions = f.integer("max_position_embeddings", None if "max_position_embeddings" in config
                              else defaults["max_position_embeddings"])
    rope_theta, rope_scaling, local_theta = _read_rope(f, fam, max_positions)

    # the special tokens: the decoder's, else the top level's (Gemma 3's image-text configs keep eos_token_id [1, 106],
    # <eos> and <end_of_turn>, there and none in text_config)
    tokens = {}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        src = f if config.get(k) is not None else _Fields(top, where)
        tokens[k] = token_ids(src.config, k, src.where, src.prefix)
    biases = set(fam.bias)
    if fam.attention_bias_on and f.flag("attention_bias", False):
        biases |= set(fam.attention_bias_on)
    if fam.mlp_bias_on and f.flag("mlp_bias", False):
        biases |= set(fam.mlp_bias_on)
    return ModelArgs(
        model_type=model_type,
        vocab_size=f.integer("vocab_size", defaults.get("vocab_size", _MISSING)),
        hidden_size=hidden,
        intermediate_size=f.integer("intermediate_size", defaults.get("intermediate_size", _MISSING)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.number("rms_norm_eps", defaults["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        biases=tuple(p for p in fam.projections if p in biases),
        sliding_window=_read_sliding_window(f, fam, layers),
        local_rope_theta=local_theta,
        query_pre_attn_scalar=(f.number(fam.query_scale_field, defaults[fam.query_scale_field])
                               if fam.query_scale_field else None),
        attn_softcap=f.nullable("attn_logit_softcapping", defaults.get("attn_logit_softcapping"))
        if fam.attn_softcap else None,
        final_softcap=f.nullable("final_logit_softcapping", defaults.get("final_logit_softcapping"))
        if fam.final_softcap else None,
        **tokens,
    )


def token_ids(config: dict, name: str, where: str, prefix: str = "") -> int | list[int] | None:
    """A special token's id as config.json or generation_config.json (`where`) holds it: null, an id (a negative
    pad_token_id, as old LLaMA conversions wrote, reads as no pad), or for eos_token_id a list of them (Llama 3.1's
    [128001, 128008, 128009]). Anything else, a string id say, would match no token and silently never stop
    generation: a ValueError naming the file and the field (`prefix`: "text_config." for a nested config)."""
    value = config.get(name)
    ids = value if isinstance(value, list) and name == "eos_token_id" else [value]
    if value is not None and any(isinstance(i, bool) or not isinstance(i, int) or (i < 0 and name != "pad_token_id")
                                 for i in ids):
        raise ValueError(f"{where}: {prefix}{name}: expected a token id"
                         f"{' or a list of token ids (e.g. [128001, 128009])' if name == 'eos_token_id' else ''}, "
                         f"got {value!r}")
    return value


def _check_architectures(names: Any, where: str, fam: Family, tied: bool) -> None:
    """config.json's `architectures` (when it has the list) names a causal LM: *ForCausalLM, Gemma 3's
    *ForConditionalGeneration, another name the weights then decide, or a text decoder saved without its head
    (LlamaModel) whose head is its tied embedding, as transformers' ForCausalLM loads it (decoder_headers)."""
    for name in names if isinstance(names, list) else []:
        if not isinstance(name, str):
            continue
        if name.endswith(NOT_CAUSAL_LM_HEADS):
            raise ValueError(f"{where}: architectures: {names} is not a causal LM (its head, e.g. a classifier's or "
                             "reward model's score.weight, is not an LM head); gapless fine-tunes causal LMs "
                             "(*ForCausalLM, Gemma3ForConditionalGeneration): load the causal LM it was made from")
        if name.endswith("Model") and "For" not in name and not (tied and not fam.checkpoint_prefix):
            # transformers would give it a random lm_head; an image-text base (Gemma3Model) has another layout
            why = ("tie_word_embeddings is false, so the head would be random" if not fam.checkpoint_prefix else
                   f"a {fam.name} base model is not read without its ForConditionalGeneration layout")
            raise ValueError(f"{where}: architectures: {names} is a base decoder without an LM head (lm_head.weight), "
                             f"and {why}; gapless fine-tunes causal LMs (*ForCausalLM): load the model's causal-LM "
                             "checkpoint")


def _read_rope(f: _Fields, fam: Family, max_positions: int | None) -> tuple[float, RopeScaling, float | None]:
    """(rope_theta and scaling of the global layers, the sliding layers' own base or None) from 5.x
    `rope_parameters` (per layer type for Gemma 3: {full_attention: ..., sliding_attention: ...}) or 4.x
    `rope_scaling` + `rope_theta` (+ Gemma 3's `rope_local_base_freq`)."""
    config = f.config
    params, name = config.get("rope_parameters") or {}, "rope_parameters"
    local: dict | None = None
    if fam.local_rope:
        if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
            if not set(params) <= {"full_attention", "sliding_attention"}:
                raise f.error(name, f"expected RoPE parameters per layer type (full_attention, sliding_attention), "
                                    f"got {params!r}")
            local = params.get("sliding_attention") or {}
            params, name = params.get("full_attention") or {}, "rope_parameters.full_attention"
        else:
            local = {}
        if config.get("rope_scaling"):  # transformers 5 applies a 4.x rope_scaling to the global layers
            params, name = {**params, **config["rope_scaling"]}, "rope_scaling"
    elif config.get("rope_scaling"):  # transformers 5 lets a non-null 4.x `rope_scaling` win; so do we
        params, name = config["rope_scaling"], "rope_scaling"
    theta, scaling = _read_rope_table(f, params, name, max_positions, fam.defaults["rope_theta"])
    if local is None:
        return theta, scaling, None
    local_name = "rope_parameters.sliding_attention"
    if not isinstance(local, dict) or (local.get("rope_type") or "default") != "default":
        raise f.error(local_name, f"the sliding layers' RoPE must be unscaled (rope_type default), got {local!r}")
    local_theta = f.number("rope_theta", None, source=local) or f.number(
        "rope_local_base_freq", fam.defaults["rope_local_base_freq"])
    return theta, scaling, local_theta


def _read_rope_table(f: _Fields, params: Any, name: str, max_positions: int | None,
                     default_theta: float) -> tuple[float, RopeScaling]:
    """rope_theta and scaling from one mapping of RoPE parameters (`name` in errors)."""
    config = f.config
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise f.error(name, f"expected one mapping of RoPE parameters (per-layer-type RoPE is not "
                            f"supported for this family), got {params!r}")
    theta = f.number("rope_theta", None, source=params) or f.number("rope_theta", default_theta)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise f.error(f"{name}.rope_type", f"{rope_type!r} is not supported; gapless supports "
                                           f"{', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise f.error("partial_rotary_factor", f"{partial!r}: partial RoPE is not supported")
    if rope_type == "default":
        return theta, RopeScaling()

    def field(key: str, default: Any = _MISSING, kind: str = "number") -> Any:
        try:
            return getattr(f, kind)(key, default, source=params)
        except ValueError as e:
            raise ValueError(str(e).replace(f": {f.prefix}{key}:", f": {f.prefix}{name}.{key}:", 1)) from None

    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=field("factor"))
    if rope_type == "dynamic":  # plain RoPE up to max_position_embeddings, the length it starts rescaling at
        if max_positions is None:
            raise f.error("max_position_embeddings", f"dynamic RoPE ({name}) needs it: the length past which "
                                                     "transformers rescales the RoPE base")
        return theta, RopeScaling(rope_type="dynamic", factor=field("factor"))
    # the pretraining context: a top-level field wins (as in transformers), else the rope mapping's,
    # else max_position_embeddings
    original = f.integer("original_max_position_embeddings", None) or field(
        "original_max_position_embeddings", max_positions, "integer")
    if original is None:
        raise f.error(f"{name}.original_max_position_embeddings",
                      f"{rope_type} RoPE needs it (or max_position_embeddings)")
    if rope_type == "llama3":
        return theta, RopeScaling(rope_type="llama3", factor=field("factor"), original_max_position_embeddings=original,
                                  low_freq_factor=field("low_freq_factor"), high_freq_factor=field("high_freq_factor"))
    factor = field("factor", None)
    if factor is None:  # transformers derives it from the two context lengths
        if max_positions is None:
            raise f.error(f"{name}.factor", "yarn RoPE needs factor (or max_position_embeddings)")
        factor = max_positions / original
    return theta, RopeScaling(
        rope_type="yarn", factor=factor, original_max_position_embeddings=original,
        beta_fast=field("beta_fast", 32.0), beta_slow=field("beta_slow", 1.0),
        attention_factor=field("attention_factor", None), mscale=field("mscale", None),
        mscale_all_dim=field("mscale_all_dim", None), truncate=field("truncate", True, "flag"))


def _read_sliding_window(f: _Fields, fam: Family, layers: int) -> list[int | None]:
    """The attention window of each layer, as transformers' config classes decide it (the family's rule)."""
    if fam.windows == "none":
        return [None] * layers
    if fam.windows == "every_layer":
        # MistralConfig's default is 4096 when the field is absent; null (Mistral v0.2+) means none
        window = f.integer("sliding_window", None) if "sliding_window" in f.config else fam.defaults["sliding_window"]
        return [window] * layers
    # qwen2 / qwen3: a window only with use_sliding_window, and only on the layers layer_types names (by default
    # those at index >= max_window_layers); gemma: on the layers layer_types names (by default all but every
    # window_pattern-th: Gemma 2 alternates from a sliding layer 0, Gemma 3 has 5 sliding per global)
    if fam.windows == "use_sliding_window" and not f.flag("use_sliding_window", False):
        return [None] * layers
    if "sliding_window" in f.config and f.config["sliding_window"] is None:
        # an explicit null leaves the sliding layers unwindowed, as in transformers (Gemma's and Qwen's config classes
        # keep None, and Qwen's then names every layer full_attention); only an absent field takes the default
        return [None] * layers
    window = f.integer("sliding_window", fam.defaults["sliding_window"])
    layer_types = f.get("layer_types", None)
    if layer_types is None:
        if fam.windows == "use_sliding_window":
            first = f.get("max_window_layers", fam.defaults["max_window_layers"])
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        else:
            pattern = f.integer("sliding_window_pattern", fam.window_pattern)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != layers
            or not set(layer_types) <= {"full_attention", "sliding_attention"}):
        raise f.error("layer_types", f"expected {layers} entries of 'full_attention' or 'sliding_attention', "
                                     f"got {layer_types!r}")
    return [window if t == "sliding_attention" else None for t in layer_types]


# ---------------------------------------------------------------------------------------------
# weights


def decoder_headers(headers: dict[str, tuple[Path, tuple[int, ...]]],
                    args: ModelArgs) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """read_weight_headers' entries under our key names, each with its key in the checkpoint; the tensors that are
    not the decoder's (an image-text checkpoint's vision tower) left out.

    Gemma 3's image-text checkpoints come in two layouts that transformers both loads: the hub's, which its
    save_pretrained writes (the family's checkpoint_prefix before our names: language_model.model.layers.0...,
    language_model.lm_head.weight), and the class's module names, which a saved state dict has (the family's
    decoder_module for our `model`: model.language_model.layers.0..., lm_head.weight)."""
    fam = family(args.model_type)
    prefix = fam.checkpoint_prefix
    if not prefix and not any(key.startswith("model.") for key in headers):
        # a decoder saved without its head (LlamaModel: layers.0..., no lm_head; model_args_from_config let it
        # through only with tied embeddings): transformers' ForCausalLM loads it under `model.`, and so do we
        return {"model." + key: (*value, key) for key, value in headers.items()}
    if not prefix or any(key.startswith(prefix) for key in headers):
        return {key[len(prefix):]: (*value, key) for key, value in headers.items() if key.startswith(prefix)}
    decoder = fam.decoder_module + "."
    return {("model." + key[len(decoder):] if key.startswith(decoder) else key): (*value, key)
            for key, value in headers.items() if key.startswith(decoder) or key == "lm_head.weight"}


def read_weight_headers(folder: str | Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """key -> (safetensors file, shape) from the headers alone; no tensor data is read."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index (needs a 'weight_map' object): {e}") from None
        files = sorted({folder / name for name in weight_map.values()})
        absent = [p.name for p in files if not p.is_file()]
        if absent:
            raise ValueError(f"{index}: names shard files that are not in the folder: {', '.join(absent)}")
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        names = sorted(p.name for p in folder.iterdir())
        pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
        if pickles:
            raise ValueError(
                f"{folder}: holds only pickle checkpoints ({', '.join(pickles)}); gapless reads safetensors "
                "and never unpickles (loading a pickle can run arbitrary code). If you trust the file, convert "
                "it once with transformers: AutoModelForCausalLM.from_pretrained(folder).save_pretrained("
                "new_folder, safe_serialization=True), then load new_folder")
        others = [n for n in names if n.endswith(".safetensors")]
        raise ValueError(f"{folder}: no model.safetensors or model.safetensors.index.json"
                         + (f" (found {', '.join(others)}; is the index file missing?)" if others else ""))
    headers: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as st:
                for key in st.keys():
                    headers[key] = (path, tuple(st.get_slice(key).get_shape()))
        except SafetensorError as e:
            raise ValueError(f"{path}: not a readable safetensors file: {e}") from None
    return headers


def resolve_dtype(dtype: torch.dtype | str | None, config: dict | None = None) -> torch.dtype:
    """A torch dtype from a dtype, a name ('bfloat16', 'bf16', ...), 'auto' (config.json's) or None (float32)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype: {dtype} is not a floating-point type")
        return dtype
    if dtype == "auto":
        saved = (config or {}).get("dtype") or (config or {}).get("torch_dtype") or "float32"
        return resolve_dtype(saved)
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not known; choose one of {', '.join(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def _format_keys(keys: list[str], limit: int = 40) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def build(path: str | Path, attn_backend: str = "sdpa") -> CausalLM:
    """The architecture of the checkpoint folder `path`, built on the meta device: no memory, no weights read.

    Every key and shape of the safetensors headers is checked against config.json here, before any transform,
    so a wrong folder fails before anything is allocated. `load_weights` fills the model once the method,
    activation checkpointing and compile have transformed it (the order of gapless.train.assemble).
    """
    folder = Path(path)
    config = read_config(folder)
    args = model_args_from_config(config, where=str(folder / "config.json"))
    # our key names (Gemma 3: its text part); a 4-bit weight under its own name and shape (prequantized.fold)
    headers = decoder_headers(fold(read_weight_headers(folder))[0], args)
    with torch.device("meta"):  # parameters without storage: nothing is allocated until load_weights assigns
        model = CausalLM(args, attn_backend=attn_backend)
    expected = model.checkpoint_shapes
    found = {k for k in headers if not k.endswith(IGNORED_KEY_SUFFIXES)}
    if args.tie_word_embeddings:  # lm_head shares the embedding; checkpoints usually leave it out
        found.discard("lm_head.weight")
    missing, unexpected = sorted(expected.keys() - found), sorted(found - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{folder}: the weights do not match config.json's {args.model_type} architecture; "
                         f"missing keys: [{_format_keys(missing)}]; unexpected keys: [{_format_keys(unexpected)}]")
    wrong = [f"{key} has shape {list(headers[key][1])} in {headers[key][0].name}, but config.json implies "
             f"{list(shape)}" for key, shape in expected.items() if headers[key][1] != shape]
    if wrong:
        raise ValueError(f"{folder}: the tensor shapes do not match config.json: {'; '.join(wrong[:20])}"
                         + (f"; ... ({len(wrong) - 20} more)" if len(wrong) > 20 else ""))
    model.config_dict = config
    model.source_dir = folder
    return model


# hook(key, tensor) -> True when it took the tensor (QLoRA quantises it into its layer's storage); else the
# tensor is assigned to the parameter or buffer of that name. A 4-bit weight of a bitsandbytes checkpoint (StoredNF4)
# is offered as it is to the hook's `stored(key, weight) -> bool` where it has one (QLoRA's: it trains on the
# file's codes), else dequantised to the load's dtype and handled as any tensor
LoadHook = Callable[[str, torch.Tensor], bool]


# Reading threads. Each tensor is read (page faults on a memory-mapped shard, the host-to-device copy) and cast by
# one of them; the main thread takes the tensors in checkpoint order and assigns or quantises them, so the result
# is the serial load's, bit for bit. 8 threads: enough to keep an NVMe drive and the PCIe link busy with a 3B
# model's 50 MB projections (a 3B checkpoint holds 255 tensors), few enough not to crowd the data workers.
LOAD_THREADS = 8
# Tensors read ahead of the one the main thread is assigning, in bytes (as read and as cast, the larger): the most
# a parallel load holds beyond a serial one. 1 GiB: 8 of Llama-3.1-8B's largest projections (14336 x 4096 x 2 B =
# 117 MB) or one embedding (128256 x 4096 x 2 B = 1.05 GB; a tensor larger than the budget is read alone).
LOAD_INFLIGHT_BYTES = 1 << 30
# bytes per element of safetensors' dtype names (get_slice(...).get_dtype()); 8-bit types and bool are 1
_ELEMENT_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                  "U16": 2}


# safetensors' dtype names that the staged CUDA reader reinterprets its bytes as; a tensor of any other dtype (the
# 8-bit floats) is read through safe_open
_STAGED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                  "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                  "BOOL": torch.bool}
# bytes of each of a reading thread's two page-locked staging buffers: 8 threads hold 256 MiB, and one pread of
# 16 MiB from the page cache or an NVMe drive is long enough to amortise its call
STAGE_BYTES = 16 << 20


def tensor_extents(file: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """key -> (safetensors dtype name, shape, first byte, end byte) of each tensor in the file, from its header
    (8 bytes of little-endian header length, then the JSON header, then the data the offsets count from)."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    base = 8 + size
    return {key: (v["dtype"], tuple(v["shape"]), base + v["data_offsets"][0], base + v["data_offsets"][1])
            for key, v in header.items() if key != "__metadata__"}


class _StagedReader:
    """Reads a tensor's bytes with pread into one of its thread's two staging buffers (page-locked where the device
    is CUDA) while the other buffer's bytes are copied to the device on the thread's own stream, so the disk (or the
    page cache) and the host-to-device link work at once; safe_open(device="cuda") instead faults the memory-mapped
    pages in one by one and copies from pageable memory (1.9 GiB/s with 8 threads on an H100, bench/RESULTS.md).
    Returns when the tensor is on the device. One reader is shared by the loading threads."""

    def __init__(self, device: torch.device, stage_bytes: int | None = None):
        self.device, self.stage_bytes = device, stage_bytes or STAGE_BYTES
        # per loading thread (by its ident): two [buffer, event of its last copy] and a stream. A plain dict, not a
        # threading.local: a process forked from another thread meanwhile (gapless train's tokenizer workers,
        # forked while the weights load) clears the other threads' states in PyOS_AfterFork_Child, which destroys
        # their threading.local values there, and a CUDA stream or pinned buffer destroyed in a forked child aborts
        # it ("CUDA error: initialization error" in c10::cuda::ExchangeDevice: runs s20-startup, s21-startup)
        self.threads: dict[int, tuple[list[list], torch.cuda.Stream | None]] = {}

    def _thread_state(self) -> tuple[list[list], torch.cuda.Stream | None]:
        ident = threading.get_ident()
        if ident not in self.threads:
            self.threads[ident] = self._new_state()
        return self.threads[ident]

    def _new_state(self) -> tuple[list[list], torch.cuda.Stream | None]:
        cuda = self.device.type == "cuda"
        stages = [[torch.empty(self.stage_bytes, dtype=torch.uint8, pin_memory=cuda), None] for _ in range(2)]
        return stages, torch.cuda.Stream(self.device) if cuda else None

    def read(self, fd: int, file: Path, key: str, extent: tuple[str, tuple[int, ...], int, int]) -> torch.Tensor:
        dtype_name, shape, start, end = extent
        out = torch.empty(end - start, dtype=torch.uint8, device=self.device)
        stages, stream = self._thread_state()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for i, offset in enumerate(range(0, end - start, self.stage_bytes)):
                stage = stages[i % 2]
                if stage[1] is not None:
                    stage[1].synchronize()  # its previous bytes are on the device
                n = min(self.stage_bytes, end - start - offset)
                view = memoryview(stage[0].numpy())[:n]
                done = 0
                while done < n:
                    got = os.preadv(fd, [view[done:]], start + offset + done)
                    if got == 0:
                        raise ValueError(f"{file}: tensor {key} could not be read: the file ends before byte "
                                         f"{start + offset + n:,} that its header names (was it truncated?)")
                    done += got
                out[offset:offset + n].copy_(stage[0][:n], non_blocking=stream is not None)
                if stream is not None:
                    stage[1] = stream.record_event()
            if stream is not None:
                stream.synchronize()
        return out.view(_STAGED_DTYPES[dtype_name]).view(shape)


def _safe_open_device(device: torch.device) -> str:
    """Where safe_open puts the tensors it reads: the CUDA device itself (no host tensor is made for gapless to
    copy), else the host."""
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"


def _read_tensor(handle, file: Path, key: str, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    """One tensor of an open shard, on `device` in `dtype`; a read error names the file and the tensor."""
    try:
        tensor = handle.get_tensor(key)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: tensor {key} could not be read: {e}") from None
    return tensor.to(device=device, dtype=dtype or tensor.dtype)


def checkpoint_tensors(model: CausalLM, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                       threads: int = LOAD_THREADS, inflight_bytes: int = LOAD_INFLIGHT_BYTES,
                       staged: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) for every checkpoint tensor of the folder `build` read, in the model's order, each on `device`
    in `dtype` (None: the file's). `staged`: read through _StagedReader (None: on CUDA) rather than safetensors'
    memory map. `threads` threads read ahead of the consumer, holding at most `inflight_bytes`
    (or one tensor larger than that); threads <= 1 reads each tensor when it is asked for, in this thread."""
    device = torch.device(device)
    headers, stored = fold(read_weight_headers(model.source_dir))
    headers = decoder_headers(headers, model.args)
    keys = list(model.checkpoint_shapes)
    gone = [key for key in keys if key not in headers]
    if gone:  # `build` found them: the folder was rewritten since
        raise ValueError(f"{model.source_dir}: the checkpoint changed after it was checked; it no longer holds "
                         f"[{_format_keys(gone)}]")
    with contextlib.ExitStack() as stack:
        handles = {}
        files = [headers[key][0] for key in keys] + [path for parts in stored.values() for path, _ in parts.files.values()]
        for file in dict.fromkeys(files):  # each shard opened once, shared by the threads
            try:
                handles[file] = stack.enter_context(safe_open(file, framework="pt",
                                                              device=_safe_open_device(device)))
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{file}: not a readable safetensors file: {e}") from None

        opened: dict[Path, tuple[int, dict]] = {}  # staged: file -> (descriptor, tensor extents) for _StagedReader
        if device.type == "cuda" if staged is None else staged:
            reader = _StagedReader(device)
            for file in handles:
                fd = os.open(file, os.O_RDONLY)
                stack.callback(os.close, fd)
                opened[file] = (fd, tensor_extents(file))

        def read_file(file: Path, key_in_file: str, cast: torch.dtype | None = None) -> torch.Tensor:
            fd, extents = opened.get(file, (None, {}))
            extent = extents.get(key_in_file)
            if extent is None or extent[0] not in _STAGED_DTYPES:
                return _read_tensor(handles[file], file, key_in_file, device, cast)
            try:
                tensor = reader.read(fd, file, key_in_file, extent)
            except OSError as e:
                raise ValueError(f"{file}: tensor {key_in_file} could not be read: {e}") from None
            return tensor.to(dtype=cast or tensor.dtype)

        def read(key: str) -> torch.Tensor | StoredNF4:
            file, _, key_in_file = headers[key]
            if key_in_file in stored:  # a 4-bit weight: its parts as stored, for load_weights to dequantise or keep
                return read_stored(key_in_file, stored[key_in_file], read_file)
            return read_file(file, key_in_file, dtype)

        if threads <= 1:
            for key in keys:
                yield key, read(key)
            return
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gapless-load"))
        pending: deque = deque()  # (key, bytes, future) in checkpoint order
        held = 0
        try:
            for key in keys:
                file, _, key_in_file = headers[key]
                view = handles[file].get_slice(key_in_file)
                numel = math.prod(view.get_shape())
                size = numel * max(_ELEMENT_BYTES.get(view.get_dtype(), 1), dtype.itemsize if dtype else 1)
                while pending and (len(pending) >= threads or held + size > inflight_bytes):
                    done_key, done_size, future = pending.popleft()
                    held -= done_size
                    yield done_key, future.result()
                pending.append((key, size, pool.submit(read, key)))
                held += size
            while pending:
                done_key, _, future = pending.popleft()
                yield done_key, future.result()
        finally:  # an error, or a consumer that stopped early: drop the reads not started
            for _, _, future in pending:
                future.cancel()


@torch.no_grad()
def load_weights(model: CausalLM, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
                 hook: LoadHook | None = None, tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
                 threads: int = LOAD_THREADS, staged: bool | None = None) -> CausalLM:
    """Stream the checkpoint's tensors into the model (`tensors`: another source of (key, tensor), e.g. random
    weights for a benchmark; default the folder `build` read, by `threads` reading threads: checkpoint_tensors).

    Each tensor is converted to `dtype` on `device`, offered to `hook`, else assigned in place of the meta tensor
    of that name (keeping its requires_grad), one at a time in the checkpoint's order; a bitsandbytes 4-bit weight
    is kept as stored where the hook takes it, else dequantised (LoadHook). Peak extra memory is one
    tensor plus the read-ahead (LOAD_INFLIGHT_BYTES), never a model. Tensors the checkpoint does not hold (LoRA's
    A and B) stay on the meta device for the method to initialise.
    """
    dtype = resolve_dtype(dtype, model.config_dict)
    for key, tensor in checkpoint_tensors(model, device, dtype, threads, staged=staged) if tensors is None else tensors:
        if isinstance(tensor, StoredNF4):
            if hasattr(hook, "stored") and hook.stored(key, tensor):
                continue
            tensor = tensor.dequantize(dtype)
        tensor = tensor.to(device=device, dtype=dtype)
        if hook is not None and hook(key, tensor):
            continue
        module_name, _, name = key.rpartition(".")
        module = model.get_submodule(module_name)
        old = getattr(module, name)
        if isinstance(old, nn.Parameter):
            setattr(module, name, nn.Parameter(tensor, requires_grad=old.requires_grad))
        else:
            module.register_buffer(name, tensor)
    model.tie_weights()
    model.model.rotary_emb.reset_inv_freq(device)
    return model


def load_model(path: str | Path, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
               attn_backend: str = "sdpa") -> CausalLM:
    """Load the HF checkpoint folder `path` as a CausalLM in `dtype` (default float32) on `device`, in eval mode:
    `build` then `load_weights`, with no transform between them."""
    model = load_weights(build(path, attn_backend), dtype if dtype is not None else torch.float32, device)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers())), "a tensor was not loaded"
    return model.eval()
