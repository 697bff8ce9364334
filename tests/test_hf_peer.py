"""bench/peers/hf_peft_bench.py, the HF+PEFT peer gapless is measured against: its --dry-run on tiny versions of the
benchmarked architectures (Llama-3.2-3B, Gemma-3-4B) and, for its packed configurations, that each document of a
packed row sees only itself, as gapless's packed rows do (tests/test_gemma.py).

Isolation is checked in float32 on the CPU against each document run alone: max abs logit diff <= 1e-5. The same row
with transformers' default use_cache=True is the control: transformers 5.x then lets documents attend to each other
(1.7 to 7.7 max abs on these weights); the peer passes use_cache=False.
"""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "bench" / "models"
ISOLATED = 1e-5  # float32: the packed row and the lone document differ by summation order only (measured 6e-7 to 3.4e-6)


def load_peer():
    """A fresh copy of the script as a module (main() rebinds its PACK_TOKENS / MAX_SEQ)."""
    spec = importlib.util.spec_from_file_location("hf_peft_bench", ROOT / "bench" / "peers" / "hf_peft_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dry_run(monkeypatch, capsys, *argv):
    peer = load_peer()
    monkeypatch.setattr("sys.argv", ["hf_peft_bench.py", *argv, "--dry-run"])
    peer.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.parametrize("model, config", [("llama-3.2-3b", "packed_sdpa"), ("llama-3.2-3b", "dyn_pad8"),
                                           ("gemma-3-4b", "packed_sdpa"), ("gemma-3-4b", "packed_sdpa_ckpt")])
def test_dry_run_builds_the_architecture_and_trains_a_step(monkeypatch, capsys, model, config):
    res = dry_run(monkeypatch, capsys, config, "--model-config", str(MODELS / model))
    expected_type = json.loads((MODELS / model / "config.json").read_text())["model_type"]
    assert res["model_type"] == expected_type and res["config"] == config
    assert res["arch"]["num_hidden_layers"] == 2 and res["arch"]["hidden_size"] == 64
    assert res["real_tok_s"] > 0 and 0 < res["loss"] < 10  # ln(512) = 6.2 for random weights
    assert (res["pad_frac"] == 0) == config.startswith("packed")


def test_tiny_gemma3_keeps_a_sliding_and_a_global_layer():
    peer = load_peer()
    cfg = peer.shrink(peer.load_config(str(MODELS / "gemma-3-4b")))
    assert cfg.layer_types == ["sliding_attention", "full_attention"] and cfg.num_hidden_layers == 2
    assert (cfg.sliding_window, cfg.head_dim, cfg.query_pre_attn_scalar) == (16, 16, 16)
    # the default (no --model-config) is the seed's Llama-3.2-3B, and --tiny shrinks it as before
    assert peer.shrink(peer.load_config(None)).to_dict()["hidden_size"] == 64


def test_image_text_config_is_refused_naming_the_text_model(tmp_path):
    import transformers

    transformers.Gemma3Config().save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match="gemma3_text"):
        load_peer().load_config(str(tmp_path))


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None or not torch.cuda.is_available(),
                    reason="needs liger-kernel and CUDA (its kernels are Triton)")
@pytest.mark.parametrize("model", ["llama-3.2-3b", "gemma-3-4b"])
def test_dry_run_with_liger(monkeypatch, capsys, model):
    res = dry_run(monkeypatch, capsys, "packed_liger", "--model-config", str(MODELS / model))
    assert res["real_tok_s"] > 0 and 0 < res["loss"] < 10


def tiny_model(peer, family):
    """A tiny float32 model of the family with windows of 4 (shorter than the documents below)."""
    import transformers

    if family == "gemma2":  # no bench/models entry: transformers' own config, soft-capping on
        cfg = transformers.AutoConfig.for_model("gemma2", attn_logit_softcapping=5.0, final_logit_softcapping=10.0)
    else:
        cfg = peer.load_config(str(MODELS / family))
    peer.shrink(cfg)
    if getattr(cfg, "sliding_window", None):
        cfg.sliding_window = 4
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation=peer.attention_implementation(cfg, "packed_sdpa"), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():  # spread the weights so attention differs visibly between contexts
            p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("family", ["llama-3.2-3b", "gemma-3-4b", "gemma2"])
def test_packed_rows_isolate_documents(tmp_path, family):
    peer = load_peer()
    peer.PACK_TOKENS, peer.MAX_SEQ = 48, 20
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("5 11 30 3 9 14")
    model = tiny_model(peer, family)
    inputs, real, slots = peer.make_batch("packed", 1, peer.lengths_stream(str(lengths)), 512, "cpu")
    starts = (inputs["position_ids"][0] == 0).nonzero().flatten().tolist() + [48]
    assert real == slots == 48 and len(starts) >= 4  # at least three documents in the row
    with torch.no_grad():
        packed = peer.forward(model, inputs).logits[0]
        alone = torch.cat([model(input_ids=inputs["input_ids"][:, s:e], use_cache=False).logits[0]
                           for s, e in zip(starts[:-1], starts[1:])])
        leaky = model(**inputs).logits[0]  # transformers' default use_cache=True
    print(f"{family}: max abs logit diff packed vs alone {(packed - alone).abs().max():.2e}, "
          f"with use_cache on {(leaky - alone).abs().max():.2e}")
    assert packed.dtype == torch.float32 and (packed - alone).abs().max() <= ISOLATED
    assert (leaky - alone).abs().max() > 0.05, "transformers now isolates packed rows with a cache: update the peer's note"
