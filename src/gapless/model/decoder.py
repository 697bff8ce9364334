"""The decoder of every supported family (llama, mistral, qwen2, qwen3, gemma2, gemma3) in one file, with HF's names.

Module paths are exactly transformers' (`model.layers.3.self_attn.q_proj.weight`, `lm_head.weight`),
so a checkpoint's state dict loads without a renaming table and PEFT adapter keys are
`base_model.model.` + our names. The families differ in the rules of gapless.model.families (norm form,
activation, embedding scale, sandwich norms, q/k norms, which projections carry a bias) and in the numbers
config.json gives (ModelArgs: attention scale, soft-capping, the window and RoPE table of each layer).

Rows may be packed: `cu_seqlens` (int32 [docs + 1], offsets into the flattened B*T tokens) keeps
documents from attending to each other, and positions restart at 0 at every document.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gapless.kernels.attention import get_attention
from gapless.kernels.loss import DEFAULT_CHUNK_SIZE, linear_cross_entropy
from gapless.model.families import family

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclass
class RopeScaling:
    """RoPE frequency scaling, as transformers' `rope_parameters` / `rope_scaling` describe it."""
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # llama3, yarn: the pretraining context
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: None derives it from factor (and mscale)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions


@dataclass
class ModelArgs:
    """The architecture, read from config.json by `gapless.model.loading.read_model_args`."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    biases: tuple[str, ...] = ()  # the projections with a bias (q_proj, ..., down_proj)
    # one entry per layer: the window (a query at i sees keys j with i - window < j <= i) or None
    sliding_window: list[int | None] = field(default_factory=list)
    # the RoPE base of the sliding layers where it differs from the global one (Gemma 3: 10,000 against 1e6;
    # unscaled); None: every layer uses rope_theta and rope_scaling
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its ^-0.5; None: head_dim^-0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2: 50)
    final_softcap: float | None = None  # the same on the logits (Gemma 2: 30)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if not self.sliding_window:
            self.sliding_window = [None] * self.num_hidden_layers
        assert len(self.sliding_window) == self.num_hidden_layers
        assert self.num_attention_heads % self.num_key_value_heads == 0


# ---------------------------------------------------------------------------------------------
# RoPE


def rope_frequencies(args: ModelArgs, local: bool = False) -> tuple[Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention_factor), computed as transformers does per rope_type;
    `local`: the sliding layers' own table (base local_rope_theta, no scaling)."""
    s = RopeScaling() if local else args.rope_scaling
    theta = args.local_rope_theta if local else args.rope_theta
    dim = args.head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if s.rope_type in ("default", "dynamic"):
        # dynamic NTK (transformers' _compute_dynamic_ntk_parameters) grows the base only for a sequence longer than
        # max_position_embeddings; up to it the base is rope_theta, plain RoPE. gapless runs no longer one with it:
        # RunConfig.check_model refuses such a data.max_seq_len, generate_ids such a prompt plus new tokens
        return inv_freq, 1.0
    if s.rope_type == "linear":
        # dividing every frequency by `factor` is dividing every position by it (position interpolation)
        return inv_freq / s.factor, 1.0
    if s.rope_type == "llama3":
        # Llama 3.1: long wavelengths (> ctx / low_freq_factor) are interpolated by `factor`, short ones
        # (< ctx / high_freq_factor) kept, and the band between blended linearly in ctx / wavelength
        ctx = s.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > ctx / s.low_freq_factor, inv_freq / s.factor, inv_freq)
        smooth = (ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= ctx / s.high_freq_factor) & (wavelen <= ctx / s.low_freq_factor)
        return torch.where(medium, smoothed, scaled), 1.0
    if s.rope_type == "yarn":
        return _yarn(inv_freq, dim, theta, s)
    raise AssertionError(f"rope_type {s.rope_type!r} should have been refused by read_model_args")


def _yarn(inv_freq: Tensor, dim: int, base: float, s: RopeScaling) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023): extrapolate high frequencies, interpolate low ones, ramp between."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
        else:
            attention_factor = mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength fits `rotations` times into the original context
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: divide it by factor
    inv_freq = inv_freq / s.factor * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin per token from position_ids; computed once per forward and shared by all layers.

    One table, or two when the sliding layers have their own base (Gemma 3): forward returns the list
    [(cos, sin) global, (cos, sin) local], and each layer's `rope_table` indexes it."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tables = 1 if args.local_rope_theta is None else 2
        inv_freq, self.attention_factor = rope_frequencies(args)
        # not persistent: the state dict keeps exactly HF's keys
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if self.tables == 2:
            self.register_buffer("inv_freq_local", rope_frequencies(args, local=True)[0], persistent=False)

    def reset_inv_freq(self, device: torch.device | str) -> None:
        """Recompute inv_freq on `device` (after building on the meta device, buffers hold no data)."""
        self.inv_freq = rope_frequencies(self.args)[0].to(device)
        if self.tables == 2:
            self.inv_freq_local = rope_frequencies(self.args, local=True)[0].to(device)

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
        tables = [self._cos_sin(position_ids, self.inv_freq, self.attention_factor, dtype)]
        if self.tables == 2:
            tables.append(self._cos_sin(position_ids, self.inv_freq_local, 1.0, dtype))
        return tables

    @staticmethod
    def _cos_sin(position_ids: Tensor, inv_freq: Tensor, factor: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # float32 angles: in bf16 a position near 4096 would be off by up to 16
        freqs = position_ids[..., None].float() * inv_freq.float()  # [B, T, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, head_dim], HF's rotate-half layout
        # yarn scales q and k by attention_factor each, so attention logits by its square, as HF does
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, H, D]; cos, sin [B, T, D] broadcast over heads."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + rotate_half(x) * sin


def positions_from_cu_seqlens(cu_seqlens: Tensor, batch: int, seqlen: int) -> Tensor:
    """[B, T] positions that restart at 0 at every document start, without a host sync."""
    flat = torch.arange(batch * seqlen, device=cu_seqlens.device)
    cu = cu_seqlens.long()
    doc = torch.searchsorted(cu, flat, right=True) - 1  # the document each token belongs to
    return (flat - cu[doc]).view(batch, seqlen)


# ---------------------------------------------------------------------------------------------
# the decoder


def project(x: Tensor, *layers: nn.Module) -> list[Tensor]:
    """Each layer applied to the same x (q/k/v; gate/up). Layers with a `group_forward` (LoRA: one matmul for all
    their A matrices, gapless.model.lora) take the group at once; plain nn.Linear layers are called one by one."""
    group_forward = next((layer.group_forward for layer in layers if hasattr(layer, "group_forward")), None)
    if group_forward is not None:
        return group_forward(x, layers)
    return [layer(x) for layer in layers]


class RMSNorm(nn.Module):
    """RMSNorm in float32. `one_plus`: Gemma's form, (1 + weight) * x computed in float32 and then cast (weights
    stored centred on 0); otherwise Llama's, x cast back to the input dtype before the weight, as HF orders each."""

    def __init__(self, dim: int, eps: float, one_plus: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if one_plus else torch.ones(dim))
        self.eps = eps
        self.one_plus = one_plus

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.one_plus:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def norm(args: ModelArgs, dim: int) -> RMSNorm:
    """An RMSNorm of the family's form."""
    return RMSNorm(dim, args.rms_norm_eps, one_plus=family(args.model_type).norm == "one_plus_weight")


class ScaledEmbedding(nn.Embedding):
    """nn.Embedding times a constant (Gemma: sqrt(hidden_size)), the constant first rounded to the activation
    dtype as HF does: in bf16 sqrt(2560) = 50.596 becomes 50.5."""

    def __init__(self, num: int, dim: int, padding_idx: int | None, scale: float):
        super().__init__(num, dim, padding_idx=padding_idx)
        self.scale = scale

    def forward(self, input_ids: Tensor) -> Tensor:
        h = super().forward(input_ids)
        return h * torch.tensor(self.scale, dtype=h.dtype)  # a 0-dim CPU tensor: a scalar to any device


def softcap(x: Tensor, cap: float | None) -> Tensor:
    """cap * tanh(x / cap): values squashed smoothly into (-cap, cap) (Gemma 2's logits and attention scores)."""
    return x if cap is None else torch.tanh(x / cap) * cap


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        D, hd = args.hidden_size, args.head_dim
        self.head_dim = hd
        bias = set(args.biases)
        self.q_proj = nn.Linear(D, args.num_attention_heads * hd, bias="q_proj" in bias)
        self.k_proj = nn.Linear(D, args.num_key_value_heads * hd, bias="k_proj" in bias)
        self.v_proj = nn.Linear(D, args.num_key_value_heads * hd, bias="v_proj" in bias)
        self.o_proj = nn.Linear(args.num_attention_heads * hd, D, bias="o_proj" in bias)
        # qwen3 and gemma3 normalise each head of q and k over head_dim before RoPE
        qk_norm = family(args.model_type).qk_norm
        self.q_norm = norm(args, hd) if qk_norm else None
        self.k_norm = norm(args, hd) if qk_norm else None
        self.sliding_window = args.sliding_window[layer_idx]
        self.scale = (args.query_pre_attn_scalar or hd) ** -0.5
        # passed to attn_fn only when set: a soft-capping model needs a backend that takes it (kernels.attention)
        self.softcap = {} if args.attn_softcap is None else {"softcap": args.attn_softcap}
        self.layer_idx = layer_idx

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn_fn, cu_seqlens: Tensor | None,
                max_seqlen: int | None, attention_mask: Tensor | None, cache=None) -> Tensor:
        B, T, _ = x.shape
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(B, T, -1, self.head_dim)  # [B, T, Hq, hd]
        k = k.view(B, T, -1, self.head_dim)  # [B, T, Hkv, hd]
        # its own tensor: under lora.kernel concat_b v is a view of the one [.., q + k + v] GEMM output, which
        # attention's saved v would keep alive whole (3.8 GB over Llama-3.2-3B's 28 layers at 16,384 tokens)
        v = v.contiguous().view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # generation: these keys/values join the cached ones (gapless.model.generate.KVCache)
            out = cache.attend(self.layer_idx, q, k, v, self.sliding_window, self.scale, **self.softcap)
        else:
            out = attn_fn(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, attention_mask=attention_mask,
                          sliding_window=self.sliding_window, scale=self.scale, **self.softcap)
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU (silu) or GeGLU (tanh-approximated GELU, Gemma): down(act(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        bias = set(args.biases)
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias="gate_proj" in bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias="up_proj" in bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias="down_proj" in bias)
        self.gelu = family(args.model_type).activation == "gelu_tanh"

    def forward(self, x: Tensor) -> Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual blocks. With the family's sandwich norms (Gemma) the attention and MLP outputs are normed
    too before each residual add; HF's names then mean: post_attention_layernorm on the attention output,
    pre_feedforward_layernorm before the MLP, post_feedforward_layernorm on its output. Without them (Llama)
    post_attention_layernorm is the norm before the MLP."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        self.input_layernorm = norm(args, args.hidden_size)
        self.post_attention_layernorm = norm(args, args.hidden_size)
        if family(args.model_type).sandwich_norms:
            self.pre_feedforward_layernorm = norm(args, args.hidden_size)
            self.post_feedforward_layernorm = norm(args, args.hidden_size)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        # which RoPE table of RotaryEmbedding.forward this layer reads: 1 for a sliding layer with its own base
        self.rope_table = int(args.local_rope_theta is not None and args.sliding_window[layer_idx] is not None)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attn_fn, cu_seqlens: Tensor | None,
                max_seqlen: int | None, attention_mask: Tensor | None, cache=None) -> Tensor:
        a = self.self_attn(self.input_layernorm(h), cos, sin, attn_fn, cu_seqlens, max_seqlen, attention_mask, cache)
        if self.pre_feedforward_layernorm is None:
            h = h + a
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class DecoderModel(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm (and the non-persistent RoPE table)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        # padding_idx as HF sets it: the pad row gets no gradient in full fine-tuning
        pad = args.pad_token_id if args.pad_token_id is not None and 0 <= args.pad_token_id < args.vocab_size else None
        if family(args.model_type).embed_scale:
            self.embed_tokens = ScaledEmbedding(args.vocab_size, args.hidden_size, pad, args.hidden_size ** 0.5)
        else:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, padding_idx=pad)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = norm(args, args.hidden_size)
        self.rotary_emb = RotaryEmbedding(args)


class CausalLM(nn.Module):
    """The decoder with its LM head. `model(input_ids)` gives logits [B, T, vocab].

    `config_dict` (config.json as read) and `source_dir` are set by the loader so that export can
    write a faithful config and copy the tokenizer.
    """

    def __init__(self, args: ModelArgs, attn_backend: str = "sdpa"):
        super().__init__()
        self.args = args
        self.model = DecoderModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()
        # the checkpoint's tensors, HF key -> shape, as transformers saves them (a tied head is left out): what
        # gapless.model.loading checks a folder against and streams in, whatever a transform renames later
        self.checkpoint_shapes = {k: tuple(v.shape) for k, v in self.state_dict().items()
                                  if not (args.tie_word_embeddings and k == "lm_head.weight")}
        self.attn_backend = attn_backend
        self.attn_fn = get_attention(attn_backend)
        # the loss of forward(targets=...): tokens per chunk (its transient memory; None: the full logits
        # materialised, as transformers does, kept to measure what that costs) and how the per-chunk softmax step
        # runs, a gapless.kernels.loss step: "eager" here, "auto" from gapless.train.compile.compile_layers (the
        # Triton kernel on CUDA)
        self.loss_chunk_size = DEFAULT_CHUNK_SIZE
        self.loss_step = "eager"
        # training: the first layer's input (the frozen embedding's output) made to need a gradient, as every later
        # layer's does, so compiled layers share one graph instead of two (set by compile_layers; hidden_states)
        self.layer_input_grad = False
        # set by gapless.model.loading.build: config.json as read, its folder, and the safetensors file of each
        # checkpoint tensor (what load_weights streams)
        self.config_dict: dict | None = None
        self.source_dir = None

    def tie_weights(self) -> None:
        """Share the embedding Parameter with lm_head when the config ties them (again after loading assigns)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(self, input_ids: Tensor, position_ids: Tensor | None = None,
                      cu_seqlens: Tensor | None = None, attention_mask: Tensor | None = None,
                      max_seqlen: int | None = None, cache=None) -> Tensor:
        """The final-normed hidden states [B, T, hidden]; the training loss applies lm_head in chunks. `cache`
        (generation): a gapless.model.generate.KVCache holding the earlier positions' keys and values; pass the
        new tokens' position_ids."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if cu_seqlens is not None:
            if attention_mask is not None:
                raise ValueError("pass either cu_seqlens (packed rows) or attention_mask (padded rows), not both")
            if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
                raise ValueError(f"cu_seqlens must be a 1-D int32 tensor of document offsets, "
                                 f"got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        if position_ids is None:
            if cu_seqlens is not None:
                position_ids = positions_from_cu_seqlens(cu_seqlens, B, T)
            else:  # right padding: real tokens sit at 0..n-1; left padding needs the caller's positions
                position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        h = self.model.embed_tokens(input_ids)  # [B, T, D]
        if self.layer_input_grad and torch.is_grad_enabled() and not h.requires_grad:
            # Compiled layers trace a graph per requires_grad of their input: without this layer 0 (its input needs
            # no gradient under LoRA or QLoRA) compiles its own forward and backward beside the other layers'. The
            # price is layer 0's input gradient, computed and dropped: 2 * tokens * hidden * (q + k + v widths)
            # FLOPs, about 0.3% of a Llama-3.2-3B LoRA step; the parameters' gradients are the same.
            h.requires_grad_()
        rope = self.model.rotary_emb(position_ids, h.dtype)  # [(cos, sin) [B, T, hd]], once for all layers
        for layer in self.model.layers:
            # the training call stays the 7 arguments that compiled and checkpointed layers were traced with
            h = layer(h, *rope[layer.rope_table], self.attn_fn, cu_seqlens, max_seqlen, attention_mask,
                      **({"cache": cache} if cache is not None else {}))
        return self.model.norm(h)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, cu_seqlens: Tensor | None = None,
                attention_mask: Tensor | None = None, max_seqlen: int | None = None,
                targets: Tensor | None = None) -> Tensor:
        """Logits [B, T, vocab]; with `targets` ([B, T], -100 where untrained) the float32 SUM of the cross-entropy
        over the trained tokens instead, through the chunked fused loss (gapless.kernels.loss): the full logits
        never exist. Training calls this, never the layers around it, so the hooks that DDP (gradient reduction)
        and FSDP2 (un-sharding) put on the module call run. The trained-token count that divides the sum is a
        host int the data pipeline counted (Batch.num_target_tokens): no device read. Logits are soft-capped
        where the family does it (Gemma 2's final_logit_softcapping), in all three paths."""
        hidden = self.hidden_states(input_ids, position_ids, cu_seqlens, attention_mask, max_seqlen)  # [B, T, D]
        cap = self.args.final_softcap
        if targets is None:
            return softcap(self.lm_head(hidden), cap)
        if self.loss_chunk_size is None:  # as transformers computes it: the [B, T, vocab] logits, then float32
            logits = softcap(self.lm_head(hidden), cap)
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return linear_cross_entropy(hidden.flatten(0, 1), self.lm_head.weight, targets.flatten(),
                                    chunk_size=self.loss_chunk_size, step=self.loss_step, softcap=cap)


def set_attention_backend(model: CausalLM, name: str) -> CausalLM:
    """Switch the attention backend by name (a transform: returns the same model)."""
    model.attn_fn = get_attention(name)
    model.attn_backend = name
    return model
