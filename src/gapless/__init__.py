"""gapless: fast, correct, measured fine-tuning for Llama-family models."""
from __future__ import annotations

__version__ = "0.1.0"


def load_model(path, dtype=None, device="cpu", attn_backend="sdpa"):
    """Load an HF checkpoint folder as a gapless model (see gapless.model.loading.load_model)."""
    from gapless.model.loading import load_model as _load

    return _load(path, dtype=dtype, device=device, attn_backend=attn_backend)


__all__ = ["load_model", "__version__"]
