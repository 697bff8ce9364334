"""Attention backends against sdpa_reference.

CPU: the registry's errors, and FlexAttention's forward run eagerly in float32 (torch 2.13 has no CPU
backward for FlexAttention), to 1e-5 relative. CUDA (marked gpu): every backend in bf16, forward and
backward, against the reference run in float32 on the same inputs upcast; bf16 operands land between 1e-3
and 1e-2 relative (‖out − ref‖ / ‖ref‖), so the bound is 1e-2 for the output and 2e-2 for the gradients
(dk and dv sum over every query of a document and a GQA group).
"""
import os

import pytest
import torch

from gapless.kernels.attention import FlexAttention, get_attention, op_attention, sdpa_reference, varlen_attention_op

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def packed(lengths_per_row, T, Hq, Hkv, D, device="cpu", dtype=torch.float32, seed=0):
    """q, k, v [B, T, H, D] and cu_seqlens over B*T; each row's unused tail is its own segment."""
    g = torch.Generator().manual_seed(seed)
    offsets, max_len = [0], 0
    for row in lengths_per_row:
        assert sum(row) <= T
        for n in list(row) + ([T - sum(row)] if sum(row) < T else []):
            offsets.append(offsets[-1] + n)
            max_len = max(max_len, n)
    B = len(lengths_per_row)
    q, k, v = (torch.randn(B, T, h, D, generator=g).to(device, dtype) for h in (Hq, Hkv, Hkv))
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    return q, k, v, cu, max_len


def test_unknown_backend_lists_choices():
    with pytest.raises(ValueError, match="flex.*sdpa.*varlen"):
        get_attention("flash9")


def test_sdpa_is_the_reference():
    assert get_attention("sdpa") is sdpa_reference


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_backends_refuse_cpu_tensors_and_name_the_fallback():
    q, k, v, cu, m = packed([[5, 11]], 16, 4, 2, 8)
    with pytest.raises(RuntimeError, match="'sdpa'"):
        get_attention("varlen")(q, k, v, cu_seqlens=cu, max_seqlen=m)
    with pytest.raises(RuntimeError, match="'sdpa'"):
        get_attention("flex")(q, k, v, cu_seqlens=cu, max_seqlen=m)


def test_fa4_unavailable_names_varlen():
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        for name in ("fa4_op",):
            with pytest.raises(RuntimeError, match=f"'{name}' needs flash-attn-4.*'varlen'"):
                get_attention(name)
    else:
        pytest.skip("flash-attn-4 is installed here")


def test_packed_backends_refuse_attention_mask_and_missing_max_seqlen():
    q, k, v, cu, m = packed([[5, 11]], 16, 4, 2, 8)
    mask = torch.ones(1, 16)
    with pytest.raises(ValueError, match="attention_mask"):
        FlexAttention(compiled=False)(q, k, v, attention_mask=mask)
    with pytest.raises(ValueError, match="max_seqlen"):
        get_attention("varlen")(q, k, v, cu_seqlens=cu)
    with pytest.raises(ValueError, match="int32"):
        FlexAttention(compiled=False)(q, k, v, cu_seqlens=cu.long(), max_seqlen=m)


@pytest.mark.parametrize("window", [None, 7])
def test_flex_forward_matches_reference_cpu(window):
    # two rows of 160 (> one 128-token block); documents of 1, 2, 130 tokens; tails as their own segments
    q, k, v, cu, m = packed([[1, 130, 2, 20], [100, 3]], 160, 4, 2, 16)
    out = FlexAttention(compiled=False)(q, k, v, cu_seqlens=cu, max_seqlen=m, sliding_window=window)
    ref = sdpa_reference(q, k, v, cu_seqlens=cu, max_seqlen=m, sliding_window=window)
    assert out.shape == ref.shape
    assert rel(out, ref) < 1e-5


def test_flex_rows_without_cu_seqlens_are_causal_rows():
    q, k, v, _, _ = packed([[], []], 40, 2, 2, 8)
    out = FlexAttention(compiled=False)(q, k, v, scale=0.3)
    ref = sdpa_reference(q, k, v, scale=0.3)
    assert rel(out, ref) < 1e-5


def test_flex_block_mask_is_cached_per_batch():
    flex = FlexAttention(compiled=False)
    _, _, _, cu, _ = packed([[3, 9]], 16, 2, 2, 8)
    dev = torch.device("cpu")
    first = flex.block_mask(cu, 1, 16, None, dev)
    assert flex.block_mask(cu, 1, 16, None, dev) is first  # every layer of one batch: built once
    assert flex.block_mask(cu.clone(), 1, 16, None, dev) is not first  # the next batch: rebuilt
    cu2 = cu.clone()
    m2 = flex.block_mask(cu2, 1, 16, None, dev)
    cu2[1] = 4  # edited in place: the version counter moves, so the mask is rebuilt
    assert flex.block_mask(cu2, 1, 16, None, dev) is not m2
    assert flex.block_mask(cu2, 1, 16, 4, dev) is not flex.block_mask(cu2, 1, 16, None, dev)


# ---------------------------------------------------------------- CUDA


def _backend_or_skip(name):
    try:
        return get_attention(name)
    except RuntimeError as e:
        pytest.skip(str(e))


def _fwd_bwd(fn, q, k, v, g, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, **kw)
    out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("window,scale", [(None, None), (64, None), (None, 0.05)])
@pytest.mark.parametrize("name", ["varlen", "flex", "fa4_op"])
def test_backend_matches_reference_cuda_bf16(name, window, scale):
    fn = _backend_or_skip(name)
    rows = [[1, 700, 37, 129, 300, 2], [1024, 5, 900]]  # 2 rows of T=2048, Llama head dim, GQA 4:1
    q, k, v, cu, m = packed(rows, 2048, 8, 2, 128, device="cuda", dtype=torch.bfloat16, seed=1)
    g = torch.randn_like(q)
    kw = dict(cu_seqlens=cu, max_seqlen=m, sliding_window=window, scale=scale)
    got = _fwd_bwd(fn, q, k, v, g, **kw)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):  # plain float32 matmuls for the reference
        ref = _fwd_bwd(sdpa_reference, q.float(), k.float(), v.float(), g.float(), **kw)
    for name_, a, b, tol in zip(("out", "dq", "dk", "dv"), got, ref, (1e-2, 2e-2, 2e-2, 2e-2)):
        assert a.dtype == torch.bfloat16 and torch.isfinite(a).all(), name_
        assert rel(a, b) < tol, (name_, rel(a, b))


# ---------------------------------------------------------------------------------------------
# varlen kernels as torch custom ops: the plumbing (fake shapes, autograd, no graph break), tested with a
# float32 reference kernel pair written as flash-attention's forward (out, lse) and backward (from lse)


def _doc_scores(q, k, s, e, scale, window_left):
    """Scaled, masked scores of one document: [Hq, L, L], and K/V's head expansion factor."""
    g = q.shape[1] // k.shape[1]
    qs = q[s:e].transpose(0, 1)  # [Hq, L, D]
    ks = k[s:e].repeat_interleave(g, dim=1).transpose(0, 1)
    i = torch.arange(e - s)
    allowed = i[None, :] <= i[:, None]
    if window_left >= 0:
        allowed = allowed & (i[:, None] - i[None, :] <= window_left)
    return (qs @ ks.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf")), qs, ks, g


def reference_forward(q, k, v, cu, max_seqlen, scale, window_left):
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        S, _, _, g = _doc_scores(q, k, s, e, scale, window_left)
        lse[:, s:e] = torch.logsumexp(S, dim=-1)
        vs = v[s:e].repeat_interleave(g, dim=1).transpose(0, 1)
        out[s:e] = (torch.exp(S - lse[:, s:e, None]) @ vs).transpose(0, 1)
    return out, lse


def reference_backward(dout, q, k, v, out, lse, cu, max_seqlen, scale, window_left):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        S, qs, ks, g = _doc_scores(q, k, s, e, scale, window_left)
        vs = v[s:e].repeat_interleave(g, dim=1).transpose(0, 1)
        P = torch.exp(S - lse[:, s:e, None])  # [Hq, L, L]
        do, o = dout[s:e].transpose(0, 1), out[s:e].transpose(0, 1)
        dS = P * (do @ vs.transpose(1, 2) - (do * o).sum(-1, keepdim=True))
        L, Hkv, D = e - s, k.shape[1], k.shape[2]
        dq[s:e] = (dS @ ks * scale).transpose(0, 1)
        dk[s:e] = (dS.transpose(1, 2) @ qs * scale).view(Hkv, g, L, D).sum(1).transpose(0, 1)
        dv[s:e] = (P.transpose(1, 2) @ do).view(Hkv, g, L, D).sum(1).transpose(0, 1)
    return dq, dk, dv


@pytest.mark.parametrize("window,scale", [(None, None), (3, None), (None, 0.3)])
def test_varlen_op_matches_reference_forward_and_backward(window, scale):
    fn = op_attention("ref_op", varlen_attention_op("test_reference", reference_forward, reference_backward))
    q, k, v, cu, m = packed([[5, 11], [16]], 16, 4, 2, 8)
    g = torch.randn_like(q)
    kw = dict(cu_seqlens=cu, max_seqlen=m, sliding_window=window, scale=scale)
    got, ref = _fwd_bwd(fn, q, k, v, g, **kw), _fwd_bwd(sdpa_reference, q, k, v, g, **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_varlen_op_compiles_as_one_graph():
    """fullgraph=True fails on any graph break: the op is one node with its fake shapes, forward and backward,
    and dynamic shapes carry a new document layout without a recompile."""
    from torch._dynamo.utils import counters

    fn = op_attention("ref_op", varlen_attention_op("test_reference", reference_forward, reference_backward))
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]  # counters are process-wide: other tests compile too
    compiled = torch.compile(lambda q, k, v, cu, m: fn(q, k, v, cu_seqlens=cu, max_seqlen=m), fullgraph=True,
                             dynamic=True)
    # sizes chosen unequal (cu 5 then 7 entries, longest 11 then 9; 6 query heads, 2 KV heads, head dim 8):
    # dynamo's duck sizing would guard on a coincidental equality and recompile when it breaks
    for rows in ([[5, 11], [10, 6]], [[2, 3, 9, 2], [7, 9]]):
        q, k, v, cu, m = packed(rows, 16, 6, 2, 8, seed=len(rows[0]))
        g = torch.randn_like(q)
        got = _fwd_bwd(lambda *a, **kw: compiled(*a, kw["cu_seqlens"], kw["max_seqlen"]), q, k, v, g,
                       cu_seqlens=cu, max_seqlen=m)
        ref = _fwd_bwd(sdpa_reference, q, k, v, g, cu_seqlens=cu, max_seqlen=m)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    assert counters["stats"]["unique_graphs"] - graphs == 1


def test_auto_backend_picks_varlen_only_where_it_runs(monkeypatch):
    """attn_backend "auto": varlen on a CUDA GPU of compute capability >= 8.0 in bf16/fp16 with packed rows,
    sdpa anywhere else (the capability is faked, so this runs without a GPU)."""
    from gapless.kernels.attention import auto_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    assert auto_backend(cuda, torch.bfloat16, packed=True) == "varlen"
    assert auto_backend(cuda, torch.float16, packed=True) == "varlen"
    assert auto_backend(cuda, torch.float32, packed=True) == "sdpa"  # varlen runs half precision only
    assert auto_backend(cuda, torch.bfloat16, packed=False) == "sdpa"  # padded rows carry a mask
    assert auto_backend(cpu, torch.bfloat16, packed=True) == "sdpa"
    capability["value"] = (7, 5)  # a T4: no FlashAttention-2 kernels
    assert auto_backend(cuda, torch.bfloat16, packed=True) == "sdpa"


def test_auto_backend_picks_fa4_op_where_flash_attn_4_imports(monkeypatch):
    """With flash-attn-4 importable (faked here: no GPU, no wheel) auto runs fa4_op on Hopper and Blackwell at
    head_dim <= 128 and says why; without it, varlen, saying what is missing; A100 keeps varlen."""
    import gapless.kernels.attention as attention
    from gapless.kernels.attention import choose_backend

    cuda = torch.device("cuda")
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    monkeypatch.setattr(attention, "_varlen_backend", lambda: None)
    name, why = choose_backend(cuda, torch.bfloat16, packed=True, head_dim=128)
    assert name == "varlen" and "flash-attn-4 is not installed" in why  # this machine has no flash-attn-4
    monkeypatch.setattr(attention, "_fa4_op_backend", lambda: None)  # as if it imported
    assert choose_backend(cuda, torch.bfloat16, packed=True, head_dim=128)[0] == "fa4_op"
    assert choose_backend(cuda, torch.bfloat16, packed=True, head_dim=256)[0] == "varlen"  # Gemma's heads
    assert choose_backend(cuda, torch.bfloat16, packed=True, softcap=True)[0] == "flex"
    assert choose_backend(cuda, torch.bfloat16, packed=False)[0] == "sdpa"
    capability["value"] = (10, 0)
    assert choose_backend(cuda, torch.bfloat16, packed=True)[0] == "fa4_op"
    capability["value"] = (8, 0)
    assert choose_backend(cuda, torch.bfloat16, packed=True) == (
        "varlen", "flash-attn-4 is not used for compute capability 8.0")


def test_auto_backend_says_when_flash_attn_4_is_installed_but_does_not_import(monkeypatch):
    """flash-attn-4 present with a dependency missing (session 22's carried files lacked quack-kernels) is not
    "not installed": auto's reason names the module that failed, so the user fixes that, not the install."""
    import builtins

    import gapless.kernels.attention as attention
    from gapless.kernels.attention import choose_backend

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(attention, "_varlen_backend", lambda: None)
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):  # flash_attn.cute.interface found, its `import quack` failing
        if name == "flash_attn.cute.interface":
            raise ModuleNotFoundError("No module named 'quack'", name="quack")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    name, why = choose_backend(torch.device("cuda"), torch.bfloat16, packed=True, head_dim=128)
    assert name == "varlen"
    assert why == "flash-attn-4 is installed but does not import here (ModuleNotFoundError: No module named 'quack')"


def test_varlen_names_the_document_limit_of_one_call(monkeypatch):
    """More documents in one micro-batch than flash attention's grid takes (65,535): a ValueError that names
    data.tokens_per_batch, where the kernel failed with "CUDA error: invalid argument" (the batch finder's trial of a
    tiny model on the H200). On the CPU the backend refuses the tensors first, so its packing step is bypassed here."""
    import gapless.kernels.attention as attention

    monkeypatch.setattr(attention, "_flat_packed", lambda name, q, k, v, cu, max_seqlen, *rest: (q, k, v, cu, 1))
    varlen = attention.get_attention("varlen")
    n = attention.MAX_VARLEN_DOCUMENTS + 1
    q = torch.zeros(n, 2, 8)
    with pytest.raises(ValueError, match=r"65,536 documents in one micro-batch, over the 65,535 .* lower "
                                         r"data.tokens_per_batch"):
        varlen(q, q, q, cu_seqlens=torch.arange(n + 1, dtype=torch.int32), max_seqlen=1)


def test_flash_attn_4_kernel_cache_goes_beside_gaplesss_unless_the_user_chose(monkeypatch, tmp_path):
    """fa4_disk_cache (run before flash-attn-4 is imported) turns its on-disk kernel cache on, in gapless's cache
    folder; a choice the user made in either variable stands."""
    from gapless.kernels.attention import FA4_CACHE, fa4_disk_cache

    for name in ("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert fa4_disk_cache() == FA4_CACHE.expanduser()
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path))
    assert fa4_disk_cache() == tmp_path
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    assert fa4_disk_cache() is None


def test_compiles_once_names_the_backends_that_are_one_op():
    """The backends a compiled layer takes any packed layout through (one op over cu_seqlens: the training loop's
    made-up warm-up batch then stands for every real one), and not sdpa's per-document loop or flex's masks."""
    from gapless.kernels.attention import compiles_once, get_attention, op_attention, varlen_attention_op

    assert not compiles_once(get_attention("sdpa")) and not compiles_once(get_attention("flex"))
    assert compiles_once(op_attention("ref_op", varlen_attention_op("test_once", reference_forward,
                                                                    reference_backward)))
    try:
        varlen = get_attention("varlen")
    except RuntimeError:  # a torch without torch.nn.attention.varlen
        return
    assert compiles_once(varlen)


def test_the_configs_backend_names_are_the_registrys():
    """gapless.config checks model.attn_backend against ATTN_BACKENDS without importing torch: the same names."""
    from gapless.config import ATTN_BACKENDS
    from gapless.kernels.attention import backend_names

    assert sorted(ATTN_BACKENDS) == backend_names()
