"""The MFU formula against a hand count on a tiny config, and against torch's FLOP counter on a real step."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from gapless.config import LoraConfig
from gapless.meter.flops import (attention_flops, causal_pairs, lora_weights, matmul_weights, mfu,
                                 projection_shapes, step_flops)
from gapless.model.decoder import CausalLM, ModelArgs
from gapless.model.loading import read_model_args
from gapless.model.lora import apply_lora

# hidden 8, MLP 12, 2 query heads sharing 1 KV head of dim 4, vocab 10, 2 layers, tied head
TINY = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=True)


def test_hand_count_lora_full_window_and_targets():
    args = ModelArgs(**TINY)
    # per layer: q 8x8=64, k 8x4=32, v 32, o 64, gate 8x12=96, up 96, down 96 -> 480; 2 layers + head 10x8
    assert matmul_weights(args) == 2 * 480 + 80 == 1040
    # LoRA r=2: q 2*(8+8)=32, k 2*(8+4)=24, v 24, o 32, gate/up/down 2*(8+12)=40 each -> 232 per layer
    assert lora_weights(args, r=2) == 2 * 232 == 464
    # attention: 2 matmuls * 2 FLOPs * head_dim 4 * 2 query heads = 32 per (query, key) pair;
    # documents of 3 and 5 tokens have 6 + 15 = 21 causal pairs, 2 layers: forward 1344, x3.5 with backward
    assert attention_flops(args, [3, 5]) == 3.5 * 32 * 21 * 2 == 4704
    # N = 8 real tokens: 4 per frozen weight, 6 per LoRA weight
    assert step_flops(args, [3, 5], method="lora", lora_r=2) == 8 * (4 * 1040 + 6 * 464) + 4704 == 60256
    assert step_flops(args, [3, 5], method="full") == 8 * 6 * 1040 + 4704 == 54624
    # LoRA on two projections only: q 32 + down 40 per layer
    assert step_flops(args, [3, 5], lora_r=2, lora_targets=["q_proj", "down_proj"]) == 8 * (4160 + 6 * 144) + 4704
    # sliding window 2: a query sees at most 2 keys -> 1+2+2 and 1+2+2+2+2 pairs
    assert causal_pairs(3, 2) == 5 and causal_pairs(5, 2) == 9 and causal_pairs(5, 8) == 15
    windowed = ModelArgs(**TINY, sliding_window=[2, 2])
    assert attention_flops(windowed, [3, 5]) == 3.5 * 32 * 14 * 2
    # a padded batch: padding is not in the document lengths, so [3, 5] counts the same in any layout
    assert step_flops(args, [5, 3]) == step_flops(args, [3, 5])


def test_mfu_and_bad_inputs():
    assert mfu(3e12, 2.0, 1.5e12) == pytest.approx(1.0)
    assert mfu(1e12, 4.0, 1e12) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="seconds"):
        mfu(1e12, 0.0, 1e12)
    with pytest.raises(ValueError, match="method"):
        step_flops(ModelArgs(**TINY), [3], method="qlora")
    with pytest.raises(ValueError, match="lora_targets"):
        lora_weights(ModelArgs(**TINY), 2, ["lm_head"])


def test_matmul_weights_match_the_real_models_parameters():
    """Every linear weight of the built Llama-3.2-3B (on meta, no memory) is counted once, the tied head once."""
    args = read_model_args("bench/models/llama-3.2-3b")
    with torch.device("meta"):
        model = CausalLM(args)
    linear = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert matmul_weights(args) == sum(linear.values()) == 3_212_574_720
    assert projection_shapes(args)["k_proj"] == (3072, 1024)


def _count_matmul_flops(model, input_ids):
    """FLOPs of every matmul of one forward+backward (attention's SDPA kernel left out), by torch's counter."""
    targets = torch.roll(input_ids, -1, dims=1)
    with FlopCounterMode(display=False) as counter:
        logits = model(input_ids)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    counts = counter.get_flop_counts()["Global"]
    assert counts, "the FLOP counter saw no operation"
    return sum(v for op, v in counts.items() if "scaled_dot_product" not in str(op))


@pytest.mark.parametrize("method", ["full", "lora"])
def test_matmul_flops_match_torch_flop_counter(method):
    """A real CPU step of a tiny model, counted by torch.utils.flop_counter, against step_flops minus attention."""
    torch.manual_seed(0)
    args = ModelArgs(**{**TINY, "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, "head_dim": 8})
    model = CausalLM(args)
    r = 4
    if method == "lora":
        # concat, whose GEMMs do exactly the formula's work; the default concat_b also multiplies the zero blocks
        # of its block-diagonal B columns (R * sum(out) where the formula has sum(r_i * out_i)), work MFU does not
        # count as the model's
        model = apply_lora(model, LoraConfig(r=r, kernel="concat"))
    ids = torch.randint(0, args.vocab_size, (2, 6))  # two rows, one 6-token document each, no padding
    counted = _count_matmul_flops(model, ids)
    nominal = step_flops(args, [6, 6], method=method, lora_r=r) - attention_flops(args, [6, 6])
    if method == "full":
        assert counted == nominal
    else:
        # layer 0's q/k/v (and their LoRA A) read the frozen embedding's output, which needs no gradient: autograd
        # skips those activation-gradient matmuls, 2 * in * out per token each (see gapless.meter.flops); by hand:
        # q 16x16 + k 16x8 + v 16x8 = 512 frozen, A 4x16 three times = 192, over 12 tokens
        skipped = 12 * 2 * (512 + 192)
        assert counted == nominal - skipped
