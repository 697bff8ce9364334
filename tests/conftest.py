import json
from pathlib import Path

import pytest
import torch

from gapless.model.loading import load_model
from gapless.model.lora import load_adapter

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def shared() -> Path:
    """The read-only ../shared folder beside the repository (data, tokenizers, peers)."""
    if not SHARED.is_dir():
        pytest.skip("../shared is not present")
    return SHARED


# A tiny Llama-family shape: 2 layers, hidden 64, 4 query heads sharing 2 KV heads (GQA), vocab 96.
TINY_CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: make(model_type, name="base", seed=0, **config) -> (transformers model, saved folder).

    Builds transformers' own model of a tiny random config, spreads its weights (HF's init, std 0.02
    with zero biases and unit norms, leaves logits near zero and biases and norms untested), and
    saves it with save_pretrained (safetensors) into tmp_path / name.
    """
    import torch
    import transformers

    def make(model_type: str, name: str = "base", seed: int = 0, **config):
        hf_config = transformers.AutoConfig.for_model(model_type, **{**TINY_CONFIG, **config})
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.copy_(1 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.2)
        model.eval()
        folder = tmp_path / name
        model.save_pretrained(folder)
        return model, folder

    return make


def training_records(path) -> list[dict]:
    """The per-step training records of metrics.jsonl (time and eval records carry no loss)."""
    return [r for r in map(json.loads, open(path)) if "loss" in r]


@torch.no_grad()
def gapless_logits(base: Path, adapter: Path | None, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the HF folder `base` loaded by gapless, with the PEFT adapter folder `adapter` on it when given."""
    model = load_model(base)
    if adapter is not None:
        model, _ = load_adapter(model, adapter)
    return model.eval()(ids)
