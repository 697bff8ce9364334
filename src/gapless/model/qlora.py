"""QLoRA: LoRA on a frozen base whose linear weights are stored as NF4 with double quantisation.

`apply_qlora(model, cfg, compute_dtype)` applies LoRA exactly as `apply_lora` does (same targets, same freezing,
same A/B initialisation draws), then swaps each LoraLinear for a QLoraLinear that keeps the LoRA modules, the bias
and the config but holds its base weight as NF4 buffers (gapless.kernels.nf4): ~0.52 B per weight instead of 2.
QLoraLinear is a LoraLinear, so save_adapter, lora_state_dict and merge_lora work unchanged and the adapter keys
are PEFT's (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`); its `weight` attribute is the
dequantised base weight, computed on each read (merge and export read it once per layer).

Forward: y = x W^T + b + scaling * B A dropout(x), W = dequantise(NF4) into a transient [out, in] tensor in x's
dtype (the caching allocator hands the same block to the next layer's dequantisation: in effect a reused buffer).
Backward: dx = dy W with W dequantised again rather than saved (nf4_linear, nf4_linear_dx: custom operators, so that
torch.compile cannot merge the two dequantisations and save W): the autograd graph keeps the 4-bit storage only, so a QLoRA model's memory stays 4-bit however many layers are in flight; the price is one more
dequantisation per layer per step (~64 us for a Llama-3.2-3B layer on the H200 by bandwidth: nf4.py).
The LoRA update runs the plain formula (autograd differentiates it), per layer or, for "grouped" and "concat" (which
runs grouped here: an NF4 base has no rows to append A's to), with one A matmul for the layers that read the same x
(q/k/v; gate/up), as LoraLinear.group_forward does.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gapless.config import CONCAT_KERNELS, LoraConfig
from gapless.kernels.nf4 import BLOCKSIZE, SCALE_BLOCKSIZE, NF4Weight, dequantize_nf4, nf4_codes, quantize_nf4
from gapless.model.lora import LoraLinear, _lora_layers, _set_submodule, apply_lora
from gapless.model.prequantized import StoredNF4


# x W^T with W dequantised from NF4, and its input gradient dy W with W dequantised again: two custom operators, opaque
# to torch.compile. As a traced autograd.Function the compiled layer's joint graph held the forward's and the
# backward's dequantisation as one node (common subexpressions merged), and the partitioner then saved the bf16 W for
# backward: every layer's dequantised weights in memory at once (H200, Llama-3.2-3B qlora_best: 48.1 GiB against
# LoRA's 46.8; Llama-3.1-8B at 8,192 tokens with checkpointing: 42.0 GiB), the opposite of what QLoRA is for. Inside
# the operators the dequantisation is nf4.dequantize_nf4 (one compiled kernel on CUDA) into a transient W that the
# caching allocator hands to the next layer: nothing [out, in] outlives the call.
@torch.library.custom_op("gapless::nf4_linear", mutates_args=())
def nf4_linear(x: Tensor, packed: Tensor, absmax_q: Tensor, absmax_scale: Tensor, offset: Tensor, code: Tensor,
               scale_code: Tensor) -> Tensor:
    """x W^T for the NF4-stored W [out, in]; out is read from the storage's size and x's last dimension."""
    in_f = x.shape[-1]
    w = dequantize_nf4(packed, absmax_q, absmax_scale, offset, (packed.numel() * 2 // in_f, in_f), x.dtype,
                       (code, scale_code))
    return F.linear(x, w)


@nf4_linear.register_fake
def _(x, packed, absmax_q, absmax_scale, offset, code, scale_code):
    return x.new_empty((*x.shape[:-1], packed.numel() * 2 // x.shape[-1]))


@torch.library.custom_op("gapless::nf4_linear_dx", mutates_args=())
def nf4_linear_dx(dy: Tensor, packed: Tensor, absmax_q: Tensor, absmax_scale: Tensor, offset: Tensor, code: Tensor,
                  scale_code: Tensor) -> Tensor:
    """dy W, the input gradient of nf4_linear, W dequantised again rather than saved."""
    out_f = dy.shape[-1]
    w = dequantize_nf4(packed, absmax_q, absmax_scale, offset, (out_f, packed.numel() * 2 // out_f), dy.dtype,
                       (code, scale_code))
    return dy @ w


@nf4_linear_dx.register_fake
def _(dy, packed, absmax_q, absmax_scale, offset, code, scale_code):
    return dy.new_empty((*dy.shape[:-1], packed.numel() * 2 // dy.shape[-1]))


def _nf4_linear_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[1:])  # the 4-bit storage and the code tables themselves, no copies


def _nf4_linear_backward(ctx, dy):
    # the base weight is frozen: a gradient for x alone
    dx = nf4_linear_dx(dy, *ctx.saved_tensors) if ctx.needs_input_grad[0] else None
    return (dx,) + (None,) * 6


nf4_linear.register_autograd(_nf4_linear_backward, setup_context=_nf4_linear_setup)


class QLoraLinear(LoraLinear):
    """A LoraLinear whose frozen base weight is NF4 buffers; built from a LoraLinear (its LoRA modules kept)."""

    def __init__(self, lora: LoraLinear, compute_dtype: torch.dtype,
                 quantise_from: torch.dtype | None = None):
        # quantise_from: to_qlora's. Not LoraLinear.__init__: it would register the bf16 base weight this layer exists
        # to drop; the LoRA modules, dropout, scaling and kernel are taken over from `lora` as they are
        nn.Module.__init__(self)
        self.in_features, self.out_features = lora.in_features, lora.out_features
        self.register_parameter("bias", lora.bias)
        self.lora_A, self.lora_B, self.lora_dropout = lora.lora_A, lora.lora_B, lora.lora_dropout
        self.scaling, self.kernel = lora.scaling, lora.kernel
        self.compute_dtype = compute_dtype
        n = self.in_features * self.out_features
        if n % BLOCKSIZE:
            raise ValueError(f"QLoRA: a [{self.out_features}, {self.in_features}] weight has {n} elements, not a "
                             f"multiple of the NF4 block size {BLOCKSIZE}")
        device = lora.weight.device  # meta when the model was built on the meta device: the load hook fills these
        blocks = n // BLOCKSIZE
        self.register_buffer("weight_packed", torch.empty(n // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_absmax_q", torch.empty(blocks, dtype=torch.uint8, device=device))
        self.register_buffer("weight_absmax_scale", torch.empty(-(-blocks // SCALE_BLOCKSIZE), device=device))
        self.register_buffer("weight_offset", torch.empty((), device=device))
        # the NF4 values and the 8-bit scale map (kernels/nf4.py), inputs of the traced dequantisation; not saved
        self.register_buffer("nf4_code", torch.empty(16, device=device), persistent=False)
        self.register_buffer("nf4_scale_code", torch.empty(256, device=device), persistent=False)
        if not lora.weight.is_meta:
            self.quantize_(lora.weight if quantise_from is None else lora.weight.to(quantise_from))

    @torch.no_grad()
    def quantize_(self, weight: Tensor) -> None:
        """Quantise `weight` [out, in] (any float dtype, on the device the layer's storage should live on)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"QLoRA: weight of shape {list(weight.shape)} for a layer of "
                             f"[{self.out_features}, {self.in_features}]")
        self.load_nf4_(quantize_nf4(weight))

    @torch.no_grad()
    def load_nf4_(self, q: NF4Weight) -> None:
        """Take the quantised weight `q` as this layer's storage (on q's device)."""
        assert tuple(q.shape) == (self.out_features, self.in_features), (q.shape, self)
        self.nf4_code, self.nf4_scale_code = nf4_codes(q.packed.device)
        self.weight_packed, self.weight_absmax_q = q.packed, q.absmax_q
        self.weight_absmax_scale, self.weight_offset = q.absmax_scale, q.offset

    def nf4(self) -> NF4Weight:
        return NF4Weight(self.weight_packed, self.weight_absmax_q, self.weight_absmax_scale, self.weight_offset,
                         (self.out_features, self.in_features), self.compute_dtype)

    @property
    def weight(self) -> Tensor:
        """The dequantised base weight [out, in] in compute_dtype, a new tensor on every read (merge, export)."""
        return self.nf4().dequantize()

    def base_forward(self, x: Tensor) -> Tensor:
        y = nf4_linear(x, self.weight_packed, self.weight_absmax_q, self.weight_absmax_scale, self.weight_offset,
                       self.nf4_code, self.nf4_scale_code)
        return y if self.bias is None else y + self.bias

    def forward(self, x: Tensor) -> Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A.weight.to(x.dtype)),
                          self.lora_B.weight.to(x.dtype))
        return self.base_forward(x) + update * self.scaling

    @staticmethod
    def group_forward(x: Tensor, layers: Sequence[nn.Module]) -> list[Tensor]:
        """LoraLinear.group_forward for QLoRA layers: one matmul for the A matrices of the "grouped" layers that read
        x, under one dropout mask for the group as there (gapless.kernels.lora.lora_linear_grouped), each base through
        its own dequantised weight (LoraLinear's would save each dequantised weight for backward); other layers run
        alone."""
        # "concat" runs grouped here: an NF4 base has no rows to append A's to
        joins = [isinstance(layer, QLoraLinear) and layer.kernel in ("grouped", *CONCAT_KERNELS) for layer in layers]
        grouped = [layer for layer, join in zip(layers, joins) if join]
        if len(grouped) < 2:
            return [layer(x) for layer in layers]
        a = torch.cat([g.lora_A.weight.to(x.dtype) for g in grouped])  # [sum r, in]
        xd = grouped[0].lora_dropout(x)
        xas = iter(F.linear(xd, a).split([g.lora_A.out_features for g in grouped], dim=-1))  # each [..., r]
        return [layer.base_forward(x) + F.linear(next(xas), layer.lora_B.weight.to(x.dtype)) * layer.scaling
                if join else layer(x) for layer, join in zip(layers, joins)]

    def extra_repr(self) -> str:
        return super().extra_repr() + ", base=nf4"


def apply_qlora(model: nn.Module, cfg: LoraConfig, compute_dtype: torch.dtype, *,
                adapter_dtype: torch.dtype = torch.float32) -> nn.Module:
    """LoRA on cfg.target_modules (apply_lora), each targeted base weight then stored as NF4 (to_qlora)."""
    return to_qlora(apply_lora(model, cfg, adapter_dtype=adapter_dtype), compute_dtype)


def to_qlora(model: nn.Module, compute_dtype: torch.dtype, quantise_from: torch.dtype | None = None) -> nn.Module:
    """Every LoraLinear of `model` swapped for a QLoraLinear. On a model built on the meta device the NF4 buffers stay
    meta until `QloraLoadHook` quantises the checkpoint's weights into them; on a loaded model each weight is
    quantised now, layer by layer (its bf16 copy freed as the layer is swapped). `quantise_from`: each weight is
    rounded to it before quantising, as the hook's, so that a model loaded in another dtype than its run's (float32,
    to merge a bfloat16 run) holds the NF4 codes the run trained on (None: as loaded)."""
    for name, layer in _lora_layers(model).items():
        _set_submodule(model, name, QLoraLinear(layer, compute_dtype, quantise_from))
    return model


class QloraLoadHook:
    """hook(key, tensor) for streaming a checkpoint into a QLoRA model (gapless.model.loading.load_weights, which
    hands each tensor over already on the target device): a QLoRA layer's base weight is quantised where it is into
    the layer's NF4 buffers and consumed (True); any other tensor is left to the loader (False). `quantise_from`:
    the weight is rounded to it before quantising, so that a model loaded in another dtype than its run's (float32
    to evaluate a bfloat16 run on the CPU) holds the NF4 codes the run trained on (None: as handed over).
    `stored(key, weight)`: a bitsandbytes 4-bit checkpoint's weight (gapless.model.prequantized) becomes the layer's
    storage as the file holds it, the same codes whatever the load's dtype; one that NF4 storage cannot hold
    (FP4, another block size) is refused (False), and the loader hands it back dequantised, to be quantised.

    Peak memory while loading Llama-3.1-8B in bf16 on a GPU: host, nothing beyond the memory-mapped shards (the
    reading threads put each tensor on the GPU: loading.checkpoint_tensors); GPU, the model as it fills (5.3 GiB at
    the end: gapless.meter.memory) plus the one projection being quantised, 14336 x 4096 = 58.7M weights x
    (2 B bf16 + ~16 B of quantize_nf4's float32 temporaries) = ~1.1 GB, plus the tensors read ahead of it (at most
    loading.LOAD_INFLIGHT_BYTES, 1 GiB; threads=1 reads none ahead). Never a bf16 copy of the model. The hook runs
    in the loading thread, one tensor at a time, in the checkpoint's order."""

    def __init__(self, model: nn.Module, quantise_from: torch.dtype | None = None):
        self.layers = {name + ".weight": layer for name, layer in model.named_modules()
                       if isinstance(layer, QLoraLinear)}
        self.quantise_from = quantise_from
        self.requantised: list[str] = []  # 4-bit weights that NF4 storage could not take as stored

    def __call__(self, key: str, tensor: Tensor) -> bool:
        layer = self.layers.get(key)
        if layer is None:
            return False
        layer.quantize_(tensor if self.quantise_from is None else tensor.to(self.quantise_from))
        return True

    def stored(self, key: str, weight: StoredNF4) -> bool:
        layer = self.layers.get(key)
        if layer is None:
            return False
        q = weight.nf4()
        if q is None:
            if not self.requantised:
                warnings.warn(f"QLoRA: {key} and the checkpoint's other {weight.quant_type} weights of block size "
                              f"{weight.blocksize} are dequantised and quantised again as NF4 of block size "
                              f"{BLOCKSIZE} (gapless' storage): the run trains on slightly different base weights "
                              "than the file holds", stacklevel=2)
            self.requantised.append(key)
            return False
        layer.load_nf4_(q)
        return True
