"""NF4 with double quantisation (QLoRA, Dettmers et al. 2023), bit-compatible with bitsandbytes.

Storage of a weight W with n elements (n a multiple of 64), in bitsandbytes' layout:

    packed       uint8 [n / 2]     two 4-bit codes per byte: element 2i in the high nibble, 2i + 1 in the low
    absmax_q     uint8 [n / 64]    each 64-element block's absmax, minus `offset`, 8-bit quantised with
                                   bitsandbytes' signed dynamic map (create_dynamic_map) in blocks of 256
    absmax_scale fp32  [ceil(n / 64 / 256)]   the second-level scale: each 256-block's absmax of (absmax - offset)
    offset       fp32  []          the mean of the first-level absmax values

    W[i] = NF4[code_i] * (DYNAMIC[absmax_q[b]] * absmax_scale[b // 256] + offset),   b = i // 64

0.5 + 1/64 + 4/16384 = 0.516 bytes per weight (bf16: 2). The 16 NF4 values and the dynamic map are
bitsandbytes' own (functional.get_4bit_type("nf4"), create_dynamic_map()), the quantiser decides codes as
bitsandbytes' CUDA kernels do (the NF4 thresholds; the 8-bit binary search), and dequantisation runs the same
float32 operations in the same order. tests/test_nf4.py checks against bitsandbytes where it imports: the same
packed NF4 codes, bitsandbytes' dequantize_4bit of our state equal to ours bit for bit, and the 8-bit scale codes
equal except for the rare ones its CPU library rounds the other way (on CUDA they are compared exactly, GPU test);
`to_bnb_quant_state` hands a state made here to bitsandbytes.

Why this implementation and not bitsandbytes' or a hand-written Triton kernel:
- A CPU path for tests: plain torch runs anywhere; bitsandbytes is an optional dependency used only to check.
- Speed on the H200: dequantising is memory bound: 0.52 B read + 2 B written per weight. A Llama-3.2-3B layer's
  seven projections hold 100.7M weights, so one dequantisation moves ~254 MB: ~64 us at ~4 TB/s, against a
  ~17 ms forward+backward per layer at 16,384 tokens (28 layers, ~480 ms per step). Dequantising twice per layer
  per step (forward, and again in backward instead of keeping the bf16 copy) costs ~3.6 ms per step, <1%. A
  fused dequant-in-GEMM kernel could win at most that 1% at this token count (it pays at decode-sized batches,
  not at 16k-token training steps), while a cuBLAS bf16 GEMM on the dequantised weight stays at full speed.
  So the fast path is this same function under torch.compile (Inductor emits one Triton kernel for unpack +
  two lookups + scale + cast); inside a compiled decoder layer it is traced into the layer's graph. These are
  estimates from bandwidth; bench/qlora_gpu.py measures dequantisation alone and dequant+GEMM against a bf16
  GEMM on the H200.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

BLOCKSIZE = 64  # weights per first-level absmax (bitsandbytes' default for 4-bit)
SCALE_BLOCKSIZE = 256  # first-level absmax values per second-level fp32 scale (bitsandbytes' nested blocksize)

# bitsandbytes.functional.get_4bit_type("nf4"): quantiles of N(0, 1) scaled to [-1, 1], with an exact 0
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def dynamic_map() -> Tensor:
    """bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): 256 sorted float32
    values in [-1, 1], a decimal exponent 10^-6..10^0 and a linear fraction whose bits shrink as the exponent grows."""
    data: list[float] = []
    for i in range(7):  # exponent 10^(i - 6); 2^i fraction steps on each sign
        boundaries = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]  # 2 * 127 + 2 = 256
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


@dataclass
class NF4Weight:
    """A quantised weight: the four tensors of the module docstring, its shape and the dtype it came in."""
    packed: Tensor
    absmax_q: Tensor
    absmax_scale: Tensor
    offset: Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        return dequantize_nf4(self.packed, self.absmax_q, self.absmax_scale, self.offset, self.shape,
                              dtype or self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.absmax_q, self.absmax_scale, self.offset))


# the dynamic map's float32 values as Python floats (exact), computed once: building it with torch ops at each call
# would graph-break a compiled layer (Tensor.tolist) and cost ~14 small ops per dequantisation in eager
DYNAMIC_VALUES = tuple(dynamic_map().tolist())


def nf4_codes(device: torch.device) -> tuple[Tensor, Tensor]:
    """The NF4 values [16] and the dynamic map [256] as float32 tensors on `device` (constants in a traced graph)."""
    return (torch.tensor(NF4_VALUES, dtype=torch.float32, device=device),
            torch.tensor(DYNAMIC_VALUES, dtype=torch.float32, device=device))


# bitsandbytes' CUDA kernel (dQuantizeNF4) compares against these float32 constants: the midpoints of NF4_VALUES
NF4_THRESHOLDS = (
    -0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544, -0.23460740596055984,
    -0.13791173323988914, -0.045525018125772476, 0.03979014977812767, 0.1202552504837513, 0.2035212516784668,
    0.2920137718319893, 0.3893125355243683, 0.5016634166240692, 0.6427869200706482, 0.8614784181118011,
)


def _nearest_nf4(scaled: Tensor) -> Tensor:
    """The NF4 code of each value in [-1, 1]: the number of thresholds it is strictly above (a value exactly on
    a threshold goes to the lower code, as the CUDA kernel's `x > t` decides)."""
    thresholds = torch.tensor(NF4_THRESHOLDS, dtype=torch.float32, device=scaled.device)
    return torch.bucketize(scaled, thresholds, out_int32=True).to(torch.uint8)


def _dynamic_codes(x: Tensor, code: Tensor) -> Tensor:
    """The 8-bit code of each x in [-1, 1], by bitsandbytes' CUDA search (dQuantize<0>, the second level on a
    GPU): 7 halving steps from index 127, then the nearer of the last pivot and the bound last visited on x's
    side. It is not always the nearest code (its bounds need not be adjacent), so a midpoint bucketize would
    differ in ~0.5% of scales; bitsandbytes' CPU library searches differently again (tests/test_nf4.py)."""
    pivot = torch.full(x.shape, 127, dtype=torch.long, device=x.device)
    lower_p, upper_p = torch.zeros_like(pivot), torch.full_like(pivot, 255)
    lower, upper = torch.full_like(x, -1.0), torch.full_like(x, 1.0)
    val = code[pivot]
    for step in (64, 32, 16, 8, 4, 2, 1):
        right = x > val
        lower_p, lower = torch.where(right, pivot, lower_p), torch.where(right, val, lower)
        upper_p, upper = torch.where(right, upper_p, pivot), torch.where(right, upper, val)
        pivot = torch.where(right, pivot + step, pivot - step)
        val = code[pivot]
    upper = torch.where(upper_p == 255, code[255], upper)
    lower = torch.where(lower_p == 0, code[0], lower)
    up = torch.where(x > (upper + val) * 0.5, upper_p, pivot)
    down = torch.where(x < (lower + val) * 0.5, lower_p, pivot)
    return torch.where(x > val, up, down).to(torch.uint8)


def _blockwise(x: Tensor, blocksize: int) -> tuple[Tensor, Tensor]:
    """bitsandbytes' blockwise absmax scaling of a flat float32 x: (x / its block's absmax [n], absmax fp32
    [ceil(n / bs)]); the last block may be short (the second level: n / 64 first-level scales need not divide by
    256). Multiplying by the reciprocal, as the CUDA kernel does, not dividing."""
    n = x.numel()
    blocks = -(-n // blocksize)
    padded = torch.nn.functional.pad(x, (0, blocks * blocksize - n)).view(blocks, blocksize)  # pads with 0
    absmax = padded.abs().amax(dim=1)  # [blocks]; zero padding never raises an absmax
    scaled = torch.clamp(padded * (1.0 / absmax.clamp(min=1e-38))[:, None], -1, 1).view(-1)[:n]
    return scaled, absmax


@torch.no_grad()
def quantize_nf4(w: Tensor) -> NF4Weight:
    """NF4 with double quantisation of `w` (any shape, numel a multiple of 64), on w's device.

    Transient memory: up to ~4 float32 copies of w at once (~16 B per weight: the float32 copy, its padded view,
    the scaled values, bucketize's int32 codes); quantise one tensor at a time while loading.
    """
    if w.numel() % BLOCKSIZE:
        raise ValueError(f"quantize_nf4: a weight of shape {list(w.shape)} has {w.numel()} elements, not a "
                         f"multiple of the NF4 block size {BLOCKSIZE}")
    if not w.is_floating_point():
        raise ValueError(f"quantize_nf4: expected a float weight, got {w.dtype}")
    scaled, absmax = _blockwise(w.reshape(-1).float(), BLOCKSIZE)  # [n], [n / 64]
    q = _nearest_nf4(scaled)
    packed = (q[0::2] << 4) | q[1::2]  # [n / 2]: even element high nibble, odd element low (bitsandbytes' order)
    return NF4Weight(packed, *double_quantize(absmax), tuple(w.shape), w.dtype)


def double_quantize(absmax: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The second level of the module docstring for the float32 block scales `absmax` [n / 64]: (absmax_q uint8
    [n / 64], absmax_scale fp32 [ceil(n / 64 / 256)], offset fp32 [])."""
    offset = absmax.mean()
    scaled_absmax, absmax_scale = _blockwise(absmax - offset, SCALE_BLOCKSIZE)  # [n / 64], [n / 64 / 256]
    return _dynamic_codes(scaled_absmax, nf4_codes(absmax.device)[1]), absmax_scale, offset


def dequantize_nf4_reference(packed: Tensor, absmax_q: Tensor, absmax_scale: Tensor, offset: Tensor,
                             shape: tuple[int, ...], dtype: torch.dtype, codes: tuple[Tensor, Tensor] | None = None
                             ) -> Tensor:
    """The plain-PyTorch dequantisation (the module docstring's formula), float32 math, cast to `dtype` last.
    codes: (NF4 values [16], dynamic map [256]) on packed's device (`nf4_codes`); a traced caller passes them in,
    as creating a tensor from constants inside an autograd.Function that dynamo captures fails under dynamic
    shapes."""
    code, dyn = codes if codes is not None else nf4_codes(packed.device)
    nib = torch.stack((packed >> 4, packed & 0xF), dim=-1).view(-1).long()  # [n]: high nibble first
    nblocks = absmax_q.numel()
    # second level: 8-bit codes * their 256-block's fp32 scale + offset, as bitsandbytes (float32, this order)
    scale = absmax_scale.repeat_interleave(SCALE_BLOCKSIZE)[:nblocks]  # [n / 64]
    absmax = dyn[absmax_q.long()] * scale + offset  # [n / 64]
    w = code[nib].view(nblocks, BLOCKSIZE) * absmax[:, None]  # [n / 64, 64]
    return w.view(shape).to(dtype)


def dequantize_nf4(packed: Tensor, absmax_q: Tensor, absmax_scale: Tensor, offset: Tensor,
                   shape: tuple[int, ...], dtype: torch.dtype, codes: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The dequantised weight [*shape] in `dtype`: on CUDA through torch.compile (one generated kernel, the fast
    path), elsewhere the reference. Inside a region torch.compile is already tracing, the reference is traced
    into that graph (no nested compile). Both compute the same float32 values: equal bit for bit."""
    codes = codes if codes is not None else nf4_codes(packed.device)
    if packed.device.type != "cuda" or torch.compiler.is_compiling():
        return dequantize_nf4_reference(packed, absmax_q, absmax_scale, offset, shape, dtype, codes)
    return _compiled_dequantize()(packed, absmax_q, absmax_scale, offset, shape, dtype, codes)


@functools.cache
def _compiled_dequantize():
    # dynamic: the 4-5 distinct projection shapes of a model share one graph instead of one compile each
    return torch.compile(dequantize_nf4_reference, dynamic=True)


def to_bnb_quant_state(q: NF4Weight):
    """The equivalent bitsandbytes QuantState (for checking against bitsandbytes.functional.dequantize_4bit);
    needs bitsandbytes installed."""
    from bitsandbytes.functional import QuantState

    code, dyn = nf4_codes(q.packed.device)
    state2 = QuantState(absmax=q.absmax_scale, code=dyn, blocksize=SCALE_BLOCKSIZE, dtype=torch.float32)
    return QuantState(absmax=q.absmax_q, shape=torch.Size(q.shape), code=code, blocksize=BLOCKSIZE,
                      quant_type="nf4", dtype=q.dtype, offset=q.offset, state2=state2)
