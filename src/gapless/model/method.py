"""A fine-tuning method as one object: what the loop, export, bench and the meter ask, so none reads `cfg.lora`.

A method says
- `transform(model)`: the change to the plain model built on the meta device (LoRA swaps the targeted linears
  for LoraLinear layers), and which parameters train (`requires_grad`);
- `load_hook`: the per-tensor hook through which the checkpoint's weights stream in (None: plain assignment;
  QLoRA quantises there), and `initialise(model, device)`: the tensors the checkpoint does not hold (LoRA's A
  and B) materialised on the device and given their initial values;
- `trainable(model)`: the parameters the optimizer updates, by name, in their training precision;
- `flops`: the arguments of gapless.meter.flops.step_flops that count its useful FLOPs per step;
- `checkpoint_state(model)` / `load_checkpoint_state(model, tensors)`: what a checkpoint holds (the trainable
  tensors) and how a resume puts it back;
- `final_name` and `save_final(...)`: what the end of a run writes (a PEFT adapter folder for LoRA);
- `load_final(...)`: that save back as the model the run trained, for `gapless generate`, `chat` and `eval` (QLoRA:
  the adapter on the NF4 base, not on the unquantised one, whose outputs and loss differ).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from gapless.config import LoraConfig, RunConfig
from gapless.model.export import save_pretrained
from gapless.model.loading import DTYPES, LoadHook, build, load_model, load_weights
from gapless.model.lora import (LoraLinear, apply_lora, concat_lora_weights, load_adapter, load_adapter_weights,
                                read_adapter_config, save_adapter)
from gapless.model.qlora import apply_qlora, QloraLoadHook, to_qlora


class Method:
    name: str
    final_name: str  # the run folder's subfolder that `save_final` writes
    load_hook: LoadHook | None = None
    final_holds_base = False  # the final save holds every weight (no base model under it)
    quantised_base: str | None = None  # the frozen base's storage where it is not the model's dtype ("NF4")

    def transform(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def initialise(self, model: nn.Module, device: torch.device) -> nn.Module:
        """Materialise and initialise what the checkpoint does not hold; after `load_weights`."""
        return model

    @property
    def flops(self) -> dict:
        raise NotImplementedError

    def trainable(self, model: nn.Module) -> dict[str, nn.Parameter]:
        return {n: p for n, p in model.named_parameters() if p.requires_grad}

    def checkpoint_state(self, model: nn.Module) -> dict[str, Tensor]:
        return self.trainable(model)

    def load_checkpoint_state(self, model: nn.Module, tensors: dict[str, Tensor], where: str) -> None:
        trainable = self.trainable(model)
        missing = sorted(set(trainable) - set(tensors))
        if missing:
            raise ValueError(f"{where}: the checkpoint lacks trainable tensors {missing[:5]}; was it written by a run "
                             f"with other method settings than {self.describe()}?")
        with torch.no_grad():
            for name, p in trainable.items():
                p.copy_(tensors[name])

    def save_final(self, model: nn.Module, out: Path, base_model: Path) -> Path:
        raise NotImplementedError

    def load_final(self, final: Path, base_model: Path, dtype: torch.dtype, device: torch.device | str, *,
                   unquantised_base: bool = False) -> tuple[nn.Module, str]:
        """What `save_final` wrote to `final`, back in eval mode in `dtype` on `device` for generation and
        evaluation, built as the run built it; and words that say what was loaded, the base's precision included.
        `unquantised_base`: a quantised base (`quantised_base`) loaded as the checkpoint holds it, in `dtype`."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


class Lora(Method):
    """LoRA (Hu et al. 2021) on the frozen base in the model's dtype; adapters in float32 (their matmuls run in the
    activations' dtype: gapless.kernels.lora), saved as a PEFT adapter."""
    name = "lora"
    final_name = "adapter"

    def __init__(self, cfg: LoraConfig):
        self.cfg = cfg

    def transform(self, model: nn.Module) -> nn.Module:
        return apply_lora(model, self.cfg)

    def initialise(self, model: nn.Module, device: torch.device) -> nn.Module:
        for layer in model.modules():
            if isinstance(layer, LoraLinear) and layer.lora_A.weight.is_meta:
                layer.lora_A.to_empty(device=device)
                layer.lora_B.to_empty(device=device)
                layer.reset_lora_parameters()
        return concat_lora_weights(model)  # lora.kernel concat / concat_b: their buffers, now that the weights exist

    @property
    def flops(self) -> dict:
        return {"method": "lora", "lora_r": self.cfg.r, "lora_targets": self.cfg.target_modules}

    def save_final(self, model: nn.Module, out: Path, base_model: Path) -> Path:
        return save_adapter(model, out, self.cfg, base_model_name_or_path=str(Path(base_model).resolve()))

    def load_final(self, final: Path, base_model: Path, dtype: torch.dtype, device: torch.device | str, *,
                   unquantised_base: bool = False) -> tuple[nn.Module, str]:
        # the adapter's own adapter_config.json says r, alpha and targets (the run's lora settings, as saved)
        model, _ = load_adapter(load_model(base_model, dtype=dtype, device=device), final)
        return model.eval(), f"adapter {final} on {base_model}"

    def describe(self) -> str:
        return f"lora r={self.cfg.r} alpha={self.cfg.alpha:g} on {','.join(self.cfg.target_modules)}"


class Qlora(Lora):
    """QLoRA (Dettmers et al. 2023): LoRA as above on a base whose targeted projections are stored as NF4 with
    double quantisation (gapless.model.qlora), quantised from the checkpoint's tensors as they stream in; the
    adapter is saved exactly as LoRA's (PEFT format). `compute_dtype`: the activations' dtype (model.dtype), the
    dtype each projection is dequantised to for its GEMM."""
    name = "qlora"
    quantised_base = "NF4"

    def __init__(self, cfg: LoraConfig, compute_dtype: torch.dtype):
        super().__init__(cfg)
        self.compute_dtype = compute_dtype
        # the dtype the run holds its weights in, which it quantises from; stays when a merge dequantises to another
        # compute_dtype (gapless.train.export)
        self.quantise_from = compute_dtype

    def transform(self, model: nn.Module) -> nn.Module:
        model = to_qlora(super().transform(model), self.compute_dtype, self.quantise_from)
        # the base weights of the NF4 layers are consumed (quantised) by the hook as they are loaded
        self.load_hook = QloraLoadHook(model, self.quantise_from)
        return model

    def load_final(self, final: Path, base_model: Path, dtype: torch.dtype, device: torch.device | str, *,
                   unquantised_base: bool = False) -> tuple[nn.Module, str]:
        """The adapter on the NF4 base it trained on, assembled as the run assembled it: built on the meta device,
        LoRA and the NF4 layers applied, the checkpoint streamed through the quantising hook (so the base never
        exists whole in `dtype`: a base that fits the GPU only as NF4 fits here too), then the adapter's A and B.
        Each weight is rounded to the run's dtype before it is quantised, so the NF4 codes are the run's also when
        `dtype` differs (float32 on the CPU for a bfloat16 run); the layers dequantise to `dtype`. In the run's
        dtype and device this is the model the run evaluated: `gapless eval` on its eval data gives its eval loss.
        `unquantised_base`: the adapter on the base as the checkpoint holds it, as a LoRA run's (what serving the
        adapter on the original weights gives; `gapless export --merge` merges into the dequantised NF4 base)."""
        dtype_name = str(dtype).removeprefix("torch.")
        if unquantised_base:
            model, what = super().load_final(final, base_model, dtype, device)
            return model, f"{what} in {dtype_name}, unquantised (the run trained on its NF4 quantisation)"
        model = build(base_model)
        cfg = read_adapter_config(final, model)
        model = apply_qlora(model, cfg, dtype)
        model = load_weights(model, dtype, device, hook=QloraLoadHook(model, self.quantise_from))
        model = load_adapter_weights(self.initialise(model, torch.device(device)), final, cfg)
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()]), "a tensor was not loaded"
        return model.eval(), f"adapter {final} on {base_model} as NF4, as the run trained it ({dtype_name} compute)"

    def describe(self) -> str:
        return "q" + super().describe() + " (NF4 base)"


class Full(Method):
    """Full fine-tuning: every weight trains. The model's weights stay in model.dtype; the optimizer gets float32
    master weights for bf16/fp16 ones (gapless.train.optim.MasterWeights: its docstring says each tensor's
    precision). A checkpoint holds the trainable weights (and the loop adds the float32 masters); the final save is
    an HF folder (gapless.model.export.save_pretrained) that transformers loads."""
    name = "full"
    final_name = "model"
    final_holds_base = True

    def transform(self, model: nn.Module) -> nn.Module:
        return model.requires_grad_(True)

    @property
    def flops(self) -> dict:
        return {"method": "full"}

    def save_final(self, model: nn.Module, out: Path, base_model: Path) -> Path:
        return save_pretrained(model, out, source_dir=base_model)

    def load_final(self, final: Path, base_model: Path, dtype: torch.dtype, device: torch.device | str, *,
                   unquantised_base: bool = False) -> tuple[nn.Module, str]:
        return load_model(final, dtype=dtype, device=device), f"model {final}"


def method_of(cfg: RunConfig) -> Method:
    """The Method that `cfg.method` names, with its settings."""
    methods = {"lora": lambda: Lora(cfg.lora), "qlora": lambda: Qlora(cfg.lora, DTYPES[cfg.model.dtype]),
               "full": lambda: Full()}
    assert cfg.method in methods, f"config.method {cfg.method!r} should have been refused by the config"
    return methods[cfg.method]()
