"""The decoder against transformers' own models: padded batches, packed rows, every family and RoPE type."""
import dataclasses

import pytest
import torch
from torch.testing import assert_close

import gapless
from gapless.model.decoder import CausalLM, RopeScaling, RotaryEmbedding, positions_from_cu_seqlens, \
    set_attention_backend
from gapless.model.loading import model_args_from_config

TOL = dict(atol=1e-4, rtol=0)  # the bar: max abs diff <= 1e-4 in fp32

# name -> (model_type, config overrides on the tiny shape in conftest)
CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    # head_dim 16, theta 5e5 and an original context of 64 put wavelengths (6.3, 32, 167, ...) in all
    # three llama3 bands: kept (< 64 / 4), blended, interpolated (> 64 / 1)
    "llama-llama3": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0}}),
    # beta_slow 0.25 puts the ramp's upper end at dimension 2.02, so truncating it (to 3) matters
    "llama-yarn": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_slow": 0.25,
        "rope_theta": 10000.0}}),
    "qwen2": ("qwen2", {}),
    # the window on layer 1 only (max_window_layers=1), and shorter than the documents
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"head_dim": 24}),  # head_dim != hidden_size / heads (64 / 4)
    "mistral": ("mistral", {"sliding_window": 5}),
}


def _logits(hf, ids, **kw):
    with torch.no_grad():
        return hf(ids, **kw).logits


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_transformers(hf_checkpoint, case):
    model_type, config = CASES[case]
    hf, folder = hf_checkpoint(model_type, **config)
    ours = gapless.load_model(folder)
    assert set(ours.state_dict()) == set(hf.state_dict())
    V = ours.args.vocab_size
    g = torch.Generator().manual_seed(1)

    # padded batch, right padding: positions default to arange
    lengths = torch.tensor([12, 7, 3])
    ids = torch.randint(0, V, (3, 12), generator=g)
    mask = (torch.arange(12) < lengths[:, None]).long()
    real = mask.bool()
    with torch.no_grad():
        right = ours(ids, attention_mask=mask)
    assert_close(right[real], _logits(hf, ids, attention_mask=mask)[real], **TOL)

    # left padding: the caller passes positions, as transformers' generate does
    left_ids = torch.stack([row.roll(int(12 - n)) for row, n in zip(ids, lengths)])
    left_mask = mask.flip(-1)
    pos = (left_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        left = ours(left_ids, position_ids=pos, attention_mask=left_mask)
    assert_close(left[left_mask.bool()], _logits(hf, left_ids, attention_mask=left_mask, position_ids=pos)[
        left_mask.bool()], **TOL)
    assert_close(left[left_mask.bool()], right[real], **TOL)

    # packed: two rows of 12 holding documents of 5+7 and 4+6 tokens plus a 2-token tail
    docs = [torch.randint(0, V, (n,), generator=g) for n in (5, 7, 4, 6, 2)]
    packed = torch.cat(docs).view(2, 12)
    cu = torch.tensor([0, 5, 12, 16, 22, 24], dtype=torch.int32)
    with torch.no_grad():
        out = ours(packed, cu_seqlens=cu).view(24, V)
        for doc, s, e in zip(docs[:4], cu[:-2].tolist(), cu[1:-1].tolist()):
            alone = ours(doc[None])[0]
            assert_close(out[s:e], alone, **TOL)
            assert_close(out[s:e], _logits(hf, doc[None])[0], **TOL)

        # the feature under test must change the output, or the comparisons above prove nothing about it
        if ours.args.rope_scaling.rope_type != "default":
            ours.model.rotary_emb = RotaryEmbedding(dataclasses.replace(ours.args, rope_scaling=RopeScaling()))
            assert (ours(packed, cu_seqlens=cu).view(24, V) - out).abs().max() > 1e-3
        if any(ours.args.sliding_window):
            for layer in ours.model.layers:
                layer.self_attn.sliding_window = None
            assert (ours(packed, cu_seqlens=cu).view(24, V) - out).abs().max() > 1e-3


def test_positions_restart_at_each_document():
    cu = torch.tensor([0, 3, 7, 8], dtype=torch.int32)
    assert positions_from_cu_seqlens(cu, 2, 4).tolist() == [[0, 1, 2, 0], [1, 2, 3, 0]]


def test_hidden_states_lm_head_and_explicit_positions(hf_checkpoint):
    _, folder = hf_checkpoint("llama", tie_word_embeddings=True)
    ours = gapless.load_model(folder)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 3, 8, 16], dtype=torch.int32)
    seen = []  # RoPE is relative, so logits alone cannot show where positions restart: watch them
    ours.model.rotary_emb.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    with torch.no_grad():
        logits = ours(ids, cu_seqlens=cu)
        assert seen[0].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]]
        h = ours.hidden_states(ids, cu_seqlens=cu)
        explicit = ours(ids, position_ids=positions_from_cu_seqlens(cu, 2, 8), cu_seqlens=cu, max_seqlen=8)
    assert h.shape == (2, 8, 64)
    assert_close(ours.lm_head(h), logits, atol=0, rtol=0)
    assert_close(explicit, logits, atol=0, rtol=0)


def test_input_errors_and_backend_switch():
    args = model_args_from_config(dict(
        model_type="qwen3", vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    model = CausalLM(args)  # built directly, with torch's default init
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert model(ids).shape == (1, 4, 32)
    with pytest.raises(ValueError, match="int32"):
        model(ids, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="not both"):
        model(ids, cu_seqlens=torch.tensor([0, 4], dtype=torch.int32), attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(ids[0])
    with pytest.raises(ValueError, match="'nope'.*sdpa"):
        set_attention_backend(model, "nope")
    assert set_attention_backend(model, "sdpa") is model and model.attn_backend == "sdpa"
