"""Causal attention over packed rows, behind one signature, chosen explicitly by name.

Every backend computes the same function:

    attention(q, k, v, *, cu_seqlens, max_seqlen, attention_mask, sliding_window, scale, softcap) -> out
    q: [B, T, Hq, D]   k, v: [B, T, Hkv, D]   out: [B, T, Hq, D]     (Hq % Hkv == 0, GQA)

- `cu_seqlens` (int32 [docs + 1]) gives document offsets into the flattened B*T tokens, as
  flash-attention's varlen functions take it; the last entry is B*T (the unused tail of a packed
  row is its own segment). Documents never attend to each other and never cross a row.
- `attention_mask` ([B, T], 1 = real token, 0 = padding) is for padded batches (cu_seqlens None).
- `sliding_window` (Mistral, Gemma): a query at position i sees keys j with i - window < j <= i.
- `softcap` (Gemma 2): the scaled scores s become softcap * tanh(s / softcap) before the softmax. Backends that
  cannot (varlen: torch's varlen_attn has no such argument; fa4_op: not wired) refuse it naming "flex",
  which applies it as a score_mod inside its kernel; `auto` picks flex for a model that soft-caps.

"sdpa" is the plain-PyTorch reference that runs anywhere; the GPU backends are tested against it. The config's
default, `attn_backend: auto`, resolves once per run to a name (choose_backend): fa4_op where flash-attn-4 imports on
Hopper or Blackwell, varlen where it runs, flex for soft-capping models, sdpa elsewhere.

The GPU backends (CUDA, bf16/fp16 only; each refuses anything else with an error naming the fallback):
- "varlen": torch.nn.attention.varlen.varlen_attn, torch's own FlashAttention-2 varlen kernels, GQA native.
  Measured on the H200 at T=16384 (peers/README.md): 4.5 ms fwd+bwd per layer, 248 TFLOP/s.
- "flex": FlexAttention (torch.compile'd Triton kernels) with a document-causal block mask built from
  cu_seqlens; the mask is built once per batch (cached on the cu_seqlens tensor) and shared by all layers.
- "fa4_op": flash-attn-4 (flash_attn.cute, CuTe DSL SM90 kernels; 2.5 ms per layer, 455 TFLOP/s on the same
  shapes, peers/README.md) behind torch custom ops (`varlen_attention_op`): dynamo sees one opaque node with a
  shape-only fake implementation, so each compiled layer stays one graph. Tested on the CPU with a reference
  forward/backward through the same op plumbing (fullgraph compile) and on the H200 against the float32
  reference. With grouped LoRA it is the fastest measured: 449.7 ms per Llama-3.2-3B step against 479.9 for
  varlen (bench/RESULTS.md, s3-grouped2). A plain "fa4" backend, the same kernels called through flash-attn-4's
  Python (a graph break in each compiled layer: 476.5 against 473.1 ms for fa4_op, run s3-fa4op), was removed as
  superseded (issue shape).
Packed rows are flattened [B, T, H, D] -> [B*T, H, D]; cu_seqlens already indexes that flat axis.

Not registered: "cudnn". SDPA's cuDNN backend takes dense [B, H, T, D] rows, so packed documents would need
a block-diagonal [T, T] mask per row (O(T^2) memory, no skipping of masked tiles). The ragged route, SDPA on
nested jagged tensors, only reaches cuDNN through torch/nested/_internal/sdpa.py, which (torch 2.13) refuses
training with fewer KV heads than query heads ("do not support training with broadcasted NT inputs"), so
GQA would need K and V expanded 3x for Llama-3.2-3B, refuses zero-length segments, and prefers the same
FlashAttention-2 kernel that "varlen" calls; torch's own varlen_attn has a cuDNN path but it is switched off
(_should_use_cudnn returns False) and rejects GQA and windows. bench/kernels_gpu.py times that nested-tensor
route once as a probe, so this decision rests on a number.
"""
from __future__ import annotations

import functools
import inspect
import os
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def sdpa_reference(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor | None = None,
                   max_seqlen: int | None = None, attention_mask: Tensor | None = None,
                   sliding_window: int | None = None, scale: float | None = None,
                   softcap: float | None = None) -> Tensor:
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
                out[s:e] = _causal(qf[None, s:e], kf[None, s:e], vf[None, s:e], None, sliding_window, scale,
                                   softcap)[0]
        return out.view(B, T, Hq, D)
    return _causal(q, k, v, attention_mask, sliding_window, scale, softcap)


def _causal(q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor | None,
            sliding_window: int | None, scale: float | None, softcap: float | None) -> Tensor:
    T = q.shape[1]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    if attention_mask is None and sliding_window is None and softcap is None:
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
    if softcap is not None:  # SDPA has no hook between the scores and the softmax: the [B, H, T, T] scores, written out
        scores = qt @ kt.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
        scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ vt  # fp32 softmax, as HF's eager
        return out.transpose(1, 2)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


AttentionFn = Callable[..., Tensor]


def get_attention(name: str) -> AttentionFn:
    """The attention function for backend `name`.

    Unknown names are a ValueError that lists the choices; a known backend this installation cannot run
    (a missing package, a torch too old) is a RuntimeError that says why and which backend to pick instead.
    Each call builds a fresh function: "flex" keeps its block-mask cache inside it, not in this module.
    """
    backends = _backends()
    if name not in backends:
        raise ValueError(f"attention backend {name!r} is not known; choose one of {backend_names()}")
    return backends[name]()


def compiles_once(attn_fn: AttentionFn) -> bool:
    """Whether decoder layers compiled around attn_fn take any layout of packed documents without compiling again:
    the backends that are one op in the graph over cu_seqlens (varlen, fa4_op, any op_attention). sdpa's reference
    loops over the documents in Python, a graph per document count; flex builds a block mask per batch."""
    return getattr(attn_fn, "compiles_once", False)


def compiles_at_first_call(attn_fn: AttentionFn) -> bool:
    """Whether attn_fn's kernels are compiled when a layout is first met and kept in a disk cache (flash-attn-4's CuTe
    DSL kernels, about 10 s of a cold start on an H100, run s19-startup2; its cache on, as gapless asks unless the
    user turned it off), so a first call made in another process beforehand pays (gapless.train.warm_attention):
    those backends name that folder as their `kernel_cache`."""
    return getattr(attn_fn, "kernel_cache", None) is not None


def wait_before_first_call(attn_fn: AttentionFn, wait: Callable[[], None]) -> None:
    """Have attn_fn's kernels call wait() once, before their next call runs (forward or backward, whichever comes
    first): gapless.train.warm_attention's process compiles them meanwhile, and this one then loads what it wrote
    to the backend's disk cache instead of compiling the same kernels beside it. The wait runs inside the registered
    op (varlen_attention_op), where torch.compile's graphs call it at run time, not while tracing."""
    attn_fn.first_call_waits.append(wait)


def warm_kernels(attn_fn: AttentionFn, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                 layers: Iterable[tuple[int | None, float]], generator: torch.Generator | None = None) -> int:
    """One eager forward and backward of attn_fn per distinct (sliding window, scale) of `layers` (window None:
    plain causal) on q [B, T, Hq, D], k, v [B, T, Hkv, D] laid out as cu_seqlens: what compiles at a first call
    compiles here, and the model's own calls with the same dtype, heads and window then find it in the backend's
    cache. The output gradient is drawn from `generator` (the global RNG stays as it was). Returns the number of
    calls made."""
    distinct = list(dict.fromkeys(layers))
    for window, scale in distinct:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = attn_fn(*leaves, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, sliding_window=window, scale=scale)
        out.backward(torch.randn(out.shape, dtype=out.dtype, device=out.device, generator=generator))
    return len(distinct)


def backend_names() -> list[str]:
    return sorted(_backends())


def auto_backend(device: torch.device, dtype: torch.dtype, packed: bool, softcap: bool = False,
                 head_dim: int | None = None) -> str:
    """What `attn_backend: auto` runs (choose_backend says why)."""
    return choose_backend(device, dtype, packed, softcap, head_dim)[0]


def choose_backend(device: torch.device, dtype: torch.dtype, packed: bool, softcap: bool = False,
                   head_dim: int | None = None) -> tuple[str, str]:
    """(backend, why) for `attn_backend: auto`, the fastest measured that runs here:
    - "fa4_op" (flash-attn-4 as torch custom ops) on a Hopper or Blackwell GPU (compute capability 9.x/10.x, the
      architectures of its CuTe DSL kernels) where flash-attn-4 imports, with head_dim <= 128 (measured on Llama's
      128: 449.7 against 479.9 ms per Llama-3.2-3B step for varlen, bench/RESULTS.md run s3-grouped2);
    - "varlen" (torch's FlashAttention-2 kernels) on a CUDA GPU of compute capability 8.0 or newer;
    - both in bf16/fp16 with packed rows; "sdpa" anywhere else (the CPU, float32, padded rows with a mask).
    `softcap`: the model soft-caps its attention scores (Gemma 2: args.attn_softcap), which neither fa4 nor varlen
    can; there "flex" runs instead."""
    if device.type != "cuda":
        return "sdpa", f"{device.type}: the plain-PyTorch reference"
    if not packed or dtype not in (torch.bfloat16, torch.float16):
        return "sdpa", "padded rows or float32: the fused kernels need packed rows in bf16/fp16"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 0):
        return "sdpa", f"compute capability {capability[0]}.{capability[1]} has no FlashAttention kernels"
    if softcap:
        return "flex", "the model soft-caps attention scores, which only flex (and sdpa) compute"
    if capability[0] in (9, 10) and (head_dim is None or head_dim <= 128):
        try:
            _fa4_op_backend()
            return "fa4_op", "flash-attn-4 imports and runs on this GPU: the fastest measured"
        except RuntimeError as e:
            reason = _fa4_unavailable(e)
    else:
        reason = f"flash-attn-4 is not used for compute capability {capability[0]}.{capability[1]}" + (
            f" or head_dim {head_dim}" if head_dim and head_dim > 128 else "")
    try:
        _varlen_backend()  # its own check that this torch has varlen_attn
    except RuntimeError:
        return "sdpa", f"{reason}, and this torch has no varlen_attn"
    return "varlen", reason


def _fa4_unavailable(error: RuntimeError) -> str:
    """Why fa4_op cannot run, from _fa4_op_backend's error: flash-attn-4 absent, or present but failing to import
    (a dependency missing or broken). Session 22's carried flash-attn-4 lacked quack-kernels, which
    flash_attn.cute.interface imports, and auto's line said "not installed"."""
    cause = error.__cause__
    if isinstance(cause, ModuleNotFoundError) and cause.name in ("flash_attn", "flash_attn.cute",
                                                                 "flash_attn.cute.interface"):
        return "flash-attn-4 is not installed (pip install 'gapless[gpu]' where its wheels exist)"
    return f"flash-attn-4 is installed but does not import here ({type(cause).__name__}: {cause})"


def _backends() -> dict[str, Callable[[], AttentionFn]]:
    return {"sdpa": lambda: sdpa_reference, "varlen": _varlen_backend, "flex": FlexAttention, "fa4_op": _fa4_op_backend}


def _segments(q: Tensor, cu_seqlens: Tensor | None, max_seqlen: int | None, attention_mask: Tensor | None,
              name: str) -> tuple[Tensor, int]:
    """(cu_seqlens, max_seqlen) over the flattened B*T tokens, without a host sync."""
    B, T = q.shape[:2]
    if attention_mask is not None:
        raise ValueError(f"attention backend {name!r} takes packed rows (cu_seqlens), not attention_mask; "
                         "describe padded rows as segments in cu_seqlens, or choose 'sdpa'")
    if cu_seqlens is None:  # unpadded rows: each row is one causal document, offsets 0, T, 2T, ..., B*T
        return torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device), T
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor, got {cu_seqlens.dtype} of shape "
                         f"{tuple(cu_seqlens.shape)}")
    if max_seqlen is None:
        raise ValueError(f"attention backend {name!r} needs max_seqlen (the longest segment, a host int the "
                         "batch carries): reading it off cu_seqlens here would sync the host every layer")
    if isinstance(max_seqlen, Tensor):
        raise ValueError("max_seqlen must be a host int: a tensor here would sync the host every layer")
    return cu_seqlens, max_seqlen


def _flat_packed(name: str, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | None, max_seqlen: int | None,
                 attention_mask: Tensor | None, sliding_window: int | None, softcap: float | None,
                 cuda_fallback: str | None) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """The checks every varlen-style backend makes, in one place, and its inputs flattened for a varlen kernel:
    (q [B*T, Hq, D], k, v [B*T, Hkv, D], cu_seqlens, max_seqlen). `cuda_fallback`: the backend runs CUDA bf16/fp16
    only, and anything else is refused naming that backend (None: it runs anywhere)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    cu, max_len = _segments(q, cu_seqlens, max_seqlen, attention_mask, name)
    _refuse_softcap(name, softcap)  # before the device check: no device runs it here
    if cuda_fallback is not None:
        _check_cuda_half(name, cuda_fallback, q, k, v)
    _check_window(sliding_window)
    return q.reshape(B * T, Hq, D), k.reshape(B * T, Hkv, D), v.reshape(B * T, Hkv, D), cu, max_len


def _check_cuda_half(name: str, fallback: str, *tensors: Tensor) -> None:
    for t in tensors:
        if not t.is_cuda or t.dtype not in (torch.bfloat16, torch.float16):
            raise RuntimeError(f"attention backend {name!r} runs CUDA bf16/fp16 tensors only, got {t.dtype} on "
                               f"{t.device}; choose {fallback!r}")


def _refuse_softcap(name: str, softcap: float | None) -> None:
    if softcap is not None:
        raise RuntimeError(f"attention backend {name!r} cannot soft-cap attention scores (softcap={softcap}, Gemma 2's "
                           "attn_logit_softcapping); choose 'flex' (on a GPU) or 'sdpa'")


def _check_window(sliding_window: int | None) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (a query sees itself and window-1 keys before it), "
                         f"got {sliding_window}")


# flash attention's varlen kernels put the documents on the grid's y axis, which CUDA caps at 65,535: one call with
# more (a huge micro-batch of short documents) fails with "CUDA error: invalid argument" (seen on the H200 in the batch
# finder's trial of a tiny model at max_seq_len 64, session 14)
MAX_VARLEN_DOCUMENTS = 65_535


def _varlen_backend() -> AttentionFn:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        raise RuntimeError(f"attention backend 'varlen' needs torch.nn.attention.varlen (torch >= 2.10); torch "
                           f"{torch.__version__} lacks it ({e}); choose 'sdpa'") from e
    params = inspect.signature(varlen_attn).parameters
    # the signature moved between releases: 2.10 took is_causal, 2.11 window_size=(left, right) and GQA
    # without a flag, 2.13 window_size and enable_gqa=True (it raises on Hq != Hkv without it)
    has_window = "window_size" in params
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}

    def varlen(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor | None = None, max_seqlen: int | None = None,
               attention_mask: Tensor | None = None, sliding_window: int | None = None,
               scale: float | None = None, softcap: float | None = None) -> Tensor:
        q2, k2, v2, cu, max_len = _flat_packed("varlen", q, k, v, cu_seqlens, max_seqlen, attention_mask,
                                               sliding_window, softcap, "sdpa")
        if cu.shape[0] - 1 > MAX_VARLEN_DOCUMENTS:  # a shape, no sync
            raise ValueError(f"attention backend 'varlen': {cu.shape[0] - 1:,} documents in one micro-batch, over "
                             f"the {MAX_VARLEN_DOCUMENTS:,} flash attention launches at once; lower "
                             "data.tokens_per_batch (train.grad_accum keeps a step's tokens) or choose 'flex'")
        if sliding_window is None:
            # a tuple: varlen_attn tests `window_size == (-1, 0)` to pick its causal kernel
            mode: dict[str, Any] = {"window_size": (-1, 0)} if has_window else {"is_causal": True}
        elif has_window:
            mode = {"window_size": (sliding_window - 1, 0)}  # i - window < j <= i: window-1 keys to the left
        else:
            raise RuntimeError(f"torch {torch.__version__}'s varlen_attn has no window_size, so 'varlen' cannot "
                               "run sliding_window; choose 'flex' or 'sdpa'")
        if scale is not None:
            if "scale" not in params:
                raise RuntimeError(f"torch {torch.__version__}'s varlen_attn takes no scale; choose 'flex' or 'sdpa'")
            mode["scale"] = scale
        out = varlen_attn(q2, k2, v2, cu, cu, max_len, max_len, **mode, **gqa)
        return out.view(q.shape)

    varlen.compiles_once = True  # one op over cu_seqlens (compiles_once)
    return varlen


def _fa4_missing(name: str, e: Exception) -> RuntimeError:
    return RuntimeError(f"attention backend {name!r} needs flash-attn-4 (flash_attn.cute with nvidia-cutlass-dsl), "
                        f"which is not importable here ({e}); install it (shared/peers/README.md says how) or "
                        "choose 'varlen'")


class FlexAttention:
    """Document-causal attention through FlexAttention, with the block mask built from cu_seqlens.

    All B*T tokens are treated as one flat sequence [1, H, B*T, D]; token i belongs to document
    doc[i] = #{cu_seqlens[1:] <= i}, and (q, kv) is allowed iff doc[q] == doc[kv] and kv <= q
    (and q - kv < sliding_window). Documents never cross rows, so rows need no mask of their own.

    The block mask depends only on cu_seqlens, so it is built once per batch and reused by every layer:
    the cache holds the last one per window (Gemma alternates windowed and global layers: with one entry every
    layer would rebuild it), keyed on the cu_seqlens tensor object (and its in-place version counter).
    Building it is a per-batch cost (a [B*T/128]^2 block scan; bench/kernels_gpu.py prints it); on CUDA it
    goes through torch.compile(create_block_mask) so the dense [B*T, B*T] mask is never materialised.
    `compiled=False` runs flex_attention eagerly: a reference-speed path (it materialises the scores) that
    works on the CPU for the forward only (torch 2.13 has no CPU backward for FlexAttention).
    When the whole model is compiled, the mask build is a graph break (torch.compiler.disable).
    """

    def __init__(self, compiled: bool = True) -> None:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError as e:
            raise RuntimeError(f"attention backend 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5); "
                               f"torch {torch.__version__} lacks it ({e}); choose 'sdpa'") from e
        self.compiled = compiled
        self._flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
        self._create_eager = create_block_mask
        self._create_compiled = torch.compile(create_block_mask) if compiled else None
        self._cache: dict[int | None, tuple[tuple, weakref.ref | None, Any]] = {}  # sliding_window -> last mask

    @torch.compiler.disable
    def block_mask(self, cu_seqlens: Tensor | None, batch: int, seq: int, sliding_window: int | None,
                   device: torch.device) -> Any:
        """The BlockMask for these segments (cached: the same cu_seqlens tensor gives the same object)."""
        n = batch * seq
        if cu_seqlens is None:
            key: tuple = ("rows", batch, seq, sliding_window, str(device))
        else:
            key = ("cu", id(cu_seqlens), cu_seqlens._version, n, sliding_window, str(device))
        if sliding_window in self._cache:
            ckey, cref, cmask = self._cache[sliding_window]
            if ckey == key and (cref is None or cref() is cu_seqlens):
                return cmask
        idx = torch.arange(n, device=device, dtype=torch.int32)
        if cu_seqlens is None:
            doc = idx // seq
        else:
            doc = torch.searchsorted(cu_seqlens[1:].to(device), idx, right=True)  # [n] document id per token

        def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            allowed = (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
            if sliding_window is not None:
                allowed = allowed & (q_idx - kv_idx < sliding_window)
            return allowed

        create = self._create_compiled if (self._create_compiled is not None and device.type == "cuda") \
            else self._create_eager
        mask = create(document_causal, None, None, n, n, device=device)
        self._cache[sliding_window] = (key, None if cu_seqlens is None else weakref.ref(cu_seqlens), mask)
        return mask

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor | None = None,
                 max_seqlen: int | None = None, attention_mask: Tensor | None = None,
                 sliding_window: int | None = None, scale: float | None = None,
                 softcap: float | None = None) -> Tensor:
        B, T, Hq, D = q.shape
        Hkv = k.shape[2]
        if attention_mask is not None:
            raise ValueError("attention backend 'flex' takes packed rows (cu_seqlens), not attention_mask; "
                             "describe padded rows as segments in cu_seqlens, or choose 'sdpa'")
        if cu_seqlens is not None and (cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1):
            raise ValueError(f"cu_seqlens must be a 1-D int32 tensor, got {cu_seqlens.dtype} of shape "
                             f"{tuple(cu_seqlens.shape)}")
        if self.compiled:
            _check_cuda_half("flex", "sdpa", q, k, v)
        _check_window(sliding_window)
        mask = self.block_mask(cu_seqlens, B, T, sliding_window, q.device)
        # [B, T, H, D] -> [1, H, B*T, D]: one flat sequence, heads second as flex_attention takes them
        qf, kf, vf = (x.reshape(1, B * T, x.shape[2], D).transpose(1, 2) for x in (q, k, v))
        out = self._flex(qf, kf, vf, score_mod=_softcap_mod(softcap), block_mask=mask, scale=scale,
                         enable_gqa=Hq != Hkv)
        return out.transpose(1, 2).reshape(B, T, Hq, D)


@functools.cache
def _softcap_mod(softcap: float | None) -> Callable | None:
    """FlexAttention's score_mod for tanh soft-capping (applied to the scaled score, inside the kernel; its
    gradient, 1 - tanh^2, is derived by flex's backward); one function object per cap, so compiled graphs keep
    their guards (a fresh closure every layer would recompile)."""
    if softcap is None:
        return None

    def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.tanh(score / softcap) * softcap

    return mod


# ---------------------------------------------------------------------------------------------
# varlen attention kernels as torch custom ops (no graph break inside torch.compile)


VarlenForward = Callable[[Tensor, Tensor, Tensor, Tensor, int, float, int], tuple[Tensor, Tensor]]
VarlenBackward = Callable[..., tuple[Tensor, Tensor, Tensor]]
_OPS: dict[str, Callable] = {}  # op name -> registered forward op: torch's op registry is process-wide


def varlen_attention_op(name: str, forward: VarlenForward, backward: VarlenBackward) -> Callable:
    """Register a varlen causal attention kernel pair as torch custom ops `gapless::{name}_fwd`/`_bwd` with
    autograd; returns the forward op (calling it again with the same name returns the registered one).

        forward(q, k, v, cu_seqlens, max_seqlen, scale, window_left) -> (out, lse)
        backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, window_left) -> (dq, dk, dv)

    q [N, Hq, D], k/v [N, Hkv, D] (N = B*T flattened, GQA), cu_seqlens int32 [docs + 1], max_seqlen a host int,
    scale the softmax scale, window_left -1 (plain causal) or the keys a query sees to its left (sliding window);
    out [N, Hq, D], lse [Hq, N] float32 (log-sum-exp of each query's scaled scores; flash-attention's layout).
    The fakes below give torch.compile the shapes without running the kernel.
    """
    op_name = f"gapless::{name}_fwd"
    if op_name in _OPS:
        return _OPS[op_name]

    waits: list[Callable[[], None]] = []  # run before the next call, once each (wait_before_first_call)

    def run_waits() -> None:
        while waits:
            waits.pop(0)()

    @torch.library.custom_op(op_name, mutates_args=())
    def fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float,
            window_left: int) -> tuple[Tensor, Tensor]:
        run_waits()
        return forward(q, k, v, cu_seqlens, max_seqlen, scale, window_left)

    @fwd.register_fake
    def _(q, k, v, cu_seqlens, max_seqlen, scale, window_left):
        return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)

    @torch.library.custom_op(f"gapless::{name}_bwd", mutates_args=())
    def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
            max_seqlen: int, scale: float, window_left: int) -> tuple[Tensor, Tensor, Tensor]:
        run_waits()
        return backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, window_left)

    @bwd.register_fake
    def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, window_left):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, cu_seqlens, max_seqlen, scale, window_left = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_seqlen, ctx.scale, ctx.window_left = max_seqlen, scale, window_left

    def backward_rule(ctx, dout, dlse):
        # lse is an output for the backward kernel only; a loss never depends on it, so dlse is unused
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale,
                         ctx.window_left)
        return dq, dk, dv, None, None, None, None

    fwd.register_autograd(backward_rule, setup_context=setup_context)
    fwd.first_call_waits = waits
    _OPS[op_name] = fwd
    return fwd


# flash-attn-4 compiles its CuTe DSL kernels when a shape is first met and keeps them on disk only when asked
# (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1, read when flash_attn.cute.cache_utils is imported): a warm start-up of
# the example 3B config on the H200 spent 7.1 s of its 12.3 s first step outside inductor's compile (run s14-startup).
# gapless asks for that cache beside inductor's (gapless.train.compile), unless the user set either variable.
FA4_CACHE = Path("~/.cache/gapless/compile/flash_attn_cute")


def fa4_disk_cache() -> Path | None:
    """Turn flash-attn-4's on-disk kernel cache on (before it is imported) unless the user chose; its folder or
    None when off."""
    if os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1") != "1":
        return None
    return Path(os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(FA4_CACHE.expanduser())))


def _fa4_op_backend() -> AttentionFn:
    disk_cache = fa4_disk_cache()
    try:  # flash-attn-4's own forward and backward entry points (what its FlashAttnVarlenFunc calls)
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    except ImportError as e:
        raise _fa4_missing("fa4_op", e) from e

    def window(window_left: int) -> tuple[int | None, int | None]:
        return (None, None) if window_left < 0 else (window_left, 0)

    def forward(q, k, v, cu, max_seqlen, scale, window_left):
        left, right = window(window_left)
        out, lse = _flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                                   max_seqlen_k=max_seqlen, softmax_scale=scale, causal=True,
                                   window_size_left=left, window_size_right=right, return_lse=True)[:2]
        return out, lse

    def backward(dout, q, k, v, out, lse, cu, max_seqlen, scale, window_left):
        left, right = window(window_left)
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse, scale, True, 0.0, window_size_left=left,
                                     window_size_right=right, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)[:3]
        return dq, dk, dv

    attention = op_attention("fa4_op", varlen_attention_op("fa4_varlen", forward, backward), cuda_fallback="varlen")
    # where its CuTe DSL kernels are kept once compiled at a first call (compiles_at_first_call; None: the user turned
    # the cache off, and a second process's compile would not reach this one)
    attention.kernel_cache = disk_cache
    return attention


def op_attention(name: str, op: Callable, cuda_fallback: str | None = None) -> AttentionFn:
    """The backend signature over a registered varlen op (see varlen_attention_op). `cuda_fallback`: the op runs
    CUDA half tensors only; anything else is refused with an error naming that backend."""

    def attention(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor | None = None,
                  max_seqlen: int | None = None, attention_mask: Tensor | None = None,
                  sliding_window: int | None = None, scale: float | None = None,
                  softcap: float | None = None) -> Tensor:
        q2, k2, v2, cu, max_len = _flat_packed(name, q, k, v, cu_seqlens, max_seqlen, attention_mask,
                                               sliding_window, softcap, cuda_fallback)
        out, _ = op(q2, k2, v2, cu, max_len, q.shape[-1] ** -0.5 if scale is None else scale,
                    -1 if sliding_window is None else sliding_window - 1)
        return out.view(q.shape)

    attention.compiles_once = True  # one op over cu_seqlens (compiles_once)
    if hasattr(op, "first_call_waits"):  # a varlen_attention_op's own list (wait_before_first_call)
        attention.first_call_waits = op.first_call_waits
    return attention
