"""NF4 with double quantisation (gapless.kernels.nf4): the reference against hand-checked values and against
bitsandbytes (bit for bit, where it imports), and the compiled CUDA path against the reference (GPU)."""
import pytest
import torch

from gapless.kernels.nf4 import (BLOCKSIZE, NF4_VALUES, SCALE_BLOCKSIZE, dequantize_nf4, dequantize_nf4_reference,
                                 dynamic_map, quantize_nf4, to_bnb_quant_state)


def _weight(out=96, inp=320, seed=0, dtype=torch.float32):
    # 96 * 320 / 64 = 480 blocks: one full and one short 256-block at the second level
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out, inp, generator=g) * 0.02).to(dtype)


def test_layout_and_sizes():
    w = _weight()
    q = quantize_nf4(w)
    n = w.numel()
    assert q.packed.shape == (n // 2,) and q.packed.dtype == torch.uint8
    assert q.absmax_q.shape == (n // BLOCKSIZE,) and q.absmax_q.dtype == torch.uint8
    assert q.absmax_scale.shape == (2,) and q.absmax_scale.dtype == torch.float32  # ceil(480 / 256)
    assert q.offset.shape == () and q.shape == (96, 320)
    assert q.nbytes == n // 2 + n // 64 + 2 * 4 + 4  # ~0.516 B per weight


def test_codes_are_nearest_nf4_values_and_packing_order():
    # one block holding every NF4 value times 2 (absmax 2), each value exactly representable: exact round trip
    vals = torch.tensor(NF4_VALUES) * 2
    w = torch.cat([vals, vals.flip(0), vals, vals.flip(0)]).view(1, 64)
    q = quantize_nf4(w)
    first = q.packed[0].item()
    assert first >> 4 == 0 and first & 0xF == 1  # element 0 (-1.0 -> code 0) high nibble, element 1 low
    back = q.dequantize()
    # the absmax goes through the 8-bit second level: 2.0 - offset(=2.0) = 0 is exact, so the round trip is exact
    torch.testing.assert_close(back, w, rtol=0, atol=0)


def test_round_trip_error_is_nf4_sized():
    w = _weight()
    back = quantize_nf4(w).dequantize()
    # half the largest gap between NF4 values, (1 - 0.7230) / 2 = 0.139 of a block's absmax, plus the error of
    # the 8-bit absmax (the dynamic map's top decade has 64 steps over [0.1, 1] of the 256-block scale: ~1-2%)
    blocks_absmax = w.view(-1, 64).abs().amax(1, keepdim=True)
    rel = ((back - w).view(-1, 64).abs() / blocks_absmax).max()
    assert rel < 0.16, rel
    assert (back - w).abs().mean() < 0.1 * w.abs().mean() + 1e-3


def test_dynamic_map_matches_bitsandbytes_definition():
    m = dynamic_map()
    # sorted, +1 exact; the most negative is -(0.1 + (1 - 0.1) * 127 / 128 ... ): -(0.986 + 1) / 2 = -0.993
    assert m.shape == (256,) and m[-1] == 1 and torch.isclose(m[0], torch.tensor(-0.99296875))
    assert (m[1:] >= m[:-1]).all()
    assert (m == 0).sum() == 1
    # the smallest positive value: 10^-6 * (0.1 + 1) / 2
    assert torch.isclose(m[m > 0].min(), torch.tensor(0.55e-6))


def test_dequantize_dispatch_equals_reference_on_cpu():
    q = quantize_nf4(_weight(dtype=torch.bfloat16))
    args = (q.packed, q.absmax_q, q.absmax_scale, q.offset, q.shape)
    assert torch.equal(dequantize_nf4(*args, torch.bfloat16), dequantize_nf4_reference(*args, torch.bfloat16))
    assert q.dequantize().dtype == torch.bfloat16


def test_bad_shape_names_the_problem():
    with pytest.raises(ValueError, match="multiple of the NF4 block size 64"):
        quantize_nf4(torch.randn(3, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equals_bitsandbytes(dtype):
    F = pytest.importorskip("bitsandbytes.functional")
    w = _weight(dtype=dtype)
    ours = quantize_nf4(w)
    theirs_packed, theirs = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    # same codes, same packing, same double-quantised scales
    assert torch.equal(ours.packed, theirs_packed.view(-1))
    # the 8-bit scale codes: bitsandbytes' CPU library searches its map differently from its CUDA kernel (which we
    # follow), so a scale that falls almost midway between two codes may go the other way: at most 1 code apart,
    # in at most 1% of the blocks (1 of 480 here)
    differ = ours.absmax_q.int() - theirs.absmax.int()
    assert differ.abs().max() <= 1 and (differ != 0).float().mean() <= 0.01, differ.nonzero()
    assert torch.equal(ours.absmax_scale, theirs.state2.absmax)
    assert torch.equal(ours.offset, theirs.offset)
    assert torch.equal(dynamic_map(), theirs.state2.code)
    assert torch.equal(torch.tensor(NF4_VALUES), theirs.code)
    # bitsandbytes' dequantisation of our state equals ours, bit for bit
    assert torch.equal(F.dequantize_4bit(ours.packed.view(-1, 1), to_bnb_quant_state(ours)), ours.dequantize())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_equals_bitsandbytes_cuda_exactly():
    F = pytest.importorskip("bitsandbytes.functional")
    w = _weight(3072, 1024, dtype=torch.bfloat16).cuda()
    ours = quantize_nf4(w)
    theirs_packed, theirs = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    assert torch.equal(ours.packed, theirs_packed.view(-1))
    assert torch.equal(ours.absmax_q, theirs.absmax)  # the CUDA search, followed exactly
    assert torch.equal(ours.absmax_scale, theirs.state2.absmax) and torch.equal(ours.offset, theirs.offset)
    # the same codes; the dequantised values within one bf16 rounding (H200 run 20261204T172451Z: not bit-equal,
    # as a GPU may fuse code * scale + offset into one FMA, rounding once where the CPU rounds twice)
    torch.testing.assert_close(F.dequantize_4bit(theirs_packed, theirs), ours.dequantize(), rtol=2 ** -7, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(3072, 3072), (1024, 3072), (8192, 3072), (3072, 8192)])
def test_compiled_cuda_dequantize_equals_cpu_reference(shape):
    w = _weight(*shape, dtype=torch.bfloat16)
    q = quantize_nf4(w.cuda())
    q_cpu = quantize_nf4(w)
    assert torch.equal(q.packed.cpu(), q_cpu.packed) and torch.equal(q.absmax_q.cpu(), q_cpu.absmax_q)
    args = (q.packed, q.absmax_q, q.absmax_scale, q.offset, q.shape, torch.bfloat16)
    fast = dequantize_nf4(*args)  # torch.compile on CUDA
    # the same float32 formula, within one bf16 rounding (Inductor may contract code * scale + offset into an FMA)
    torch.testing.assert_close(fast.cpu(), q_cpu.dequantize(), rtol=2 ** -7, atol=0)
    assert SCALE_BLOCKSIZE == 256
