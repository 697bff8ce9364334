"""gapless bench on the CPU: the CLI end to end on a tiny model, its rows and table, the lengths data path,
the activation-checkpointing and layer-compile transforms, and the HF+PEFT peer as a subprocess."""
import json
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from gapless import cli
from gapless.bench import (CONFIGS, LADDER, MD_END, MD_START, Recipe, build_model, lengths_mixture,
                           take_batches, update_results_md)
from gapless.config import LoraConfig
from gapless.data.batching import BatchSampler
from gapless.kernels.attention import sdpa_reference
from gapless.model.decoder import CausalLM, ModelArgs
from gapless.model.lora import apply_lora
from gapless.train.ckpt_activations import checkpoint_activations
from gapless.train.compile import compile_layers
from gapless.train.step import loss_sum

VOCAB = 96
TINY = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "tie_word_embeddings": True, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
FIELDS = ("date", "gpu", "system", "config", "model", "real_tok_s", "peak_gib", "mfu", "padding_fraction", "step_ms",
          "fwd_ms", "bwd_ms", "opt_ms", "command", "run_id", "torch")
OTHER_SECTION = "## Tokenization throughput\n\n| workers | tok/s |\n|---|---|\n| 2 | 123 |\n"


@pytest.fixture
def setup(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(20), 0.8, 300).astype(int), 2, 200)  # some above max_seq_len 64
    (tmp_path / "lengths.txt").write_text(" ".join(map(str, lengths)))
    (tmp_path / "RESULTS.md").write_text("# Results\n\n" + OTHER_SECTION)
    return tmp_path


def bench(setup, *extra):
    return cli.main(["bench", "--model", str(setup / "tiny"), "--lengths", str(setup / "lengths.txt"),
                     "--max-seq-len", "64", "--tokens-per-batch", "256", "--steps", "2", "--warmup", "1",
                     "--profile-steps", "1", "--out", str(setup / "results.jsonl"), *extra])


def rows(setup):
    return [json.loads(line) for line in (setup / "results.jsonl").read_text().splitlines()]


def test_cli_ladder_rows_and_results_md(setup):
    names = ["pad_to_max_ckpt", "dyn_pad", "packed", "packed_sdpa", "packed_sdpa_fused"]
    assert bench(setup, "--config", ",".join(names)) == 1  # "packed" needs varlen (CUDA): recorded, not fatal
    got = rows(setup)
    assert [r["config"] for r in got] == names
    assert len({r["run_id"] for r in got}) == 1 and all(r["system"] == "gapless" for r in got)
    for r in got:
        assert all(k in r for k in FIELDS), sorted(set(FIELDS) - set(r))
        assert r["model"] == "tiny" and r["command"].startswith("gapless bench --model")
    failed = got[2]
    assert "varlen" in failed["error"] and failed["real_tok_s"] is None and failed["mfu"] is None
    ok = {r["config"]: r for r in got if not r["error"]}
    assert set(ok) == set(names) - {"packed"}
    for r in ok.values():
        assert r["real_tok_s"] > 0 and r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["opt_ms"] > 0
        # MFU is the achieved FLOP/s over the peak measured in the run (the CPU's load varies: no bound on it here)
        assert r["mfu"] == pytest.approx(r["tflops"] / r["peak_tflops"], rel=2e-3) and r["mfu"] > 0
        # real tok/s is the real tokens of the timed steps over their time
        assert r["real_tok_s"] == pytest.approx(r["real_tokens"] / (r["step_ms"] * r["steps"] / 1e3), rel=0.01)
        assert r["padding_fraction"] == pytest.approx(1 - r["real_tokens"] / r["slots"], abs=1e-4)
        # random init (std 0.02): logits near zero, so the mean loss is near ln(vocab)
        assert abs(r["loss"] - math.log(VOCAB)) < 0.3
        assert r["new_graphs_timed"] == 0
    # 4 documents of at most 64 tokens, each padded to 64, per step
    assert ok["pad_to_max_ckpt"]["slots"] == 2 * 4 * 64
    assert ok["packed_sdpa"]["padding_fraction"] < ok["dyn_pad"]["padding_fraction"] < \
        ok["pad_to_max_ckpt"]["padding_fraction"]
    assert ok["packed_sdpa"]["padding_fraction"] < 0.1

    text = (setup / "RESULTS.md").read_text()
    assert OTHER_SECTION in text and text.count(MD_START) == 1 and text.count(MD_END) == 1
    table = text[text.index(MD_START):text.index(MD_END)]
    assert got[0]["run_id"] in table and all(f"| {n} |" in table for n in names)

    # a second run: its rows are appended, and the table shows only that run; the other section is untouched
    assert bench(setup, "--config", "packed_sdpa", "--run-id", "second-run") == 0
    assert len(rows(setup)) == len(names) + 1
    text = (setup / "RESULTS.md").read_text()
    table = text[text.index(MD_START):text.index(MD_END)]
    assert "second-run" in table and got[0]["run_id"] not in table and "| dyn_pad |" not in table
    assert OTHER_SECTION in text and text.count(MD_START) == 1


def test_cli_refuses_unknown_config_and_missing_data(setup, capsys):
    assert bench(setup, "--config", "packed,warp_speed") == 2
    assert "warp_speed" in capsys.readouterr().err
    code = cli.main(["bench", "--model", str(setup / "tiny"), "--config", "packed_sdpa", "--data", str(setup / "no"),
                     "--out", str(setup / "results.jsonl")])
    assert code == 2 and "--lengths" in capsys.readouterr().err
    assert not (setup / "results.jsonl").exists()


def test_ladder_order_and_recipes():
    assert LADDER == ("pad_to_max_ckpt", "dyn_pad", "packed", "packed_fused", "packed_fused_flex",
                      "packed_fused_compile", "best")
    assert CONFIGS["pad_to_max_ckpt"].checkpoint and CONFIGS["pad_to_max_ckpt"].batching == "pad_to_max"
    assert CONFIGS["packed"].attn == "varlen" and CONFIGS["packed"].loss == "materialised"
    assert CONFIGS["packed_fused"].loss == "fused" and CONFIGS["packed_fused_flex"].attn == "flex"
    assert CONFIGS["best"].compile and CONFIGS["best"].loss == "fused_compiled"
    # each rung adds one thing to the one before: best adds grouped LoRA to packed_fused_compile
    assert CONFIGS["best"] == replace(CONFIGS["packed_fused_compile"], lora_kernel="grouped")
    assert CONFIGS["best_fa4"] == replace(CONFIGS["best"], attn="fa4_op")


def test_update_results_md_creates_and_replaces_only_its_section(tmp_path):
    md = tmp_path / "RESULTS.md"
    row = {"run_id": "r1", "gpu": "cpu", "date": "2026-12-03T00:00:00", "torch": "2", "system": "gapless",
           "model": "m", "config": "packed_sdpa", "real_tok_s": 1234.5, "peak_gib": None, "mfu": 0.25,
           "padding_fraction": 0.01, "step_ms": 10.0, "fwd_ms": 3.0, "bwd_ms": 6.0, "opt_ms": 1.0}
    update_results_md(md, [row])
    text = md.read_text()
    assert text.startswith("# ")
    assert "| gapless | m | packed_sdpa | 1,234 | - | 0.250 | 0.010 | 10 | 3 / 6 / 1 |" in text
    md.write_text("before\n" + text + "after\n")
    update_results_md(md, [dict(row, run_id="r2", config="best")])
    text = md.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "r2" in text and "r1" not in text
    assert text.count(MD_START) == 1


def test_lengths_mixture_batches(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("5 70\n3 64 10 1")
    mix = lengths_mixture(path, vocab_size=50, max_seq_len=64)
    assert mix.lengths.tolist() == [5, 64, 3, 64, 10, 1]  # capped at max_seq_len, as tokenization truncates
    ids, mask = mix.doc(1)
    assert len(ids) == 64 and mask.all() and 0 <= ids.min() and ids.max() < 50
    sampler = BatchSampler(mix, strategy="packed", max_seq_len=64, tokens_per_batch=128, seed=0)
    batches = take_batches(sampler, 5, torch.device("cpu"))  # more than one epoch (2 batches) of 147 tokens
    for batch, lengths in batches:
        assert batch.num_real_tokens == sum(lengths) and batch.input_ids.shape == (2, 64)
        segments = torch.diff(batch.cu_seqlens).tolist()  # the documents, then each row's padding tail
        assert sum(segments) == 128 and not Counter(lengths) - Counter(segments)
    assert sum(sum(ls) for _, ls in batches[:2]) == 147  # epoch 0 holds every document once
    for bad in ("", "3 x", "4 0"):
        path.write_text(bad)
        with pytest.raises(ValueError, match="--lengths"):
            lengths_mixture(path, 50, 64)


def tiny_lora_model(seed=0):
    torch.manual_seed(seed)
    model = apply_lora(CausalLM(ModelArgs(**TINY)), LoraConfig(r=4))
    with torch.no_grad():  # B is zero at init: give it values so LoRA's A gets a gradient too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def packed_batch(tmp_path, lengths, seed=0):
    path = tmp_path / f"lengths{seed}.txt"
    path.write_text(" ".join(map(str, lengths)))
    sampler = BatchSampler(lengths_mixture(path, VOCAB, 64, seed=seed), strategy="packed", max_seq_len=64,
                           tokens_per_batch=128, seed=seed)
    return take_batches(sampler, 1, torch.device("cpu"))[0][0]


def test_checkpoint_activations_same_gradients_recomputes_and_keeps_names(tmp_path):
    batch = packed_batch(tmp_path, [20, 30, 40, 12, 25])
    grads = []
    calls = []
    for ckpt in (False, True):
        model = tiny_lora_model()
        names = [n for n, _ in model.named_parameters()]
        if ckpt:
            model = checkpoint_activations(model)
            assert [n for n, _ in model.named_parameters()] == names  # HF names: no wrapper prefix
        count = [0]
        # a pre-hook: the recomputation stops early, inside the MLP, once every saved tensor is rebuilt
        model.model.layers[1].mlp.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        loss_sum(model, batch).backward()
        calls.append(count[0])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert calls == [1, 2]  # the checkpointed layer ran again in backward
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint_activations(model)


def test_build_model_assembles_random_weights_ties_head_and_inits():
    args = ModelArgs(**TINY)
    model, method = build_model(args, Recipe("packed", "sdpa", "fused"), torch.device("cpu"), torch.float32, lora_r=4)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.is_meta for p in model.parameters())
    assert torch.equal(model.model.norm.weight, torch.ones(args.hidden_size))
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.015 < std < 0.025
    reference = CausalLM(args)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    # LoRA as a run has it: A initialised, B zero, only the adapters train
    lora_a = model.model.layers[0].self_attn.q_proj.lora_A.weight
    assert lora_a.abs().sum() > 0 and not model.model.layers[0].self_attn.q_proj.lora_B.weight.any()
    assert set(method.trainable(model)) == {n for n, _ in model.named_parameters() if ".lora_" in n}
    assert model.loss_chunk_size == CONFIGS["best"].loss_chunk and model.loss_step == "eager"
    materialised, _ = build_model(args, CONFIGS["packed_sdpa"], torch.device("cpu"), torch.float32)
    assert materialised.loss_chunk_size is None


def test_compiled_layers_do_not_recompile_per_batch(tmp_path):
    """Batches with different document counts (cu_seqlens length) and max_seqlen: every graph is compiled by the
    first batch, none after, with an attention that uses both as varlen does (dynamo's eager backend: the graphs
    dynamo captures, without inductor's code generation)."""
    from torch._dynamo.utils import counters

    def varlen_like(q, k, v, *, cu_seqlens, max_seqlen, attention_mask, sliding_window, scale):
        # traceable stand-in for varlen: reads cu_seqlens (its length varies) and max_seqlen (a host int)
        out = sdpa_reference(q, k, v, scale=scale)
        return out * (1 + 0 * (cu_seqlens[-1] + max_seqlen))

    torch._dynamo.reset()
    model = tiny_lora_model()
    model.attn_fn = varlen_like
    model = compile_layers(model, backend="eager")
    model.loss_step = "eager"  # the layers' graphs alone (the loss's compiled per-chunk step would add one of its own)
    rng = np.random.default_rng(1)
    # shorter documents, more of them: 2 rows of 64 slots hold a different number in each batch
    batches = [packed_batch(tmp_path, rng.integers(2, 64 - 10 * i, 40).tolist(), seed=i) for i in range(6)]
    assert len({len(b.cu_seqlens) for b in batches}) > 2 and len({b.max_seqlen for b in batches}) > 2
    graphs, before = [], int(counters["stats"]["unique_graphs"])  # process-wide: other tests compile too
    for batch in batches:
        loss_sum(model, batch).backward()
        graphs.append(int(counters["stats"]["unique_graphs"]) - before)
    # one graph for both layers: compile_layers makes layer 0's input (the frozen embedding's output) need a gradient
    assert graphs == [1] * 6, graphs


def test_peers_run_as_subprocess_with_replayed_lengths(setup, shared):
    # dyn_pad8: 8 documents per step, padded; their real tokens check the replay of the peer's length stream
    code = bench(setup, "--peers", "--peers-dir", str(shared / "peers"), "--peers-configs", "dyn_pad8",
                 "--peers-args=--tiny")
    assert code == 0
    got = rows(setup)
    assert [(r["system"], r["config"]) for r in got] == [("hf+peft", "dyn_pad8")]
    for r in got:
        assert all(k in r for k in FIELDS) and r["error"] is None and r["real_tok_s"] > 0
        assert r["command"].startswith("PACK_TOKENS=256 ") and "--tiny" in r["command"]
        # the documents replayed from the peer's seeded stream are the ones it counted
        implied = r["peer_result"]["real_tok_s"] * r["peer_result"]["step_s"] * r["steps"]
        # the peer prints step_s to the millisecond: on a --tiny step of tens of ms that rounding alone is ~1%
        # (609 real tokens against 615.2 implied, seen once on a loaded 2-core box)
        rounding = r["peer_result"]["real_tok_s"] * 0.0005 * r["steps"]
        assert r["real_tokens"] == pytest.approx(implied, rel=0.01, abs=rounding)
        assert "another architecture" in r["mfu_note"]  # --tiny builds the peer's own tiny shape, not --model's
    assert got[0]["padding_fraction"] > 0


def test_our_peer_builds_the_model_of_model_config_and_gets_its_mfu(setup):
    """bench/peers' copy takes --model-config: it reports the sizes it built, and bench computes the peer's MFU
    when they are --model's (the tiny config is below the peer's --tiny caps, so --tiny keeps it as it is)."""
    peers = Path(__file__).resolve().parents[1] / "bench" / "peers"
    code = bench(setup, "--peers", "--peers-dir", str(peers), "--peers-configs", "packed_sdpa",
                 f"--peers-args=--tiny --model-config {setup / 'tiny'}")
    assert code == 0
    (row,) = rows(setup)
    assert row["error"] is None and row["peer_result"]["arch"]["hidden_size"] == TINY["hidden_size"]
    assert "mfu_note" not in row and 0 < row["mfu"] < 1


def test_default_recipe_is_what_a_default_config_resolves_to():
    """`default` must stay what `gapless train` runs when a config names only its model and data."""
    from gapless.bench import resolve_attn
    from gapless.config import DataConfig, ModelConfig
    from gapless.kernels.loss import DEFAULT_CHUNK_SIZE
    from gapless.model.loading import model_args_from_config

    recipe, model, data, lora = CONFIGS["default"], ModelConfig(path="m"), DataConfig(sources=[]), LoraConfig()
    assert (recipe.batching, recipe.attn, recipe.lora_kernel, recipe.lora_dropout, recipe.fused_dropout,
            recipe.checkpoint) == (data.batching, model.attn_backend, lora.kernel, lora.dropout, lora.fused_dropout,
                                   bool(model.activation_checkpointing))
    assert model.compile == "auto" and recipe.compile and recipe.loss == "fused_compiled"  # auto: on with CUDA
    assert recipe.loss_chunk == DEFAULT_CHUNK_SIZE and recipe.method == "lora"
    assert CONFIGS["default_dropout"] == replace(recipe, lora_dropout=0.05)
    assert CONFIGS["default_dropout_torch"] == replace(recipe, lora_dropout=0.05, fused_dropout=False)
    assert CONFIGS["default_grouped"] == replace(recipe, lora_kernel="grouped")
    assert CONFIGS["default_concat"] == replace(recipe, lora_kernel="concat")
    assert CONFIGS["default_dropout_grouped"] == replace(recipe, lora_kernel="grouped", lora_dropout=0.05)
    assert CONFIGS["default_loss_inductor"] == replace(recipe, loss="fused_inductor")
    args = model_args_from_config(TINY)
    assert resolve_attn(recipe, args, torch.device("cpu"), torch.float32)[0] == "sdpa"
    assert resolve_attn(CONFIGS["best"], args, torch.device("cpu"), torch.float32) == ("varlen", "")
