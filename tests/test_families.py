"""The family table against transformers: its defaults are the config classes', its projections and biases are the
models' linear layers, and the FLOPs count reads the same weights; the Gemma 3 config forms read alike."""
import dataclasses

import pytest
import torch
from torch import nn

from gapless.config import ALL_LINEAR
from gapless.meter.flops import matmul_weights, projection_shapes
from gapless.model.decoder import CausalLM
from gapless.model.families import FAMILIES, family
from gapless.model.loading import model_args_from_config

TEXT_FAMILIES = [name for name, f in FAMILIES.items() if not f.text_config]
MINIMAL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
               num_key_value_heads=2)
# fields that shape no computation (special tokens)
UNUSED = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _hf_config(model_type: str, **config):
    import transformers

    return transformers.AutoConfig.for_model(model_type, **{**MINIMAL, **config})


@pytest.mark.parametrize("model_type", TEXT_FAMILIES)
def test_missing_fields_read_as_transformers_fills_them(model_type):
    """A config.json with only the sizes reads as the config transformers builds from it and saves."""
    ours = model_args_from_config({"model_type": model_type, **MINIMAL})
    saved = model_args_from_config(_hf_config(model_type).to_dict())
    assert dataclasses.replace(ours, **UNUSED) == dataclasses.replace(saved, **UNUSED)


@pytest.mark.parametrize("model_type", TEXT_FAMILIES)
@pytest.mark.parametrize("bias", [False, True])
def test_projections_biases_and_flops_are_the_models(model_type, bias):
    import transformers

    extra = {"attention_bias": bias, "mlp_bias": bias, "head_dim": 16}
    hf_config = _hf_config(model_type, **extra)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
        ours = CausalLM(model_args_from_config(hf_config.to_dict()))
    linears = {name: m for name, m in hf.named_modules() if isinstance(m, nn.Linear)}
    in_layer = {name.rsplit(".", 1)[-1]: m for name, m in linears.items() if name.startswith("model.layers.0.")}
    assert tuple(in_layer) == family(model_type).projections
    assert {n for n, m in in_layer.items() if m.bias is not None} == set(ours.args.biases)
    assert projection_shapes(ours.args) == {n: (m.in_features, m.out_features) for n, m in in_layer.items()}
    # FLOPs count every layer's projections and the head: transformers' own linear weights
    assert matmul_weights(ours.args) == sum(m.weight.numel() for m in linears.values())
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}


def test_all_linear_is_every_familys_projections():
    assert set().union(*(f.projections for f in FAMILIES.values())) == set(ALL_LINEAR)


def test_gemma3_config_forms_read_alike():
    """transformers 4.x (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern) and 5.x
    (rope_parameters per layer type, layer_types) forms of one Gemma 3 config."""
    legacy = {"model_type": "gemma3_text", **MINIMAL, "head_dim": 16, "sliding_window": 8, "rope_theta": 1e6,
              "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
              "sliding_window_pattern": 6}
    args = model_args_from_config(legacy)
    assert args.sliding_window == [8, 8, 8, 8, 8, None, 8] and args.local_rope_theta == 1e4
    assert (args.rope_theta, args.rope_scaling.rope_type, args.rope_scaling.factor) == (1e6, "linear", 8.0)
    saved = _hf_config(**{k: v for k, v in legacy.items() if k not in MINIMAL}).to_dict()
    assert isinstance(saved["rope_parameters"]["sliding_attention"], dict)  # really the 5.x form
    assert dataclasses.replace(model_args_from_config(saved), **UNUSED) == dataclasses.replace(args, **UNUSED)
    # the image-text form: the same decoder under text_config, the vision tower ignored with a warning
    with pytest.warns(UserWarning, match="vision tower"):
        nested = model_args_from_config({"model_type": "gemma3", "text_config": saved, "vision_config": {}})
    assert dataclasses.replace(nested, **UNUSED) == dataclasses.replace(args, model_type="gemma3", **UNUSED)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "gemma2", "hidden_activation": "silu"}, r"hidden_activation: 'silu' is not supported; the "
                                                            r"gemma2 family uses 'gelu_pytorch_tanh'"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention: bidir"),
    ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {}, "sliding_attention": {
        "rope_type": "linear", "factor": 2.0}}}, r"rope_parameters\.sliding_attention: the sliding layers' RoPE"),
    ({"model_type": "gemma3_text", "layer_types": ["sliding_attention"]}, "layer_types: expected 7 entries"),
    ({"model_type": "gemma3"}, "text_config: a gemma3 checkpoint keeps its decoder's fields here"),
    ({"model_type": "gemma3", "text_config": {"hidden_size": "64"}}, r"text_config\.hidden_size: expected a positive"),
    # a string id would match no token: generation would never stop at it
    ({"model_type": "llama", "eos_token_id": "</s>"},
     r"eos_token_id: expected a token id or a list of token ids \(e\.g\. \[128001, 128009\]\), got '</s>'"),
    ({"model_type": "llama", "eos_token_id": [128001, "128009"]}, r"eos_token_id: expected a token id or a list"),
    ({"model_type": "llama", "bos_token_id": [1]}, r"bos_token_id: expected a token id, got \[1\]"),
    ({"model_type": "gemma3", "text_config": {}, "pad_token_id": 1.5}, r"config\.json: pad_token_id: expected"),
])
def test_config_mistakes_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        model_args_from_config({**MINIMAL, **config} if config["model_type"] != "gemma3" else config)


def test_gemma3_image_text_context_left_out_is_the_config_classes():
    # google/gemma-3-4b-it's text_config names no max_position_embeddings: transformers reads 131,072, which the
    # max_seq_len warning and generation's limit compare against
    config = {"model_type": "gemma3", "text_config": {"hidden_size": 64, "intermediate_size": 96,
                                                      "num_hidden_layers": 7}}
    assert model_args_from_config(config).max_position_embeddings == 131072


def test_explicit_nulls_mean_none_as_in_transformers():
    """A null soft-cap or window is none (the config class keeps None); absent, the class default applies."""
    config = {"model_type": "gemma2", **MINIMAL, "attn_logit_softcapping": None, "final_logit_softcapping": None,
              "sliding_window": None}
    args = model_args_from_config(config)
    hf = _hf_config(**config)
    assert args.attn_softcap is hf.attn_logit_softcapping is None and args.final_softcap is None
    assert args.sliding_window == [None] * 7 and hf.sliding_window is None
    assert model_args_from_config({"model_type": "gemma2", **MINIMAL}).attn_softcap == 50.0


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("window", [None, 5, "absent"])
def test_qwen_windows_read_as_transformers_reads_them(model_type, window):
    """use_sliding_window with a null window is no window (it read as 4096 on the layers from max_window_layers)."""
    config = {"model_type": model_type, **MINIMAL, "use_sliding_window": True, "max_window_layers": 3,
              **({} if window == "absent" else {"sliding_window": window})}
    hf = _hf_config(**config)
    expected = [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    assert model_args_from_config(config).sliding_window == expected
    assert expected == [None] * 7 if window is None else expected[3:] == [hf.sliding_window] * 4


def test_softcaps_transformers_ignores_are_ignored_with_a_warning():
    with pytest.warns(UserWarning, match="attn_logit_softcapping=50.0 is ignored"):
        args = model_args_from_config({"model_type": "gemma3_text", **MINIMAL, "attn_logit_softcapping": 50.0})
    assert args.attn_softcap is None


def test_bench_gemma_3_4b_reads_as_transformers_reads_it():
    import json

    import transformers

    from gapless.model.loading import read_model_args

    args = read_model_args("bench/models/gemma-3-4b")
    raw = json.load(open("bench/models/gemma-3-4b/config.json"))
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    assert [None if t == "full_attention" else 1024 for t in hf.layer_types] == args.sliding_window
    assert args.sliding_window.count(None) == 5  # layers 5, 11, 17, 23, 29 are global: 5 sliding per global
    assert hf.rope_parameters["sliding_attention"]["rope_theta"] == args.local_rope_theta == 1e4
    assert (args.rope_theta, args.rope_scaling.rope_type, args.rope_scaling.factor) == (1e6, "linear", 8.0)
    # 3.88e9 weights in matmuls: 34 layers of 97.0M plus the 262208 x 2560 head (tied to the embedding)
    assert matmul_weights(args) == 34 * (2560 * (2048 + 1024 + 1024 + 2048) + 3 * 2560 * 10240) + 262208 * 2560


# google/gemma-3-4b-it's config.json as the hub has it (transformers 4.50 wrote it): its text_config holds only the
# fields that differ from Gemma3TextConfig's defaults, so the vocabulary, heads, KV heads and head_dim are absent
GEMMA_3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def test_gemma3_image_text_config_with_its_text_defaults_left_out():
    """The hub's Gemma 3 image-text configs leave the text config's default sizes out; transformers fills them in
    (it read as text_config.num_attention_heads: required field is missing)."""
    import transformers

    from gapless.model.loading import read_model_args

    with pytest.warns(UserWarning, match="vision tower"):
        args = model_args_from_config(GEMMA_3_4B_IT)
    hf = transformers.Gemma3Config(**GEMMA_3_4B_IT).text_config
    assert (args.vocab_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim) == (
        hf.vocab_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (262208, 8, 4, 256)
    with pytest.warns(UserWarning, match="vision tower"):
        saved = model_args_from_config(transformers.Gemma3Config(**GEMMA_3_4B_IT).to_dict())
    assert dataclasses.replace(args, **UNUSED) == dataclasses.replace(saved, **UNUSED)
    # the same decoder as bench/models/gemma-3-4b, the text-only form of this model
    assert dataclasses.replace(args, **UNUSED) == dataclasses.replace(
        read_model_args("bench/models/gemma-3-4b"), model_type="gemma3", **UNUSED)


def test_gemma3_image_text_special_tokens_fall_back_to_the_top_level():
    """google/gemma-3-4b-it keeps eos_token_id [1, 106] (<eos>, <end_of_turn>) at the top level and none in
    text_config: it was read as None, so generation stopped only at the tokenizer's eos and the known marks."""
    with pytest.warns(UserWarning, match="vision tower"):
        args = model_args_from_config(GEMMA_3_4B_IT)
    assert (args.eos_token_id, args.bos_token_id, args.pad_token_id) == ([1, 106], None, None)
    # text_config's own value wins where it has one
    config = {**GEMMA_3_4B_IT, "pad_token_id": 0,
              "text_config": {**GEMMA_3_4B_IT["text_config"], "eos_token_id": 1, "bos_token_id": 2}}
    with pytest.warns(UserWarning, match="vision tower"):
        args = model_args_from_config(config)
    assert (args.eos_token_id, args.bos_token_id, args.pad_token_id) == (1, 2, 0)
