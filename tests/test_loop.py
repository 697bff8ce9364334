"""The training loop's loss contracts (STYLE.md 10) on the demo's tiny Llama, CPU, float32.

- k micro-batches of ragged lengths, each adding loss_sum / N_step, give the gradient of one batch
  holding the same documents (N_step = trained tokens of the whole step, not a mean of means);
- a packed row of several documents gives the loss and gradients of each document run alone;
- a run stopped after a checkpoint and resumed logs the losses of an uninterrupted run, step for
  step, also when the newest checkpoint's write was killed;
- metrics.jsonl holds one record per logged step, and the run's config.yaml parses back to its config.
"""
import json
import math
import shutil
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from gapless import demo_task
from gapless.config import from_dict, load_config, RunConfig
from gapless.data.batching import IGNORE, Batch, BatchSampler
from gapless.data.pipeline import build_data
from gapless.demo import write_base_model
from gapless.model.loading import load_model
from gapless.model.lora import apply_lora
from gapless.train.loop import evaluate, total_steps, train
from gapless.train.step import loss_sum
from conftest import training_records

STEPS = 6  # optimizer steps of the loop runs: checkpoints at 2, 4, 6



@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    """The demo's tiny Llama (an HF folder with its character tokenizer) and 200 messages records."""
    root = tmp_path_factory.mktemp("loop")
    model_dir = write_base_model(root / "base", seed=0)
    data = demo_task.write_jsonl(demo_task.make_examples(200, seed=1), root / "data" / "train.jsonl")
    return {"root": root, "model": model_dir, "data": data, "cache": root / "cache"}


def run_config(base: dict, out: str, **overrides) -> RunConfig:
    """A small LoRA run: grad_accum 2 of 2-row packed micro-batches, dropout on (so RNG state matters)."""
    raw = {
        "model": {"path": str(base["model"]), "dtype": "float32", "device": "cpu"},
        "data": {"sources": [{"path": str(base["data"]), "format": "messages"}], "max_seq_len": 64,
                 "tokens_per_batch": 128, "cache_dir": str(base["cache"]), "num_workers": 0},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.1, "kernel": "reference"},  # dropout trains on the reference
        "optim": {"lr": 1e-2},
        "schedule": {"kind": "cosine", "warmup_steps": 1},
        "checkpoint": {"every": 2, "keep": 2},
        "train": {"steps": STEPS, "grad_accum": 2, "log_every": 1, "seed": 3},
        "output_dir": str(base["root"] / out),
        "progress": False,
    }
    return load_config(data=raw, overrides=[f"{k}={v}" for k, v in overrides.items()])


def doc_batch(mix, gids: list[int]) -> Batch:
    """Documents `gids` of `mix`, one per row, right-padded to the longest (the padded layout, by hand)."""
    docs = [mix.doc(g) for g in gids]
    t = max(len(ids) for ids, _ in docs)
    ids_t = torch.zeros(len(docs), t, dtype=torch.int64)
    targets = torch.full((len(docs), t), IGNORE, dtype=torch.int64)
    attn = torch.zeros(len(docs), t, dtype=torch.int64)
    for r, (ids, mask) in enumerate(docs):
        ids, mask = torch.from_numpy(ids.astype("int64")), torch.from_numpy(mask.astype("int64"))
        n = len(ids)
        ids_t[r, :n] = ids
        targets[r, :n - 1] = torch.where(mask[1:] == 1, ids[1:], IGNORE)  # position t predicts token t+1
        attn[r, :n] = 1
    pos = torch.arange(t).expand(len(docs), t).clone()
    return Batch(ids_t, targets, pos, None, t, attn, int(attn.sum()), int((targets != IGNORE).sum()),
                 len(docs) * t)


@pytest.fixture(scope="module")
def mix(base):
    cfg = run_config(base, "unused")
    mix, _, _ = build_data(cfg.data, base["model"])
    return mix


def lora_model(base: dict, dropout: float = 0.0):
    """The tiny model with LoRA on every projection and B moved off zero, so A gets gradients too."""
    model = load_model(base["model"], dtype="float32")
    cfg = run_config(base, "unused").lora
    cfg.dropout = dropout
    torch.manual_seed(0)
    apply_lora(model, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.normal_(0.0, 0.05)
    model.train()
    return model


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out


def assert_grads_close(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


def max_grad_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


# ---------------------------------------------------------------------------------------------
# accumulation and packing


@pytest.mark.parametrize("strategy", ["packed", "padded"])
def test_accumulated_micro_batches_equal_one_batch(base, mix, strategy):
    """3 ragged micro-batches from the sampler, each backward(loss_sum / N_step) as loop.py does, give
    the gradient of one padded batch of all their documents."""
    sampler = BatchSampler(mix, strategy=strategy, max_seq_len=64, tokens_per_batch=128, seed=5)
    plan = sampler.plan(0)[:3]
    micro = [sampler.collate(item) for item in plan]
    gids = [g for item in plan for g in (sum(item, []) if strategy == "packed" else item)]
    assert len({b.num_target_tokens for b in micro}) > 1 or len({b.input_ids.shape for b in micro}) > 1, \
        "the micro-batches should be ragged"
    n_step = sum(b.num_target_tokens for b in micro)
    model = lora_model(base)

    for b in micro:  # the loop's accumulation
        (loss_sum(model, b) / n_step).backward()
    accumulated = grads(model)

    one = doc_batch(mix, gids)
    assert one.num_target_tokens == n_step
    (loss_sum(model, one) / one.num_target_tokens).backward()
    assert_grads_close(accumulated, grads(model))

    # the test can tell: a mean of per-micro-batch means is a different gradient
    for b in micro:
        (loss_sum(model, b) / b.num_target_tokens / len(micro)).backward()
    assert max_grad_diff(accumulated, grads(model)) > 1e-4


def packed_row_by_hand(docs: list[tuple], row_len: int) -> Batch:
    """Two packed rows of `row_len` slots: the documents split between them, each row's tail a padding segment."""
    half = (len(docs) + 1) // 2
    rows = [docs[:half], docs[half:]]
    ids = torch.zeros(2, row_len, dtype=torch.int64)
    targets = torch.full((2, row_len), IGNORE, dtype=torch.int64)
    pos = torch.zeros(2, row_len, dtype=torch.int64)
    seqlens = []
    for r, row in enumerate(rows):
        c = 0
        for x, m in row:
            n = len(x)
            ids[r, c:c + n] = x
            targets[r, c:c + n - 1] = torch.where(m[1:] == 1, x[1:], IGNORE)
            pos[r, c:c + n] = torch.arange(n)
            seqlens.append(n)
            c += n
        assert c < row_len
        pos[r, c:] = torch.arange(row_len - c)
        seqlens.append(row_len - c)
    cu = torch.tensor([0] + seqlens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    real = sum(len(x) for x, _ in docs)
    return Batch(ids, targets, pos, cu, max(seqlens), None, real, int((targets != IGNORE).sum()), 2 * row_len)


def test_packed_rows_equal_documents_alone(base, mix):
    """Two packed rows of 6 documents (cu_seqlens, restarting positions): summed loss and gradients equal
    the sum over the documents, each run alone as a batch of one."""
    docs = []
    for g in range(6):
        x, m = mix.doc(g)
        docs.append((torch.from_numpy(x.astype("int64")), torch.from_numpy(m.astype("int64"))))
    assert len({len(x) for x, _ in docs}) > 1
    packed = packed_row_by_hand(docs, row_len=sum(len(x) for x, _ in docs[:3]) + 5)
    model = lora_model(base)

    loss_packed = loss_sum(model, packed)
    loss_packed.backward()
    g_packed = grads(model)

    loss_alone = torch.zeros(())
    for g in range(6):
        b = doc_batch(mix, [g])
        loss = loss_sum(model, b)
        loss.backward()
        loss_alone += loss.detach()
    assert packed.num_target_tokens == sum(doc_batch(mix, [g]).num_target_tokens for g in range(6))
    torch.testing.assert_close(loss_packed.detach(), loss_alone, rtol=1e-6, atol=1e-5)
    assert_grads_close(g_packed, grads(model))

    # the test can tell: the same row without its document boundaries is another loss
    leaky = loss_sum(model, Batch(packed.input_ids, packed.targets,
                                        torch.arange(packed.input_ids.shape[1]).expand_as(packed.input_ids),
                                        None, packed.input_ids.shape[1], None, 0, 0, 0))
    assert abs(leaky.item() - loss_alone.item()) > 1e-2


def test_sampler_packed_batches_equal_documents_alone(base, mix):
    """The same contract on the sampler's own packed batch (its targets, positions and cu_seqlens)."""
    sampler = BatchSampler(mix, strategy="packed", max_seq_len=64, tokens_per_batch=128, seed=1)
    rows = sampler.plan(0)[0]
    packed = sampler.collate(rows)
    gids = sum(rows, [])
    assert len(gids) > 2
    model = lora_model(base)
    loss_packed = loss_sum(model, packed)
    loss_packed.backward()
    g_packed = grads(model)
    loss_alone = sum(loss_sum(model, doc_batch(mix, [g])) for g in gids)
    loss_alone.backward()
    torch.testing.assert_close(loss_packed.detach(), loss_alone.detach(), rtol=1e-6, atol=1e-5)
    assert_grads_close(g_packed, grads(model))


def test_evaluate_is_the_token_mean_and_keeps_the_mode(base, mix):
    model = lora_model(base)
    batches = [doc_batch(mix, [0, 1, 2]), doc_batch(mix, [3])]
    with torch.no_grad():
        want = sum(loss_sum(model.eval(), b).item() for b in batches) / sum(b.num_target_tokens for b in batches)
    model.train()
    ev = evaluate(model, batches, torch.device("cpu"))
    assert model.training
    assert ev["eval_tokens"] == sum(b.num_target_tokens for b in batches)
    assert ev["eval_loss"] == pytest.approx(want, rel=1e-6)


def test_total_steps(base):
    cfg = run_config(base, "unused")
    assert total_steps(cfg, batches_per_epoch=1000) == STEPS
    cfg = run_config(base, "unused", **{"train.steps": 0, "train.epochs": 1.5, "train.grad_accum": 4})
    assert total_steps(cfg, batches_per_epoch=10) == math.ceil(1.5 * 10 / 4)
    # a part of an epoch rounds up to whole optimizer steps
    cfg = run_config(base, "unused", **{"train.steps": 0, "train.epochs": 0.1, "train.grad_accum": 4})
    assert total_steps(cfg, batches_per_epoch=10) == 1
    with pytest.raises(ValueError, match="train.epochs"):
        total_steps(cfg, batches_per_epoch=0)


# ---------------------------------------------------------------------------------------------
# the loop end to end: logged losses, resume, metrics.jsonl


@pytest.fixture(scope="module")
def uninterrupted(base):
    return train(run_config(base, "uninterrupted"))


def test_first_logged_loss_is_the_token_mean_of_the_step(base, mix, uninterrupted):
    """Step 1's logged loss is sum of the k micro-batches' loss sums / their trained tokens. LoRA B
    starts at zero, so the model of step 1 is the base model whatever dropout draws."""
    cfg = run_config(base, "unused")
    sampler = BatchSampler.from_config(cfg.data, mix)
    micro = [b for b, _ in zip(sampler, range(cfg.train.grad_accum))]
    model = load_model(base["model"], dtype="float32")
    with torch.no_grad():
        want = sum(loss_sum(model, b).item() for b in micro) / sum(b.num_target_tokens for b in micro)
    assert uninterrupted.losses[1] == pytest.approx(want, rel=1e-5)


def test_resume_reproduces_the_uninterrupted_losses(base, uninterrupted):
    """Crash after step 3 (last checkpoint at step 2), resume: every step's loss is bit-equal to the
    uninterrupted run's (same dropout masks, batches, optimizer and scheduler state), and so is the adapter."""
    assert sorted(uninterrupted.losses) == list(range(1, STEPS + 1))
    stopped = train(run_config(base, "stopped"), stop_after=3)
    assert sorted(stopped.losses) == [1, 2, 3] and stopped.final_dir is None
    with open(stopped.run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 3.')  # the kill cut a record short
    resumed = train(run_config(base, "stopped", resume="true"))
    assert sorted(resumed.losses) == [3, 4, 5, 6]  # step 3 is redone from the checkpoint of step 2
    combined = {**stopped.losses, **resumed.losses}
    assert combined == uninterrupted.losses
    assert_same_adapter(resumed.final_dir, uninterrupted.final_dir)

    # metrics.jsonl of the resumed run: each step once (the redone step 3 as the resumed run logged it),
    # the cut record gone
    records = training_records(resumed.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {r["step"]: r["loss"] for r in records} == uninterrupted.losses


def assert_same_adapter(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    ta, tb = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    assert ta.keys() == tb.keys() and ta
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


@pytest.mark.parametrize("damage", ["manifest deleted", "model.pt truncated"])
def test_resume_skips_a_killed_checkpoint_write(base, uninterrupted, damage):
    """The newest checkpoint (step 4) is damaged as a killed write leaves it: resume warns, continues
    from step 2 and still logs the uninterrupted losses; the damaged step is rewritten."""
    name = "killed-" + damage.split()[0].replace(".", "")
    stopped = train(run_config(base, name), stop_after=5)
    ckpts = base["root"] / name / "checkpoints"
    step4 = ckpts / "step-00000004"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002", "step-00000004"]
    if damage == "manifest deleted":
        (step4 / "manifest.json").unlink()
    else:
        with open(step4 / "model.pt", "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
    with pytest.warns(UserWarning, match="step-00000004"):
        resumed = train(run_config(base, name, resume="true"))
    assert sorted(resumed.losses) == [3, 4, 5, 6]
    assert {**stopped.losses, **resumed.losses} == uninterrupted.losses
    assert_same_adapter(resumed.final_dir, uninterrupted.final_dir)
    from gapless.train.checkpoint import check_checkpoint
    assert check_checkpoint(step4) is None


def test_resume_without_checkpoints_starts_over(base, uninterrupted):
    cfg = run_config(base, "fresh", resume="true")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = train(cfg)
    assert result.losses == uninterrupted.losses


def test_metrics_jsonl_and_config_yaml(base, uninterrupted):
    run = uninterrupted.run_dir
    records = training_records(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # log_every=1: one record per step
    for r in records:
        for key in ("step", "loss", "lr", "grad_norm", "real_tokens", "tokens_per_s", "elapsed_s"):
            assert key in r, (key, r)
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r)
        assert r["real_tokens"] > 0 and r["tokens_per_s"] > 0 and r["grad_norm"] > 0
        assert r["loss"] == uninterrupted.losses[r["step"]]
    assert [r["elapsed_s"] for r in records] == sorted(r["elapsed_s"] for r in records)
    assert records[0]["lr"] == pytest.approx(1e-2)  # warmup_steps 1: step 1 trains at the peak
    assert records[-1]["lr"] < records[1]["lr"]  # cosine decay

    # config.yaml is the config that ran: the "auto" settings resolved (on the CPU: sdpa, no compile)
    cfg = run_config(base, "uninterrupted")
    assert (cfg.model.attn_backend, cfg.model.compile) == ("auto", "auto")
    ran = replace(cfg, model=replace(cfg.model, attn_backend="sdpa", compile=False))
    assert load_config(run / "config.yaml") == ran
    assert from_dict(RunConfig, yaml.safe_load((run / "config.yaml").read_text())) == ran


def test_log_every_averages_over_the_window(base, uninterrupted):
    """log_every=3: a record at steps 3 and 6 whose loss is the token-weighted mean of its 3 steps."""
    result = train(run_config(base, "log3", **{"train.log_every": 3, "checkpoint.every": 0}))
    records = training_records(result.run_dir / "metrics.jsonl")
    per_step = training_records(uninterrupted.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [3, 6]
    for r in records:
        window = [p for p in per_step if r["step"] - 3 < p["step"] <= r["step"]]
        tokens = sum(p["trained_tokens"] for p in window)
        assert r["trained_tokens"] == tokens
        assert r["real_tokens"] == sum(p["real_tokens"] for p in window)
        assert r["loss"] == pytest.approx(sum(p["loss"] * p["trained_tokens"] for p in window) / tokens, rel=1e-6)
    shutil.rmtree(result.run_dir)


def test_activation_checkpointing_changes_memory_not_losses(base, uninterrupted):
    """model.activation_checkpointing=1 recomputes every layer in backward; the run's losses are the same."""
    result = train(run_config(base, "act_ckpt", **{"model.activation_checkpointing": 1, "checkpoint.every": 0}))
    assert set(result.losses) == set(uninterrupted.losses)
    for step, loss in uninterrupted.losses.items():
        assert result.losses[step] == pytest.approx(loss, rel=1e-6, abs=1e-7), step


def test_concat_kernels_resolve_where_they_cannot_run():
    """lora.kernel concat_b (the default) and concat are recorded and announced as grouped where they cannot run
    (QLoRA, FSDP2), and concat as concat_b under LoRA dropout; elsewhere, and for concat_b under dropout, grouped,
    reference and full fine-tuning, the config is unchanged."""
    from gapless.config import DataConfig, LoraConfig, ModelConfig
    from gapless.train.loop import resolve_lora_kernel

    base = RunConfig(model=ModelConfig(path="m"), data=DataConfig(sources=[]))
    assert base.lora.kernel == "concat_b"
    for kernel in ("concat_b", "concat"):
        kernel_base = replace(base, lora=LoraConfig(kernel=kernel))
        for cfg, strategy, why in ((replace(kernel_base, method="qlora"), "none", "method qlora"),
                                   (kernel_base, "fsdp", "FSDP2")):
            resolved, note = resolve_lora_kernel(cfg, strategy)
            assert resolved.lora.kernel == "grouped" and note.startswith(f"lora.kernel: grouped, not {kernel}")
            assert why in note
            assert replace(resolved, lora=replace(resolved.lora, kernel=kernel)) == cfg  # nothing else changed
    cfg = replace(base, lora=LoraConfig(dropout=0.05, kernel="concat"))
    resolved, note = resolve_lora_kernel(cfg, "none")
    assert resolved.lora.kernel == "concat_b" and note.startswith("lora.kernel: concat_b, not concat")
    assert "lora.dropout 0.05" in note and replace(resolved, lora=replace(resolved.lora, kernel="concat")) == cfg
    for cfg, strategy in ((base, "none"), (base, "ddp"), (replace(base, method="full"), "fsdp"),
                          (replace(base, lora=LoraConfig(dropout=0.05)), "ddp"),
                          (replace(base, lora=LoraConfig(dropout=0.05, kernel="reference")), "none")):
        assert resolve_lora_kernel(cfg, strategy) == (cfg, None)


def test_per_epoch_settings_resolve_to_step_intervals():
    """train.evals_per_epoch / checkpoint.per_epoch N: eval_every / every = max(1, optimizer steps per epoch // N),
    the per-epoch fields cleared (config.yaml parses back); unset, the config is unchanged."""
    from gapless.config import CheckpointConfig, DataConfig, ModelConfig, TrainConfig
    from gapless.train.loop import resolve_per_epoch

    cfg = RunConfig(model=ModelConfig(path="m"), data=DataConfig(sources=[]),
                    train=TrainConfig(grad_accum=2, evals_per_epoch=4), checkpoint=CheckpointConfig(per_epoch=3))
    resolved, note = resolve_per_epoch(cfg, batches_per_epoch=51)  # 25 optimizer steps per epoch
    assert (resolved.train.eval_every, resolved.train.evals_per_epoch) == (6, None)  # 25 // 4
    assert (resolved.checkpoint.every, resolved.checkpoint.per_epoch) == (8, None)  # 25 // 3
    assert note.startswith("train.eval_every 6 (evals_per_epoch 4), checkpoint.every 8 (per_epoch 3): 25 optimizer")
    few, _ = resolve_per_epoch(cfg, batches_per_epoch=4)  # 2 steps per epoch, 4 evaluations asked: every step
    assert (few.train.eval_every, few.checkpoint.every) == (1, 1)
    plain = replace(cfg, train=TrainConfig(grad_accum=2), checkpoint=CheckpointConfig())
    assert resolve_per_epoch(plain, 51) == (plain, None)


def test_per_epoch_run_evaluates_and_saves_at_the_resolved_interval(base, capsys):
    """A run with evals_per_epoch and checkpoint.per_epoch evaluates and saves every max(1, steps per epoch // N)
    steps, prints the interval and records it in config.yaml."""
    cfg = run_config(base, "per_epoch", **{"train.steps": 4, "checkpoint.every": "auto", "checkpoint.per_epoch": 8,
                                           "checkpoint.keep": 5, "train.evals_per_epoch": 5,
                                           "data.eval_fraction": 0.1})
    mix, _, _ = build_data(cfg.data, base["model"])
    per_epoch = BatchSampler.from_config(cfg.data, mix).batches_per_epoch() // cfg.train.grad_accum
    evals, saves = max(1, per_epoch // 5), max(1, per_epoch // 8)
    assert (per_epoch, evals, saves) == (17, 3, 2)  # 17 // 5, 17 // 8
    result = train(replace(cfg, progress=True))
    assert f"train.eval_every {evals} (evals_per_epoch 5), checkpoint.every {saves} (per_epoch 8)" \
        in capsys.readouterr().err
    records = [json.loads(line) for line in open(result.run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 4]  # every 3 steps, and at the end
    assert sorted(p.name for p in (result.run_dir / "checkpoints").glob("step-*")) == ["step-00000002",
                                                                                      "step-00000004"]
    ran = load_config(result.run_dir / "config.yaml")
    assert (ran.train.eval_every, ran.train.evals_per_epoch, ran.checkpoint.every, ran.checkpoint.per_epoch) == \
        (evals, None, saves, None)
    shutil.rmtree(result.run_dir)


def test_data_is_read_beside_the_model_loading(base, uninterrupted, monkeypatch):
    """setup starts build_data in a thread before the model loads and waits for it after: the data's start comes
    before the model's load ends, the startup record says the data's own seconds ("overlapped") beside the wait
    ("data"), and the run's losses equal the uninterrupted run's (the same data, the same seeds). A data error
    still surfaces as the error build_data raised."""
    import gapless.data.pipeline as pipeline
    import gapless.train.assemble as assemble_mod

    times = {}
    build_data, assemble = pipeline.build_data, assemble_mod.assemble

    def slow_data(*args, **kwargs):
        times["data_start"] = time.perf_counter()
        time.sleep(0.5)  # a data step longer than the tiny model's load
        return build_data(*args, **kwargs)

    def timed_assemble(*args, **kwargs):
        model = assemble(*args, **kwargs)
        times["model_end"] = time.perf_counter()
        return model

    monkeypatch.setattr(pipeline, "build_data", slow_data)
    monkeypatch.setattr(assemble_mod, "assemble", timed_assemble)
    result = train(run_config(base, "beside"))
    assert times["data_start"] < times["model_end"]
    assert result.losses == uninterrupted.losses
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    startup = next(r for r in records if r.get("kind") == "startup")
    # the wait after the model is shorter than the data's own time: part of it ran beside the model
    assert startup["overlapped"]["data"] >= 0.5 and startup["seconds"]["data"] < startup["overlapped"]["data"]

    def broken(*args, **kwargs):
        raise ValueError("data.sources[0].path: broken.jsonl line 3: not JSON")

    monkeypatch.setattr(pipeline, "build_data", broken)
    with pytest.raises(ValueError, match="broken.jsonl line 3"):
        train(run_config(base, "beside_broken"))


def test_layers_compile_on_a_made_up_batch_while_the_data_is_read(base, monkeypatch):
    """With compile on and the data not read yet when the model is loaded, setup runs one forward and backward of a
    made-up packed batch: the layers (and the loss's step) compile there, step 1 and after compile nothing more, and
    the losses equal a run without it (its random stream forked, its gradients dropped)."""
    import threading

    from torch._dynamo.utils import counters

    from test_kernels_attention import reference_backward, reference_forward

    import gapless.data.pipeline as pipeline
    import gapless.model.decoder as decoder
    import gapless.train.loop as loop
    from gapless.kernels.attention import op_attention, varlen_attention_op

    warmed, graphs = threading.Event(), {}
    build_data, compile_beside_data = pipeline.build_data, loop.compile_beside_data

    def data_after_the_warmup(*args, **kwargs):
        warmed.wait(timeout=300)  # the data is still being read while the layers compile
        return build_data(*args, **kwargs)

    def counted(*args, **kwargs):
        ran = compile_beside_data(*args, **kwargs)
        graphs["warmup"] = counters["stats"]["unique_graphs"]
        warmed.set()
        return ran

    monkeypatch.setattr(pipeline, "build_data", data_after_the_warmup)
    monkeypatch.setattr(loop, "compile_beside_data", counted)
    # the GPU's kind of attention: a varlen custom op (no graph break), here the reference's; the CPU's sdpa loops
    # over the documents in Python and compiles again for each count
    reference = op_attention("ref_op", varlen_attention_op("test_reference", reference_forward, reference_backward))
    monkeypatch.setattr(decoder, "get_attention", lambda backend: reference)
    settings = {"model.compile": "true", "train.steps": 3, "checkpoint.every": 0, "lora.dropout": 0.0}
    torch._dynamo.reset()
    counters.clear()
    warm = train(run_config(base, "warmup", **settings))
    assert graphs["warmup"] >= 1 and counters["stats"]["unique_graphs"] == graphs["warmup"]
    records = [json.loads(line) for line in (warm.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "warmup" in next(r for r in records if r.get("kind") == "startup")["seconds"]

    warmed.set()
    monkeypatch.setattr(loop, "compile_beside_data", lambda *args, **kwargs: pytest.fail("not without compile"))
    plain = train(run_config(base, "warmup_plain", **{**settings, "model.compile": "false"}))
    assert warm.losses == pytest.approx(plain.losses, rel=1e-5)
