"""The rules of each supported model family, in one table: a new family is one entry here plus its special layers.

A `Family` says what a checkpoint's config.json cannot: the form of its norms, its activation, whether the
embeddings are scaled, which config fields hold its attention scale, soft-capping, sliding windows and per-layer
RoPE, which projections exist and which carry a bias, and the defaults transformers' config class fills in for
fields a config.json leaves out. `gapless.model.loading.model_args_from_config` reads an entry together with
config.json into ModelArgs; the decoder (gapless.model.decoder), the LoRA targets and the FLOPs count
(gapless.meter.flops) read the entry through `family(args.model_type)`.

The rules are transformers' own (transformers 5.x, models/<family>/modeling_*.py and configuration_*.py):

    llama    RMSNorm as weight * x; SwiGLU; `attention_bias` on q/k/v/o, `mlp_bias` on gate/up/down; no windows
    mistral  as llama without biases; a sliding window on every layer (absent: 4096; null: none)
    qwen2    bias on q/k/v always (never o); windows only with `use_sliding_window`, on the layers named by
             `layer_types` (default: index >= `max_window_layers`)
    qwen3    qwen2's windows, `attention_bias` on q/k/v/o, RMSNorm on each q and k head; head_dim defaults to 128
    gemma2   RMSNorm as (1 + weight) * x in float32; GeGLU with tanh GELU; embeddings times sqrt(hidden);
             sandwich norms (the attention and MLP outputs normed before the residual add, plus a pre-MLP norm);
             scores scaled by query_pre_attn_scalar^-0.5; tanh soft-capping of the attention scores (50) and
             the final logits (30); sliding and global layers alternate (layer 0 sliding)
    gemma3_text  gemma2's layers without soft-capping of the scores (transformers' Gemma3Attention never passes
             attn_logit_softcapping), plus q/k norms; five sliding layers per global one; sliding layers use
             their own RoPE base (rope_local_base_freq, 10,000) without scaling, global ones rope_theta (1e6)
             with rope_scaling
    gemma3   the text model of Gemma 3's image-text checkpoints (`text_config`); the vision tower is ignored
             with a warning. Its final logits are not soft-capped (Gemma3ForConditionalGeneration never does).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gapless.config import ALL_LINEAR

# how the per-layer windows are read from config.json (gapless.model.loading._read_sliding_window)
WindowRule = Literal["none", "every_layer", "use_sliding_window", "layer_types"]


@dataclass(frozen=True)
class Family:
    name: str
    # "weight": w * x.to(dtype) (Llama: the float32 statistics cast back before the weight);
    # "one_plus_weight": ((1 + w) * x) in float32, then cast (Gemma; the weights are stored centred on 0)
    norm: Literal["weight", "one_plus_weight"] = "weight"
    activation: Literal["silu", "gelu_tanh"] = "silu"  # of the gate projection
    # the config field naming it (Gemma's modeling code reads hidden_activation and ignores hidden_act)
    activation_field: str = "hidden_act"
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), rounded to the activation dtype first (HF)
    sandwich_norms: bool = False  # post_attention_layernorm on the attention output, pre/post_feedforward_layernorm
    qk_norm: bool = False  # an RMSNorm over head_dim on each q and k head, before RoPE
    # the config field whose value^-0.5 scales the attention scores; None: head_dim^-0.5
    query_scale_field: str | None = None
    # projections with a bias: always, and those switched on by `attention_bias` / `mlp_bias` in config.json
    bias: tuple[str, ...] = ()
    attention_bias_on: tuple[str, ...] = ()
    mlp_bias_on: tuple[str, ...] = ()
    windows: WindowRule = "none"
    window_pattern: int | None = None  # layer_types absent: every window_pattern-th layer global, the rest sliding
    local_rope: bool = False  # sliding layers have their own RoPE base (rope_local_base_freq), unscaled
    attn_softcap: bool = False  # reads attn_logit_softcapping
    final_softcap: bool = False  # reads final_logit_softcapping
    text_config: bool = False  # the decoder's fields sit under text_config (an image-text checkpoint)
    # the checkpoint's key of each of our tensors is this + our key (Gemma 3's image-text checkpoints, as
    # transformers saves them: language_model.model.layers.0..., language_model.lm_head.weight), or, in a checkpoint
    # with none of these keys, its name under decoder_module (gapless.model.loading.decoder_headers); the checkpoint's
    # other tensors (vision_tower., multi_modal_projector.) are not the decoder's: never read, and copied through
    # untouched by a merged export (gapless.model.export)
    checkpoint_prefix: str = ""
    # transformers' module path of our `model.` (the decoder) in the family's class, which PEFT adapters name their
    # tensors and target_modules by: Gemma 3's image-text class holds the decoder at model.language_model (since
    # transformers 4.52, and in 5.x), beside model.vision_tower, whose attention layers are also q_proj/k_proj/v_proj
    decoder_module: str = "model"
    projections: tuple[str, ...] = ALL_LINEAR  # the linear layers of a decoder layer, LoRA's "all-linear"
    # transformers' config-class defaults for fields a config.json may leave out
    defaults: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        assert set(self.bias) | set(self.attention_bias_on) | set(self.mlp_bias_on) <= set(self.projections)


_LLAMA_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                   "max_position_embeddings": 2048}
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_GEMMA = dict(norm="one_plus_weight", activation="gelu_tanh", activation_field="hidden_activation", embed_scale=True,
              sandwich_norms=True, query_scale_field="query_pre_attn_scalar", attention_bias_on=_ATTENTION,
              windows="layer_types")
_GEMMA_DEFAULTS = {**_LLAMA_DEFAULTS, "tie_word_embeddings": True, "head_dim": 256, "query_pre_attn_scalar": 256,
                   "sliding_window": 4096, "max_position_embeddings": 8192}
# Gemma3TextConfig's sizes: an image-text config saved by transformers 4.x writes only the text_config fields that
# differ from the defaults (google/gemma-3-4b-it's names no vocab_size, heads, KV heads or head_dim), and transformers
# reads the rest as these. Top-level configs are saved whole, so the text-only families need none.
_GEMMA3_TEXT_SIZES = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                      "num_attention_heads": 8, "num_key_value_heads": 4}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", attention_bias_on=_ATTENTION, mlp_bias_on=_MLP, defaults=_LLAMA_DEFAULTS),
    Family("mistral", windows="every_layer",
           defaults={**_LLAMA_DEFAULTS, "sliding_window": 4096, "max_position_embeddings": 131072}),
    Family("qwen2", bias=("q_proj", "k_proj", "v_proj"), windows="use_sliding_window",
           defaults={**_LLAMA_DEFAULTS, "sliding_window": 4096, "max_window_layers": 28,
                     "max_position_embeddings": 32768}),
    Family("qwen3", qk_norm=True, attention_bias_on=_ATTENTION, windows="use_sliding_window",
           defaults={**_LLAMA_DEFAULTS, "head_dim": 128, "sliding_window": 4096, "max_window_layers": 28,
                     "max_position_embeddings": 32768}),
    Family("gemma2", **_GEMMA, window_pattern=2, attn_softcap=True, final_softcap=True,
           defaults={**_GEMMA_DEFAULTS, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    Family("gemma3_text", **_GEMMA, qk_norm=True, window_pattern=6, local_rope=True, final_softcap=True,
           defaults={**_GEMMA_DEFAULTS, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
                     "max_position_embeddings": 131072}),
    Family("gemma3", **_GEMMA, qk_norm=True, window_pattern=6, local_rope=True, text_config=True,
           checkpoint_prefix="language_model.", decoder_module="model.language_model",
           defaults={**_GEMMA_DEFAULTS, **_GEMMA3_TEXT_SIZES, "rope_theta": 1_000_000.0,
                     "rope_local_base_freq": 10000.0, "max_position_embeddings": 131072}),
)}


def family(model_type: str) -> Family:
    """The rules of `model_type`; a ValueError naming the supported ones for any other."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type: {model_type!r} is not supported; gapless supports {', '.join(FAMILIES)}")
    return FAMILIES[model_type]
