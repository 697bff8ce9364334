"""Model FLOPs of one training step, and MFU (model FLOPs utilization).

MFU = useful model FLOPs of the step / step time / peak FLOP/s of the device (PaLM, Chowdhery et al. 2022,
appendix B; nanoGPT's estimate_mfu). "Useful" means the FLOPs the method needs on the REAL tokens: padding,
recomputation (activation checkpointing) and masked-out attention tiles are work the hardware did, not work
the model needed, so a configuration that wastes them scores a lower MFU. The peak is measured, not a
datasheet figure: `gapless bench` times a dense 8192^3 bf16 matmul on the device (median of several) and
passes that rate here.

Counted, per token (N = the real tokens of the step = sum of the document lengths):

- A matmul of a [N, in] activation with an [out, in] weight is 2 * in * out FLOPs per token in the forward
  pass (a multiply and an add per weight). Its backward is two more matmuls of the same size: the activation
  gradient dX = dY @ W and the weight gradient dW = dY^T @ X, 2 * in * out each.
- LoRA (Hu et al. 2021): the base weights are frozen, so their weight gradient is never computed:
  4 FLOPs per token per frozen weight (forward + activation gradient), for every linear projection of every
  decoder layer and for the LM head. Each LoRA weight (A: r x in, B: out x r) trains: 6 per token
  (forward, activation gradient, weight gradient).
- Full fine-tuning: 6 per token per weight of the projections and the LM head (Kaplan et al. 2020's 6N).
- The embedding is a table lookup (no FLOPs); with tied embeddings the LM head matmul is still counted once.
- Attention scores, over each document separately (packed documents never attend to each other), per layer
  and per query head, with head dimension d: the forward is two matmuls, S = Q K^T and O = P V, each
  2 * d FLOPs per (query, key) pair it computes. Causal attention over a document of L tokens has
  L (L + 1) / 2 such pairs (query i sees keys 0..i; with a sliding window w, min(i + 1, w) of them), so
  forward = 2 matmuls * 2 * d * H_q * L (L + 1) / 2 per layer. The backward is 2.5x the forward
  (FlashAttention-2's convention, Dao 2023: five matmuls against the forward's two: S recomputed, dV = P^T dO,
  dP = dO V^T, dQ = dS K, dK = dS^T Q), so forward + backward = 3.5x the forward. Grouped-query attention
  shares K/V heads but every query head still does its own matmuls: H_q counts, H_kv does not.
  The same convention as shared/peers/limit.py, so MFU here and the peers' ceiling use one yardstick.
  Per-layer windows (Gemma: sliding and global layers alternate) are counted layer by layer.
- Not counted (the usual convention; all memory-bound): RMSNorm (Gemma's four per layer too), RoPE, the GLU's
  elementwise product, soft-capping's tanh, the embedding scale, residual adds, the softmax of the loss, the
  optimizer update.

Nominal, not executed: decoder layer 0's q/k/v projections read the normed embedding, which needs no gradient
when the embedding is frozen, so autograd skips their activation-gradient matmuls (2 * in * out per token for
each of the three frozen weights and their LoRA A; gate/up/down of layer 0 do need theirs, since the attention
output added to the residual carries LoRA's gradient). We count them anyway, as the 6N convention counts every
weight; for Llama-3.2-3B that is 0.24% of the matmul FLOPs (0.23% of a step on the shared mix, whose attention
adds 0.74 GFLOP per token to the matmuls' 13.0). tests/test_flops.py pins this difference exactly against
torch's FLOP counter.
"""
from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from gapless.config import ALL_LINEAR
from gapless.model.decoder import ModelArgs
from gapless.model.families import family

METHODS = ("lora", "full")


def projection_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear projection of one decoder layer, by HF name: those the family
    has (gapless.model.families)."""
    D, hd, I = args.hidden_size, args.head_dim, args.intermediate_size
    q, kv = args.num_attention_heads * hd, args.num_key_value_heads * hd
    shapes = {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D),
              "gate_proj": (D, I), "up_proj": (D, I), "down_proj": (I, D)}
    return {name: shapes[name] for name in family(args.model_type).projections}


def matmul_weights(args: ModelArgs) -> int:
    """Weights that take part in a matmul per token: every layer's projections plus the LM head (no embedding)."""
    per_layer = sum(i * o for i, o in projection_shapes(args).values())
    return args.num_hidden_layers * per_layer + args.vocab_size * args.hidden_size


def lora_weights(args: ModelArgs, r: int, targets: Iterable[str] = ALL_LINEAR) -> int:
    """LoRA's trainable weights: A (r x in) and B (out x r) for each targeted projection of each layer."""
    shapes = projection_shapes(args)
    targets = list(targets)
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"lora_targets: {unknown} are not projections of a decoder layer; choose among {list(shapes)}")
    return args.num_hidden_layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)


def causal_pairs(length: int, window: int | None = None) -> int:
    """(query, key) pairs causal attention computes over one document: sum over i of min(i + 1, window)."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    # the first `window` queries see 1..window keys, the remaining length - window see `window` each
    return window * (window + 1) // 2 + (length - window) * window


def attention_flops(args: ModelArgs, doc_lengths: Sequence[int]) -> float:
    """Forward + backward FLOPs of causal attention over the documents, all layers (3.5x the forward)."""
    per_pair = 2 * 2 * args.head_dim * args.num_attention_heads  # two matmuls, 2 * d each, every query head
    # layers that share a window share the sum: one pass over the documents per distinct window (the loop
    # calls this every step; Llama's 28 layers all have window None)
    forward = sum(n_layers * per_pair * sum(causal_pairs(int(L), w) for L in doc_lengths)
                  for w, n_layers in Counter(args.sliding_window).items())
    return 3.5 * forward


def step_flops(args: ModelArgs, doc_lengths: Sequence[int], method: str = "lora", lora_r: int = 16,
               lora_targets: Iterable[str] = ALL_LINEAR) -> float:
    """Useful FLOPs of one training step (forward + backward) over documents of these real lengths.

    lora:  N * (4 * matmul_weights + 6 * lora_weights) + attention
    full:  N * 6 * matmul_weights + attention
    N = sum(doc_lengths); padding is never in doc_lengths, so it is never counted.
    """
    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not one of {list(METHODS)}")
    n = sum(int(L) for L in doc_lengths)
    if method == "full":
        dense = 6 * matmul_weights(args)
    else:
        dense = 4 * matmul_weights(args) + 6 * lora_weights(args, lora_r, lora_targets)
    return float(n * dense) + attention_flops(args, doc_lengths)


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved useful FLOP/s over the device's peak FLOP/s (a fraction, not %)."""
    if seconds <= 0 or peak_flops <= 0:
        raise ValueError(f"mfu: seconds ({seconds}) and peak_flops ({peak_flops}) must be positive")
    return flops / seconds / peak_flops


def measure_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Dense matmul FLOP/s of this device in `dtype`: the median of 20 timed 8192^3 products on CUDA (512^3 on
    the CPU), after 10 warm-ups (enough to bring an idle GPU to its clocks: 15 ms of work). An H200 gives about
    790 TFLOP/s in bf16 (shared/peers/README.md); its datasheet's 989 is not reached by any real matmul."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda:
        with torch.cuda.device(device):  # the events below record on the current device's stream
            return _matmul_rate(device, dtype, 8192)
    return _matmul_rate(device, dtype, 512)


def _matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)  # random, not zeros: zeros run faster
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    for _ in range(10):
        torch.mm(a, b)
    times = []
    for _ in range(20):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.mm(a, b)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)
