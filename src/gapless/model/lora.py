"""LoRA as a transform of a built model, saved and loaded in PEFT's format, and merged for export.

`apply_lora` swaps each targeted nn.Linear for a LoraLinear that keeps the base `weight`/`bias`
under the same names (so base keys stay HF's) and adds `lora_A`/`lora_B`, so our key
`model.layers.0.self_attn.q_proj.lora_A.weight` is PEFT's saved key minus `base_model.model.`; for a family whose
transformers class holds the decoder elsewhere (Gemma 3's image-text class: model.language_model) the `model.` of
our names becomes that path in PEFT's keys and target_modules (peft_name).
The update is PEFT's: y = W x + b + scaling * B A dropout(x), scaling = alpha / r (alpha / sqrt(r)
with rsLoRA), A Kaiming-uniform and B zero so the adapted model starts equal to the base. LoraConfig.kernel
picks how it runs: the plain formula one layer at a time, or with one A matmul (and one dropout mask) for the
layers that read the same input (q/k/v, gate/up: LoraLinear.group_forward; gapless.kernels.lora), or ("concat")
with the frozen projections and the A matrices of those layers as one GEMM (concat_lora_weights).
"""
from __future__ import annotations

import functools
import json
import math
import re
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from gapless.config import ALL_LINEAR, CONCAT_KERNELS, LoraConfig, LoraKernel
from gapless.kernels.lora import lora_linear_concat, lora_linear_concat_b, lora_linear_grouped, lora_linear_reference
from gapless.kernels.lora_dropout import FusedDropout
from gapless.model.export import atomic_folder, save_pretrained  # noqa: F401  (save_pretrained: merged export)
from gapless.model.families import family
from gapless.model.loading import PICKLE_SUFFIXES

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# adapter_config.json keys that describe the file or only the initialisation, never the loaded math
_INFORMATIONAL = {"peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                  "inference_mode", "megatron_core", "qalora_group_size", "loftq_config", "eva_config",
                  "corda_config", "lora_ga_config", "layers_pattern", "ensure_weight_tying"}
# the keys we read; any other key with a non-empty value is an option we do not implement
_READ = {"r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "use_rslora", "bias",
         "init_lora_weights", "fan_in_fan_out"}
# init_lora_weights values whose adapters are plain LoRA on the unchanged base: they only choose A's and B's starting
# values (EVA: A from activations' SVD, B zero; orthogonal: A and B from one orthogonal matrix; peft 0.22's NoRA: A's
# columns normalised, B zero; MiCA: B from the base weight's last singular vectors, A zero, B frozen in training).
# PiSSA, OLoRA, CorDA, Astra, LoftQ and LoRA-GA instead rewrite the base weights at initialisation, which the
# adapter's file does not hold.
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "nora", "mica")


class LoraLinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update, with PEFT's parameter names."""

    def __init__(self, base: nn.Linear, r: int, scaling: float, dropout: float, dtype: torch.dtype, *,
                 kernel: LoraKernel, fused_dropout: bool = True):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        # the base layer's own Parameters, not copies: same memory, same state-dict keys
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias)
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=dtype)
        # FusedDropout: the mask drawn inside the A matmul's kernels where they run (gapless.kernels.lora_dropout)
        drop = FusedDropout if fused_dropout else nn.Dropout
        self.lora_dropout = drop(dropout) if dropout > 0 else nn.Identity()
        self.scaling = scaling
        # "reference": the plain formula autograd differentiates, one layer at a time; "grouped": the same formula,
        # with the A matmuls of layers reading the same input as one (group_forward)
        # "concat": the frozen weights and the A rows of the layers that read the same input as one GEMM, over a
        # buffer that concat_lora_weights builds once the weights exist (until then these layers run "grouped")
        self.kernel = kernel
        # [sum out + sum r, in] in the weights' dtype, shared by the layers of one group; `weight` is a view into it
        self.register_buffer("lora_concat", None, persistent=False)
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        # PEFT's init_lora_weights=True: nn.Linear's own Kaiming-uniform for A, zeros for B
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: Tensor) -> Tensor:
        if self.lora_concat is not None:  # o_proj, down_proj: [W; A] as one GEMM (concat_b too: _b_inside)
            return _concat_forward(x, [self])[0]
        return lora_linear_reference(x, self.weight, self.bias, self.lora_A.weight, self.lora_B.weight, self.scaling,
                                     dropout=self.lora_dropout)

    @staticmethod
    def group_forward(x: Tensor, layers: Sequence[nn.Module]) -> list[Tensor]:
        """The layers applied to the same x (the decoder's `project`): LoRA layers of kernel "grouped" share one
        matmul for their A matrices (gapless.kernels.lora.lora_linear_grouped) and, in training with dropout, one
        dropout mask on x (the kernel's docstring says how that differs from PEFT's mask per projection; on CUDA with
        triton the mask is drawn inside the fused kernel, gapless.kernels.lora_dropout, from the nn.Dropout's p and
        training flag); any other layer runs alone."""
        # no id() or dicts of modules: under torch.compile they would make every decoder layer's graph its own
        # (guards on each module's identity) and past dynamo's recompile limit (8) the other layers run eager
        concat = [getattr(layer, "lora_concat", None) is not None for layer in layers]
        if any(concat):  # the layers concat_lora_weights put in one buffer, in this order; the others alone
            outs = iter(_concat_forward(x, [layer for layer, join in zip(layers, concat) if join]))
            return [next(outs) if join else layer(x) for layer, join in zip(layers, concat)]
        # "concat" layers whose buffer is not built yet run grouped: the same sums
        joins = [isinstance(layer, LoraLinear) and layer.kernel in ("grouped", *CONCAT_KERNELS) for layer in layers]
        grouped = [layer for layer, join in zip(layers, joins) if join]
        if len(grouped) < 2:
            return [layer(x) for layer in layers]
        outs = iter(lora_linear_grouped(
            x, [g.weight for g in grouped], [g.bias for g in grouped], [g.lora_A.weight for g in grouped],
            [g.lora_B.weight for g in grouped], [g.scaling for g in grouped], dropout=grouped[0].lora_dropout))
        return [next(outs) if join else layer(x) for layer, join in zip(layers, joins)]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"r={self.lora_A.out_features}, scaling={self.scaling:g}, kernel={self.kernel}")


def _concat_forward(x: Tensor, members: Sequence[LoraLinear]) -> list[Tensor]:
    """The layers of one concat buffer (concat_lora_weights' order) applied to x: lora_linear_concat_b with the
    group's dropout where the B matrices are inside (_b_inside), else lora_linear_concat."""
    args = (x, members[0].lora_concat, [m.bias for m in members], [m.lora_A.weight for m in members],
            [m.lora_B.weight for m in members], [m.scaling for m in members])
    if _b_inside(members):
        return lora_linear_concat_b(*args, dropout=members[0].lora_dropout)
    return lora_linear_concat(*args)


def _b_inside(group: Sequence[LoraLinear]) -> bool:
    """Whether kernel "concat_b" puts this group's B matrices inside its base GEMM: for the layers that read the
    same input (q/k/v, gate/up), whose [N, out] B products concat writes and reads again (gate/up's two: 1.07 GB a
    Llama-3.2-3B layer at 16,384 tokens). A layer alone (o_proj, down_proj) runs concat's [W; A] instead: with its B
    inside, [x, x A^T] copies x (down_proj's h: 268 MB) for its GEMM, and dx takes two [N, in] products and an add
    where concat's one GEMM over [dy, dxa] writes one. concat_b on every layer ran 0.84% slower than concat on an
    H100 (run s16-ab: forward 2 ms shorter, backward 7 ms longer); by their bytes (not profiled) the layers alone
    cost about 6 ms forward and 4-9 ms backward of that, and the groups saved about 8 ms forward."""
    return group[0].kernel == "concat_b" and len(group) > 1


def _lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


# The groups of projections the decoder applies to one input (gapless.model.decoder: project(x, q, k, v) and
# project(x, gate, up)), in its order; every other LoRA layer (o_proj, down_proj) is a group of one.
CONCAT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def concat_lora_weights(model: nn.Module) -> nn.Module:
    """Give the LoRA layers of kernel "concat" their concatenated buffer [W_1; ..; W_k; A_1; ..; A_k] per group
    (gapless.kernels.lora.lora_linear_concat), and the groups of several layers of kernel "concat_b" theirs,
    [[W_1, s_1 B_1, 0 ..], ..] (_concat_b_buffer; its layers alone get concat's, or none under dropout:
    _b_inside), once the weights exist (Lora.initialise after loading; apply_lora on a loaded model); groups
    still on the meta device are left for later. What follows says it for concat; concat_b is the same with the
    scaled B blocks in place of the A rows (its weights are strided views: each row is in + sum r long).

    The base weights live once: each layer's `weight` becomes a Parameter viewing its rows of the buffer (same
    state-dict keys and values; load_state_dict and merge_lora read and write them there) and the loaded tensor is
    freed, so memory grows by the A rows only (r rows per layer in the weights' dtype: 24 MB, 0.4%, for
    Llama-3.2-3B at r=16) plus, while one group is built, one group's copy (100 MB for its gate/up).

    A forward pre-hook on the embedding copies the float32 master A into the buffers' A rows before every pass
    over the layers (forward, or generation's hidden_states), in eager, so an optimizer step or a resume is seen by
    the next forward: 7 [16, in] copies per layer, ~2.6 MB of
    reads and writes per Llama-3.2-3B layer, ~72 MB (~20 us on the H200) per step against its ~450 ms, where
    copying the whole weight would move ~6 GB. Not inside the compiled layers: a write into a slice of a graph
    input is functionalised and may copy the whole buffer.

    Only exactly-LoraLinear layers join (QLoRA's layers keep their own path). `.to()` afterwards would split the
    views from the buffer: build it on the device it trains on. The buffer is a (non-persistent) module buffer:
    DistributedDataParallel over the whole module would broadcast it, the weights, every step (broadcast_buffers);
    gapless's DDP (torch's composable replicate, gapless.train.parallel) hands DDP a list of the parameters alone,
    so no buffer is sent. Not for FSDP2, which shards each weight.
    """
    pairs = getattr(model, "_lora_concat_rows", [])
    for parent in model.modules():
        children = {name: m for name, m in parent.named_children()
                    if type(m) is LoraLinear and m.kernel in CONCAT_KERNELS and m.lora_concat is None}
        groups = [[children[n] for n in names if n in children] for names in CONCAT_GROUPS]
        groups += [[m] for n, m in children.items() if not any(n in names for names in CONCAT_GROUPS)]
        for group in groups:
            tensors = [t for m in group for t in (m.weight, m.lora_A.weight)]
            if not group or any(t.is_meta for t in tensors):
                continue
            dtype = group[0].weight.dtype
            assert all(m.weight.dtype == dtype and m.weight.device == group[0].weight.device for m in group), (
                "the layers of one group hold their weights in one dtype on one device")
            if group[0].kernel == "concat_b" and not _b_inside(group) \
                    and not isinstance(group[0].lora_dropout, nn.Identity):
                continue  # a layer alone under dropout: concat's A rows cannot read dropout(x); the formula runs
            build = _concat_b_buffer if _b_inside(group) else _concat_buffer
            pairs += build(group, dtype)
    if pairs and not hasattr(model, "_lora_concat_rows"):
        model._lora_concat_rows = pairs
        # on the embedding, the first module every pass over the layers calls (eagerly): CausalLM.forward, and
        # hidden_states alone, which generation calls without forward (a hook on the model missed it: generation
        # read stale A rows, or concat_b's initial zero B blocks)
        first = getattr(getattr(model, "model", None), "embed_tokens", model)
        model._lora_concat_hook = first.register_forward_pre_hook(functools.partial(_refresh_concat_rows, model))
    return model


@torch.no_grad()
def _concat_buffer(group: list[LoraLinear], dtype: torch.dtype) -> list[tuple[Tensor, Tensor, float]]:
    """kernel "concat": [W_1; ..; W_k; A_1; ..; A_k] [sum out + sum r, in]; each `weight` becomes a view of its rows.
    Returns (the buffer's A rows, the master A, 1.0) per layer, for _refresh_concat_rows."""
    buffer = torch.cat([m.weight for m in group] + [m.lora_A.weight.to(dtype) for m in group])
    row, pairs = 0, []
    for m in group:
        m.weight = nn.Parameter(buffer[row:row + m.out_features], requires_grad=m.weight.requires_grad)
        m.lora_concat = buffer
        row += m.out_features
    for m in group:
        r = m.lora_A.out_features
        pairs.append((buffer[row:row + r], m.lora_A.weight, 1.0))
        row += r
    return pairs


@torch.no_grad()
def _concat_b_buffer(group: list[LoraLinear], dtype: torch.dtype) -> list[tuple[Tensor, Tensor, float]]:
    """kernel "concat_b": [[W_1, s_1 B_1, 0 ..], [W_2, 0, s_2 B_2 ..] ..] [sum out, in + sum r] (the B matrices
    block-diagonal beside the weights, gapless.kernels.lora.lora_linear_concat_b); each `weight` becomes a view of
    its rows' first `in` columns (strided: a row is in + sum r long). Returns (the B block, the master B, scaling)
    per layer, for _refresh_concat_rows."""
    width, ranks = group[0].in_features, [m.lora_A.out_features for m in group]
    buffer = group[0].weight.new_zeros(sum(m.out_features for m in group), width + sum(ranks), dtype=dtype)
    row, col, pairs = 0, width, []
    for m, r in zip(group, ranks):
        rows = slice(row, row + m.out_features)
        buffer[rows, :width] = m.weight
        m.weight = nn.Parameter(buffer[rows, :width], requires_grad=m.weight.requires_grad)
        m.lora_concat = buffer
        pairs.append((buffer[rows, col:col + r], m.lora_B.weight, m.scaling))
        row, col = row + m.out_features, col + r
    return pairs


@torch.no_grad()
def _refresh_concat_rows(model: nn.Module, module: nn.Module, args) -> None:
    """The buffers' adapter rows (concat: A) or columns (concat_b: scaling * B) from the float32 masters
    (concat_lora_weights): before every forward, in eager."""
    parts, masters, scalings = zip(*model._lora_concat_rows)
    if any(s != 1.0 for s in scalings):  # concat_b's s_i B_i; concat's A rows are copies (no temporaries)
        masters = torch._foreach_mul(list(masters), list(scalings))
    torch._foreach_copy_(list(parts), list(masters))


def apply_lora(model: nn.Module, cfg: LoraConfig, *, adapter_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Add LoRA to the decoder layers' linear projections named by cfg.target_modules; freeze all else.

    kernel "concat" with dropout > 0 runs "concat_b" (the default), the same sums: concat's A rows would read
    dropout(x), its base rows x, so they cannot share one GEMM; concat_b's rank-R GEMM alone reads dropout(x)
    (gapless.config.LoraKernel)."""
    cfg.validate()
    kernel = "concat_b" if cfg.kernel == "concat" and cfg.dropout > 0 else cfg.kernel
    if _lora_layers(model):
        raise ValueError("the model already has LoRA layers; apply LoRA (or load an adapter) once, to a plain model")
    targets = [name for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.startswith("model.layers.")
               and name.rsplit(".", 1)[-1] in cfg.target_modules]
    assert targets, f"no linear layers named {cfg.target_modules} under model.layers"
    for name in targets:
        _set_submodule(model, name, LoraLinear(model.get_submodule(name), cfg.r, cfg.scaling, cfg.dropout,
                                               adapter_dtype, kernel=kernel, fused_dropout=cfg.fused_dropout))
    for name, p in model.named_parameters():
        p.requires_grad = name.endswith((".lora_A.weight", ".lora_B.weight"))
    model.lora_config = cfg
    return concat_lora_weights(model)


def peft_name(model: nn.Module, name: str) -> str:
    """Our module or tensor name as transformers names it in the family's class, which PEFT's keys and
    target_modules use: `model.` becomes the family's decoder_module (Gemma 3 image-text: model.language_model)."""
    decoder = family(model.args.model_type).decoder_module
    return decoder + name[len("model"):] if name.startswith("model.") else name


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapter weights under PEFT's saved key names (`base_model.model.` + peft_name)."""
    return {PEFT_PREFIX + peft_name(model, k): v for k, v in model.state_dict().items()
            if ".lora_A." in k or ".lora_B." in k}


def save_adapter(model: nn.Module, out_dir: str | Path, cfg: LoraConfig | None = None,
                 base_model_name_or_path: str | None = None) -> Path:
    """Write adapter_config.json + adapter_model.safetensors that peft.PeftModel.from_pretrained loads.

    cfg defaults to the one apply_lora used; base_model_name_or_path to the folder the model came from.
    """
    cfg = cfg or getattr(model, "lora_config", None)
    if cfg is None or not _lora_layers(model):
        raise ValueError("the model has no LoRA layers to save; call apply_lora(model, cfg) first")
    source = getattr(model, "source_dir", None)
    base = base_model_name_or_path or (str(Path(source).resolve()) if source else None)
    if base is None:
        raise ValueError("save_adapter: pass base_model_name_or_path (a hub id or the base model's folder)")
    out = Path(out_dir)
    alpha = int(cfg.alpha) if float(cfg.alpha).is_integer() else cfg.alpha
    targets: list[str] | str = list(cfg.target_modules)
    decoder = family(model.args.model_type).decoder_module
    if decoder != "model":
        # short names would also adapt the layers of that name outside the decoder (Gemma 3's vision tower has
        # q_proj/k_proj/v_proj): a regular expression (PEFT fullmatches it to module names) keeps to the decoder
        targets = rf"{re.escape(decoder)}\.layers\.\d+\.(self_attn|mlp)\.({'|'.join(cfg.target_modules)})"
    # keys every peft >= 0.13 knows; the rest of PEFT's options keep their defaults
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "revision": None,
        "inference_mode": True, "r": cfg.r, "lora_alpha": alpha, "lora_dropout": cfg.dropout,
        "target_modules": targets, "use_rslora": cfg.use_rslora, "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False,
    }
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in lora_state_dict(model).items()}
    with atomic_folder(out, ADAPTER_CONFIG) as tmp:  # a full disk or a kill leaves no adapter that looks complete
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return out


def read_adapter_config(adapter_dir: str | Path, model: nn.Module) -> LoraConfig:
    """A LoraConfig from PEFT's adapter_config.json for `model`; options gapless does not implement are refused."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise ValueError(f"{path}: not found; a PEFT adapter folder holds adapter_config.json and "
                         f"{ADAPTER_WEIGHTS}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {raw.get('peft_type')!r} is not supported; gapless loads LORA adapters")
    if raw.get("task_type") not in (None, "CAUSAL_LM"):
        raise ValueError(f"{path}: task_type {raw['task_type']!r} is not supported; gapless loads CAUSAL_LM adapters")
    # an unset option is null, false or empty; 0 is a value (layers_to_transform 0: PEFT adapts layer 0 alone)
    refused = [k for k, v in raw.items() if k not in _INFORMATIONAL | _READ
               and not (v is None or v is False or (isinstance(v, (dict, list, str)) and not v))]
    if raw.get("bias", "none") != "none":
        refused.append("bias")
    if raw.get("fan_in_fan_out"):
        refused.append("fan_in_fan_out")
    if raw.get("init_lora_weights", True) not in _PLAIN_INITS:
        # PiSSA, OLoRA, CorDA, LoftQ... adapters assume a base model rewritten at initialisation
        refused.append("init_lora_weights")
    if refused:
        raise ValueError(f"{path}: {', '.join(f'{k}={raw[k]!r}' for k in refused)} not supported; gapless loads "
                         "plain LoRA adapters (r, lora_alpha, lora_dropout, target_modules, exclude_modules, "
                         "use_rslora) only, and will not ignore an option that changes the model")
    for key in ("r", "lora_alpha"):
        if key not in raw:
            raise ValueError(f"{path}: {key}: required field is missing")
    cfg = LoraConfig(r=raw["r"], alpha=float(raw["lora_alpha"]), dropout=float(raw.get("lora_dropout", 0.0)),
                     target_modules=_resolve_targets(raw.get("target_modules"), model, path,
                                                     exclude=raw.get("exclude_modules")),
                     use_rslora=bool(raw.get("use_rslora", False)))
    cfg.validate(where=str(path))
    return cfg


def _matching(names: list[str], targets: list | str, path: Path, key: str) -> dict[str, str | None]:
    """The names PEFT's `key` (target_modules or exclude_modules) selects, each with the list entry that selected it
    (None for a regular expression): a string is a regular expression that must match a module's whole name; a list
    entry selects the module of that name and every module whose name ends with "." + entry."""
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as e:
            raise ValueError(f"{path}: {key} {targets!r}: not a valid regular expression ({e})") from None
        return {name: None for name in names if pattern.fullmatch(name)}
    return {name: t for name in names for t in targets if name == t or name.endswith("." + t)}


def _resolve_targets(targets, model: nn.Module, path: Path, exclude=None) -> list[str]:
    """PEFT's target_modules (short names, full module paths, a regular expression, or "all-linear") less its
    exclude_modules (the same forms) -> our short names.

    PEFT adapts every module that target_modules selects (_matching) and exclude_modules does not, and skips entries
    that match nothing. Names are transformers' (peft_name). The result must be whole projection kinds on every
    layer, which is what LoraConfig can express.
    """
    if not isinstance(targets, (list, str)):
        raise ValueError(f"{path}: target_modules {targets!r}: expected a list of module names or a regular "
                         f"expression, among {list(ALL_LINEAR)}")
    if exclude is not None and not isinstance(exclude, (list, str)):
        raise ValueError(f"{path}: exclude_modules {exclude!r}: expected a list of module names or a regular "
                         "expression")
    names = [peft_name(model, name) for name, _ in model.named_modules()]
    adaptable = {peft_name(model, name) for name, m in model.named_modules() if isinstance(m, nn.Linear)
                 and name.startswith("model.layers.") and name.rsplit(".", 1)[-1] in ALL_LINEAR}
    if targets == "all-linear":  # PEFT's shorthand: every linear layer but the output head
        selected = dict.fromkeys(adaptable)
    else:
        selected = _matching(names, targets, path, "target_modules")
    for name in _matching(names, exclude, path, "exclude_modules") if exclude else ():
        selected.pop(name, None)
    matched = set(selected)
    outside = sorted({name if t is None else t for name, t in selected.items() if name not in adaptable})
    if outside:
        raise ValueError(f"{path}: target_modules: {outside[:4]} not supported; gapless puts LoRA only on "
                         f"{list(ALL_LINEAR)} of the decoder layers")
    kinds = {name.rsplit(".", 1)[-1] for name in matched}
    partial = sorted({name for name in adaptable if name.rsplit(".", 1)[-1] in kinds} - matched)
    if partial:
        raise ValueError(f"{path}: target_modules adapts some layers but not {partial[:4]}...; gapless adapts "
                         "a projection on every layer or on none")
    return [t for t in ALL_LINEAR if t in kinds]


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> tuple[nn.Module, LoraConfig]:
    """Apply LoRA as a PEFT adapter folder describes it and load its weights; returns (model, its LoraConfig)."""
    adapter_dir = Path(adapter_dir)
    if _lora_layers(model):
        raise ValueError("the model already has LoRA layers; load an adapter onto a plain model")
    cfg = read_adapter_config(adapter_dir, model)
    _adapter_weights(adapter_dir)
    apply_lora(model, cfg)
    load_adapter_weights(model, adapter_dir, cfg)
    return model, cfg


def _adapter_weights(adapter_dir: Path) -> Path:
    weights = adapter_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickles = sorted(p.name for p in adapter_dir.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
        raise ValueError(f"{weights}: not found" + (
            f"; {', '.join(pickles)} is a pickle, which gapless never unpickles: re-save the adapter with "
            "PEFT's save_pretrained(out_dir, safe_serialization=True)" if pickles else ""))
    return weights


def load_adapter_weights(model: nn.Module, adapter_dir: str | Path, cfg: LoraConfig) -> nn.Module:
    """Copy a PEFT adapter folder's A and B into `model`'s LoRA layers, applied as `cfg` (read_adapter_config) says
    and materialised (a QLoRA model rebuilt as its run built it: gapless.model.method.Qlora.load_final)."""
    adapter_dir = Path(adapter_dir)
    weights = _adapter_weights(adapter_dir)
    ours = {PEFT_PREFIX + peft_name(model, k): v for k, v in model.state_dict().items()}
    fam = family(model.args.model_type)
    with safe_open(weights, framework="pt") as st:
        # our key -> the file's: the same, or for an image-text family the checkpoint's layout that transformers
        # before 4.52 gave the class and PEFT adapters of then were saved under (Gemma 3:
        # base_model.model.language_model.model.layers.0..., not ...model.language_model.layers.0...), which
        # PEFT still loads, renaming the keys by transformers' conversion mapping
        old = PEFT_PREFIX + fam.checkpoint_prefix
        in_file = {(PEFT_PREFIX + peft_name(model, key[len(old):])
                    if fam.checkpoint_prefix and key.startswith(old + "model.") else key): key for key in st.keys()}
        found = set(in_file)
        expected = set(lora_state_dict(model))
        decoder = PEFT_PREFIX + fam.decoder_module + "."
        if decoder != PEFT_PREFIX + "model.":
            # an image-text class: PEFT's short target names also adapt the vision tower's layers of that name, which
            # gapless does not hold (it trains the text decoder); text-only inputs never reach them
            others = sorted(k for k in found - expected if not k.startswith(decoder))
            if others:
                warnings.warn(f"{weights}: {len(others)} tensors outside the text decoder ({others[0]}, ...) are "
                              "not loaded: gapless runs the text decoder only", stacklevel=3)
                found -= set(others)
        missing, unexpected = sorted(expected - found), sorted(found - expected)
        if missing or unexpected:
            raise ValueError(f"{weights}: does not match adapter_config.json on this model; "
                             f"missing keys: {missing}; unexpected keys: {unexpected}")
        for key in sorted(expected):
            ours_t = ours[key]
            shape = tuple(st.get_slice(in_file[key]).get_shape())
            if shape != tuple(ours_t.shape):
                raise ValueError(f"{weights}: {in_file[key]} has shape {list(shape)}, but the model and r={cfg.r} "
                                 f"imply {list(ours_t.shape)}")
            with torch.no_grad():
                ours_t.copy_(st.get_tensor(in_file[key]))
    return model


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA update into its base weight (W + scaling * B A) and go back to plain nn.Linear."""
    for name, layer in _lora_layers(model).items():
        delta = (layer.lora_B.weight.float() @ layer.lora_A.weight.float()) * layer.scaling  # [out, in]
        merged = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        merged.weight = nn.Parameter((layer.weight.float() + delta).to(layer.weight.dtype),
                                     requires_grad=layer.weight.requires_grad)
        merged.bias = layer.bias
        _set_submodule(model, name, merged)
    if hasattr(model, "_lora_concat_hook"):  # the concat buffers go with their layers
        model._lora_concat_hook.remove()
        del model._lora_concat_hook, model._lora_concat_rows
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model
