"""Causal attention over packed rows, behind one signature, chosen explicitly by name.

Every backend computes the same function:

    attention(q, k, v, *, cu_seqlens, max_seqlen, attention_mask, sliding_window, scale) -> out
    q: [B, T, Hq, D]   k, v: [B, T, Hkv, D]   out: [B, T, Hq, D]     (Hq % Hkv == 0, GQA)

- `cu_seqlens` (int32 [docs + 1]) gives document offsets into the flattened B*T tokens, as
  flash-attention's varlen functions take it; the last entry is B*T (the unused tail of a packed
  row is its own segment). Documents never attend to each other and never cross a row.
- `attention_mask` ([B, T], 1 = real token, 0 = padding) is for padded batches (cu_seqlens None).
- `sliding_window` (Mistral): a query at position i sees keys j with i - window < j <= i.

"sdpa" is the plain-PyTorch reference that runs anywhere; the GPU backends are tested against it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def sdpa_reference(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor | None = None,
                   max_seqlen: int | None = None, attention_mask: Tensor | None = None,
                   sliding_window: int | None = None, scale: float | None = None) -> Tensor:
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    if Hq != Hkv:  # GQA: each KV head serves Hq // Hkv query heads
        k = k.repeat_interleave(Hq // Hkv, dim=2)
        v = v.repeat_interleave(Hq // Hkv, dim=2)
    if cu_seqlens is not None:
        # one document at a time: memory O(sum L^2) instead of O((B*T)^2) for a block-diagonal mask
        qf, kf, vf = (x.reshape(B * T, Hq, D) for x in (q, k, v))
        out = torch.empty_like(qf)
        bounds = cu_seqlens.tolist()  # host sync: this is the CPU reference, not the fast path
        for s, e in zip(bounds[:-1], bounds[1:]):
            if e > s:
                out[s:e] = _causal(qf[None, s:e], kf[None, s:e], vf[None, s:e], None, sliding_window, scale)[0]
        return out.view(B, T, Hq, D)
    return _causal(q, k, v, attention_mask, sliding_window, scale)


def _causal(q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor | None,
            sliding_window: int | None, scale: float | None) -> Tensor:
    T = q.shape[1]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    if attention_mask is None and sliding_window is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
        return out.transpose(1, 2)
    i = torch.arange(T, device=q.device)
    allowed = i[None, :] <= i[:, None]  # [Tq, Tk] causal
    if sliding_window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < sliding_window)
    mask = allowed[None, None]  # [1, 1, Tq, Tk]
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :]
        # a padding query with no visible key would give NaN; let it see itself (its output is unused)
        mask = mask | torch.eye(T, dtype=torch.bool, device=q.device)[None, None]
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


AttentionFn = Callable[..., Tensor]


def get_attention(name: str) -> AttentionFn:
    """The attention function for backend `name`; unknown names are a ValueError that lists the choices."""
    backends = _backends()
    if name not in backends:
        raise ValueError(f"attention backend {name!r} is not known; choose one of {sorted(backends)}")
    return backends[name]


def _backends() -> dict[str, AttentionFn]:
    return {"sdpa": sdpa_reference}
