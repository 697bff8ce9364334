"""Predict a training step's peak GPU memory from the architecture, the method and the batch, before any run.

    peak = weights in their storage dtype            bf16/fp16/fp32 per element; QLoRA's quantised projections
                                                      NF4: 0.5 + 1/64 + 4/16384 B per weight (kernels/nf4.py)
         + trainable float32 copies                   LoRA/QLoRA adapters (fp32 Parameters); full: fp32 masters
         + gradients (float32)                        of the trainable tensors; full: + the largest bf16 gradient,
                                                      alive until its hook folds it into fp32 (train/optim.py)
         + AdamW state                                exp_avg + exp_avg_sq, float32: 8 B per trainable element
         + activations                                N tokens x L layers x (A x hidden + B x intermediate) bytes,
                                                      scaled by the dtype's size / 2
         + LoRA dropout masks                         lora.dropout > 0: 1 B (a bool) per input feature of each
                                                      dropout mask, per token per layer (dropout_mask_bytes)
         + the loss's working set                     chunk x vocab x 6 B (bf16 logits + fp32 softmax/gradient of
                                                      one chunk; kernels/loss.py) + the final hidden states N x hidden
         + QLoRA's dequantised weights                one layer's projections in the compute dtype (transient)
         + allocator reserve                          5% of the above (stated, not fitted): blocks the caching
                                                      allocator holds but torch's max_memory_allocated does not count

A = 14.66 B per hidden unit and B = 5.60 B per intermediate unit, per token per layer in bf16, are fitted by least
squares to the four rows of bench/results.jsonl that measured a compiled, packed (varlen) LoRA r16 step on all 7
projections without activation checkpointing at 16,384 tokens on an H200 (peak = torch.cuda.max_memory_allocated):

    Llama-3.2-1B, loss chunk 4096   measured 24.23 GiB   predicted 24.00   -1.0%   (run 20261203T105024Z-h200)
    Llama-3.2-3B, loss chunk 4096   measured 48.24 GiB   predicted 48.22   -0.05%  (run 20261203T105024Z-h200)
    Llama-3.2-3B, loss chunk 2048   measured 46.78 GiB   predicted 46.75   -0.07%  (run s3-grouped)
    Llama-3.1-8B, loss chunk 4096   measured 87.07 GiB   predicted 87.16   +0.1%   (run 20261203T105024Z-h200)

(The loss's 6 B per chunk logit comes from the two 3B rows: 1.46 GiB less for 2048 fewer chunk tokens.) They read
as the tensors a layer saves for backward: ~7 bf16 vectors of the hidden size (norm input and output, q, k, v,
attention output, o_proj input: 14 B) and ~3 of the intermediate size (gate, up, their product: 6 B, a little
less where Inductor recomputes the SiLU). Eager layers (model.compile false) save more: x 1.34, from the 3B
packed_fused row (61.38 GiB, same run), the one fully eager measurement; a check it was not fitted to: run
s3-grouped's grouped rows ran 20 of 28 layers eager (a recompile bug, bench/RESULTS.md) and measured 55.53 GiB,
which 8 compiled + 20 eager layers predict as 56.18 (+1.2%). With activation checkpointing a checkpointed
layer keeps only its input (2 x hidden B per token in bf16) and one layer's activations exist again during its
backward. The QLoRA, full fine-tuning and checkpointing terms are derived, not fitted; bench/RESULTS.md (sixth
round) holds them against measured peaks.

LoRA dropout keeps, per layer, the bool mask of every dropout it draws for backward (the dropped input itself is
recomputed from x and the mask): with lora.kernel grouped (and concat_b, and concat, which runs concat_b under
dropout) one mask over the hidden size for q/k/v and one for gate/up, with reference one per projection;
o_proj's and down_proj's each their own. Counted, not fitted: on the CPU (bfloat16, compiled, one Llama-3.2-3B
layer, /tmp script over bench/saved_bytes.py's hook) dropout added exactly three bool tensors, [N, 3072] x 2 and
[N, 8192], one mask fewer than this counts; on the H200 the 3B best_dropout row measured 56.79 GiB, which this
predicts as 54.19 (-4.6%), where the prediction without the masks was 46.75 (-17.7%). Where LoRA dropout runs
fused (method lora on a CUDA device with triton: gapless.kernels.lora_dropout draws the mask in its kernels from an
8-byte seed, forward and backward, and saves only x, which the A gradient keeps anyway) no mask is kept and none is
counted (lora_dropout_fused); QLoRA's layers keep the torch path and their masks.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gapless.config import ALL_LINEAR
from gapless.kernels.nf4 import BLOCKSIZE, SCALE_BLOCKSIZE
from gapless.model.decoder import ModelArgs

GIB = 2 ** 30
ACT_BYTES_PER_HIDDEN = 14.66  # per token per layer in bf16, fitted (module docstring)
ACT_BYTES_PER_INTERMEDIATE = 5.60
EAGER_ACTIVATION_FACTOR = 1.34  # uncompiled layers, from one 3B measurement
LOSS_BYTES_PER_LOGIT = 6.0  # per chunk token per vocabulary entry
ALLOCATOR_RESERVE = 0.05
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / BLOCKSIZE + 4 / (BLOCKSIZE * SCALE_BLOCKSIZE)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
METHODS = ("lora", "qlora", "full")


def projection_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in, out) of each of a decoder layer's seven projections."""
    D, I, q, kv = args.hidden_size, args.intermediate_size, args.num_attention_heads * args.head_dim, \
        args.num_key_value_heads * args.head_dim
    return {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D),
            "gate_proj": (D, I), "up_proj": (D, I), "down_proj": (I, D)}


def parameter_count(args: ModelArgs) -> tuple[int, int]:
    """(all parameters, those in the decoder layers' seven projections' weights); a tied lm_head counted once.
    Counted on the model built on the meta device (no memory), so every family's norms and biases are included."""
    import torch

    from gapless.model.decoder import CausalLM

    with torch.device("meta"):
        model = CausalLM(args)
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    return total, args.num_hidden_layers * sum(i * o for i, o in projection_shapes(args).values())


@dataclass
class MemoryEstimate:
    """Each component in bytes, in the order of the module docstring; `per_token` holds the part that grows with
    the tokens per micro-batch (so a token budget can be solved for: gapless.train.batch_finder)."""
    rows: list[tuple[str, float, str]] = field(default_factory=list)  # (component, bytes, how it was computed)
    fixed_bytes: float = 0.0  # everything that does not depend on the tokens per micro-batch
    per_token_bytes: float = 0.0
    tokens: int = 0

    @property
    def total_bytes(self) -> float:
        return sum(b for _, b, _ in self.rows)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def allocated_gib(self) -> float:
        """Comparable to torch.cuda.max_memory_allocated: the total without the allocator reserve."""
        return (self.total_bytes - dict((n, b) for n, b, _ in self.rows)["allocator reserve"]) / GIB


def estimate_memory(args: ModelArgs, method: str, *, tokens: int, dtype: str = "bfloat16", lora_r: int = 16,
                    lora_targets: Sequence[str] = ALL_LINEAR, activation_checkpointing: int = 0,
                    loss_chunk: int = 2048, compiled: bool = True, shards: int = 1, lora_dropout: float = 0.0,
                    lora_kernel: str = "concat_b", lora_dropout_fused: bool = False) -> MemoryEstimate:
    """The predicted peak of one training step with `tokens` tokens per micro-batch (module docstring), on one GPU.

    activation_checkpointing: 0 = off, k = every k-th layer checkpointed (model.activation_checkpointing).
    shards: the GPUs FSDP2 shards over (1: one GPU, or DDP, where every GPU holds a full replica). FSDP2
    (gapless.train.parallel.Sharded) divides the weights, the trainable copies, the gradients and the optimizer
    state by `shards`, and all-gathers whole layers only while they compute: one layer's parameters in the compute
    dtype for the layer running and one for the layer prefetched (FSDP2's default prefetch of one). Activations and
    the loss are per micro-batch: `tokens` is this GPU's micro-batch (the global batch / GPUs), not sharded.
    lora_dropout, lora_kernel: the masks LoRA dropout keeps (dropout_mask_bytes); none for method full, and none for
    method lora when lora_dropout_fused (the fused kernels keep a seed, not a mask: module docstring).
    """
    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not one of {list(METHODS)}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: {dtype!r} is not one of {list(DTYPE_BYTES)}")
    unknown = sorted(set(lora_targets) - set(ALL_LINEAR))
    if unknown:
        raise ValueError(f"lora targets: {unknown} not among {list(ALL_LINEAR)}")
    if tokens < 1 or loss_chunk < 1 or activation_checkpointing < 0 or shards < 1:
        raise ValueError(f"tokens ({tokens}) and loss_chunk ({loss_chunk}) must be >= 1, activation_checkpointing "
                         f"({activation_checkpointing}) >= 0, shards ({shards}) >= 1")
    e = DTYPE_BYTES[dtype]
    L, D, V = args.num_hidden_layers, args.hidden_size, args.vocab_size
    shapes = projection_shapes(args)
    total_params, _ = parameter_count(args)
    targeted = L * sum(i * o for name, (i, o) in shapes.items() if name in lora_targets)
    adapters = L * lora_r * sum(i + o for name, (i, o) in shapes.items() if name in lora_targets)
    rows: list[tuple[str, float, str]] = []

    if method == "qlora":
        rows.append(("weights", targeted * NF4_BYTES_PER_WEIGHT + (total_params - targeted) * e,
                     f"{targeted / 1e9:.2f}B targeted weights NF4 ({NF4_BYTES_PER_WEIGHT:.3f} B), "
                     f"{(total_params - targeted) / 1e9:.2f}B others {dtype}"))
    else:
        rows.append(("weights", total_params * e, f"{total_params / 1e9:.2f}B x {e} B ({dtype})"))
    trainable = total_params if method == "full" else adapters
    full_master = method == "full" and e != 4  # fp32 models train in place, no masters (train/optim.py)
    rows.append(("trainable fp32 copies", trainable * 4 * (method != "full" or full_master),
                 "fp32 master weights" if method == "full" else f"LoRA r{lora_r} adapters, {adapters / 1e6:.1f}M x 4 B"))
    largest_grad = max(V * D, max(i * o for i, o in shapes.values())) * e if full_master else 0
    rows.append(("gradients", trainable * 4 + largest_grad, "fp32, of the trainable tensors"
                 + (" + the largest bf16 gradient before its hook folds it" if full_master else "")))
    rows.append(("optimizer state", trainable * 8, "AdamW exp_avg + exp_avg_sq, fp32"))

    layer = (ACT_BYTES_PER_HIDDEN * D + ACT_BYTES_PER_INTERMEDIATE * args.intermediate_size) * e / 2
    if not compiled:
        layer *= EAGER_ACTIVATION_FACTOR
    keeps_masks = lora_dropout > 0 and (method == "qlora" or method == "lora" and not lora_dropout_fused)
    masks = dropout_mask_bytes(args, lora_targets, lora_kernel) if keeps_masks else 0
    layer += masks
    checkpointed = len(range(0, L, activation_checkpointing)) if activation_checkpointing else 0
    act_per_token = (L - checkpointed) * layer + checkpointed * D * e + (layer if checkpointed else 0)
    rows.append(("activations", tokens * act_per_token,
                 f"{tokens:,} tokens x ("
                 + (f"{L - checkpointed} layers x {layer / 1024:.1f} KiB" if checkpointed < L else "")
                 + (" + " if 0 < checkpointed < L else "")
                 + (f"{checkpointed} checkpointed x {D * e} B + one layer recomputed" if checkpointed else "")
                 + (", eager x 1.34" if not compiled else "")
                 + (f", with {masks:,} B of LoRA dropout masks a layer" if masks else "") + ")"))
    chunk = min(loss_chunk, tokens)
    rows.append(("loss working set", chunk * V * LOSS_BYTES_PER_LOGIT + tokens * D * e,
                 f"chunk {chunk:,} x vocab {V:,} x 6 B + final hidden states"))
    if method == "qlora":
        rows.append(("dequantised weights", targeted / L * e, "one layer's projections, transient"))
    if shards > 1:
        sharded = ("weights", "trainable fp32 copies", "gradients", "optimizer state")
        rows = [(n, b / shards, f"{how}; / {shards} GPUs (FSDP2)") if n in sharded else (n, b, how)
                for n, b, how in rows]
        layer_params = sum(i * o for i, o in shapes.values()) + 2 * D
        rows.append(("un-sharded layers", 2 * layer_params * e, "FSDP2: 2 layers all-gathered in "
                     f"{dtype} (the one computing, the one prefetched)"))
    subtotal = sum(b for _, b, _ in rows)
    rows.append(("allocator reserve", ALLOCATOR_RESERVE * subtotal, "5% (stated)"))

    per_token = (act_per_token + D * e + (V * LOSS_BYTES_PER_LOGIT if tokens < loss_chunk else 0)) \
        * (1 + ALLOCATOR_RESERVE)
    total = subtotal * (1 + ALLOCATOR_RESERVE)
    return MemoryEstimate(rows, fixed_bytes=total - tokens * per_token, per_token_bytes=per_token, tokens=tokens)


def dropout_mask_bytes(args: ModelArgs, targets: Sequence[str] = ALL_LINEAR, kernel: str = "concat_b") -> int:
    """Bytes per token per layer of the bool masks LoRA dropout keeps for backward: one byte per input feature of
    each mask drawn. grouped (and concat_b, which draws grouped's masks, and concat, which runs concat_b with
    dropout): the targeted projections that read the same input share one mask (q/k/v; gate/up); reference: one mask
    per targeted projection."""
    shapes = projection_shapes(args)
    if kernel == "reference":
        return sum(shapes[name][0] for name in targets)
    groups = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",)]
    return sum(shapes[g[0]][0] for g in groups if any(name in targets for name in g))


def max_tokens(args: ModelArgs, method: str, budget_gib: float, **kwargs) -> int:
    """The most tokens per micro-batch whose predicted total fits `budget_gib` (0 when even the fixed part
    does not); the loss chunk is taken as full (the budget a short batch needs is no larger)."""
    one = estimate_memory(args, method, tokens=max(kwargs.get("loss_chunk", 2048), 1), **kwargs)
    room = budget_gib * GIB - one.fixed_bytes
    return max(0, int(room // one.per_token_bytes))


def estimate_kwargs(cfg, compiled: bool | None = None, gpu: bool = True) -> dict:
    """estimate_memory's keyword arguments for a RunConfig. compiled: None = as on a GPU, where model.compile auto
    compiles (pass False for a CPU run); gpu: the run is on a GPU, where lora.fused_dropout draws LoRA dropout's
    masks in the fused kernels and keeps none (a plan for GPUs made on a CPU machine counts as a GPU run)."""
    from gapless.kernels.loss import DEFAULT_CHUNK_SIZE

    return {"dtype": cfg.model.dtype, "lora_r": cfg.lora.r, "lora_targets": cfg.lora.target_modules,
            "lora_dropout": cfg.lora.dropout, "lora_kernel": cfg.lora.kernel,
            "lora_dropout_fused": gpu and cfg.lora.fused_dropout,
            "activation_checkpointing": cfg.model.activation_checkpointing,
            "compiled": cfg.model.compile is not False if compiled is None else compiled,
            "loss_chunk": DEFAULT_CHUNK_SIZE}


def auto_tokens(args: ModelArgs, method: str, gpu_gib: float, max_seq_len: int, rows_per_batch: int | None = None,
                **kwargs) -> int:
    """What `data.tokens_per_batch: auto` is predicted to choose per GPU on a `gpu_gib` GPU by the memory model alone
    (gapless.train.batch_finder: the budget at 90% of the memory, backed off 10%, in whole rows of max_seq_len, at
    most data.rows_per_batch rows); 0 when not even one row fits. The run measures its own choice."""
    best = max_tokens(args, method, 0.9 * gpu_gib, **kwargs)
    if best < max_seq_len:
        return 0
    pick = int(best * 0.9) // max_seq_len * max_seq_len
    return pick if rows_per_batch is None else min(pick, rows_per_batch * max_seq_len)


def format_table(est: MemoryEstimate, title: str = "predicted peak memory") -> str:
    width = max(len(name) for name, _, _ in est.rows)
    lines = [f"{title} ({est.tokens:,} tokens per micro-batch)"]
    lines += [f"  {name:<{width}}  {b / GIB:8.2f} GiB  {how}" for name, b, how in est.rows]
    lines.append(f"  {'total':<{width}}  {est.total_gib:8.2f} GiB  "
                 f"(torch.cuda.max_memory_allocated would read ~{est.allocated_gib:.2f})")
    return "\n".join(lines)


# what `gapless train CONFIG --dry-run` assumes for the time when no --tokens-per-s is given: the dense bf16 peak
# measured on the H200 (~780 TFLOP/s, bench/RESULTS.md) at the MFU gapless measured there for Llama-3.2-3B LoRA
# (0.58-0.63 in bench/results.jsonl; 0.55 stated, a little below, for other models and methods)
STATED_PEAK_FLOPS = 780e12
STATED_MFU = 0.55


def dry_run_report(cfg, gpu_gib: float | None = None, tokens_per_s: float | None = None) -> str:
    """`gapless train CONFIG --dry-run`: the predicted peak memory (format_table) at the config's tokens per
    micro-batch (for "auto", what the batch finder would pick on a `gpu_gib` GPU by the memory model alone), the
    tokens per step, the steps, and the predicted time at `tokens_per_s` (else the stated H200 rate above).
    Reads and tokenizes the data (cached) to count the batches; loads no weights."""
    import math
    from dataclasses import replace

    import torch

    from gapless.data.pipeline import build_data
    from gapless.meter.flops import step_flops
    from gapless.model.loading import read_model_args
    from gapless.model.method import method_of

    args = read_model_args(cfg.model.path)
    estimate = estimate_kwargs(cfg)
    seq = cfg.data.max_seq_len
    lines = []
    tokens = cfg.data.tokens_per_batch
    if tokens == "auto":
        if gpu_gib is None:
            raise ValueError("--gpu-gib: data.tokens_per_batch is auto; give the GPU's memory in GiB (e.g. 80) to "
                             "predict what the batch finder picks")
        best = max_tokens(args, cfg.method, 0.9 * gpu_gib, **estimate)
        tokens = max(seq, auto_tokens(args, cfg.method, gpu_gib, seq, cfg.data.rows_per_batch, **estimate))
        rows = f", at most data.rows_per_batch {cfg.data.rows_per_batch:,} rows" if cfg.data.rows_per_batch else ""
        lines.append(f"data.tokens_per_batch auto: ~{tokens:,} on a {gpu_gib:g} GiB GPU by the memory model "
                     f"({best:,} at 90% of it, less 10%{rows}); the run measures its own choice")
    # tokens_per_batch bounds every batch's slots, data.rows_per_batch or not: the peak of the fullest batch
    est = estimate_memory(args, cfg.method, tokens=tokens, **estimate)
    lines.append(format_table(est, f"predicted peak memory, {cfg.method}, {cfg.model.dtype}"))
    if gpu_gib is not None:
        lines.append(f"  {'fits' if est.total_gib <= gpu_gib else 'does NOT fit'} a {gpu_gib:g} GiB GPU")

    mix, _, summary = build_data(replace(cfg.data, tokens_per_batch=tokens), cfg.data.tokenizer or cfg.model.path)
    k = cfg.train.grad_accum
    steps = cfg.train.steps or math.ceil(cfg.train.epochs * summary.batches_per_epoch / k)
    # the epoch's batches on average, not tokens x efficiency: padded batches of at most data.rows_per_batch
    # documents fill a small part of tokens_per_batch where the documents are short
    real_per_step = summary.train_tokens / max(summary.batches_per_epoch, 1) * k
    lengths = [int(n) for n in mix.lengths]
    flops_per_token = step_flops(args, lengths, **method_of(cfg).flops) / max(sum(lengths), 1)
    stated = tokens_per_s is None
    rate = STATED_PEAK_FLOPS * STATED_MFU / flops_per_token if stated else tokens_per_s
    seconds = steps * real_per_step / rate
    docs = f", at most {cfg.data.rows_per_batch * k:,} documents" if cfg.data.rows_per_batch else ""
    lines.append(f"tokens per step: {tokens * k:,} slots ({k} x {tokens:,}){docs}, ~{real_per_step:,.0f} real at "
                 f"{100 * summary.packing_efficiency:.1f}% packing; steps: {steps:,}")
    lines.append(f"predicted time: {seconds / 3600:.2f} h at {rate:,.0f} real tokens/s "
                 + (f"(stated: {STATED_PEAK_FLOPS / 1e12:.0f} TFLOP/s x MFU {STATED_MFU} / "
                    f"{flops_per_token / 1e9:.1f} GFLOP per token; pass --tokens-per-s for a measured rate)"
                    if stated else "(given)"))
    where = ("model.device cpu" if cfg.model.device == "cpu" else
             "model.device auto, no GPU here" if cfg.model.device == "auto" and not torch.cuda.is_available() else None)
    if stated and where:  # the stated rate is an H200's: the demo's model trains ~6,500 tokens/s on a CPU, not 2e8
        lines.append(f"  that rate is an H200's; this run trains on the CPU ({where}), orders of magnitude slower: "
                     "pass --tokens-per-s with a measured rate (`gapless doctor RUN` prints a run's)")
    return "\n".join(lines)
