"""The batch finder (gapless.train.batch_finder) under a simulated memory limit, and the OOM back-off with an
injected OOM that the step survives with an unchanged gradient."""
import pytest
import torch
import torch.nn.functional as F

from gapless.train.batch_finder import find_token_budget, most_for_rows, run_with_oom_backoff

GIB = 2 ** 30


class SimulatedGpu:
    """peak(tokens) = fixed + per_token x tokens; a step over `capacity` raises (here: returns None, an OOM)."""

    def __init__(self, fixed_gib, per_token_kib, capacity_gib):
        self.fixed, self.per_token, self.capacity = fixed_gib * GIB, per_token_kib * 1024, capacity_gib * GIB
        self.calls = []

    def peak(self, tokens):
        return self.fixed + self.per_token * tokens

    def try_step(self, tokens):
        self.calls.append(tokens)
        peak = self.peak(tokens)
        return None if peak > self.capacity else peak


def test_model_right_one_trial_grows_then_backs_off():
    gpu = SimulatedGpu(fixed_gib=6, per_token_kib=2500, capacity_gib=80)  # 90% of 80 GiB: 29,491 tokens
    predicted = 28_000
    choice = find_token_budget(predicted, gpu.try_step, 80 * GIB)
    limit = 0.9 * 80 * GIB
    assert choice.trials[0][0] == 27_904  # the prediction, rounded down to 256
    best_possible = (limit - gpu.fixed) // gpu.per_token
    good = max(t for t, p in choice.trials if p is not None and p <= limit)
    assert best_possible - 256 * 2 <= good <= best_possible  # bisected to within the granularity steps
    assert choice.tokens == int(good * 0.9) // 256 * 256  # backed off 10%
    assert gpu.peak(choice.tokens) < limit
    assert "backed off 10%" in choice.reason and choice.to_dict()["trials"][0]["tokens"] == 27_904


def test_memory_model_too_optimistic_ooms_then_bisects():
    gpu = SimulatedGpu(fixed_gib=6, per_token_kib=4000, capacity_gib=40)  # real: 7,864 tokens fit 90% of 40
    choice = find_token_budget(20_000, gpu.try_step, 40 * GIB)
    assert choice.trials[0] == (19_968, None)  # the prediction ran out of memory
    assert gpu.peak(choice.tokens) < 0.9 * 40 * GIB
    assert choice.tokens == 6_912  # 90% of 7,680, the largest multiple of 256 under the line (7,864 tokens)


def test_too_pessimistic_grows_and_respects_the_maximum():
    gpu = SimulatedGpu(fixed_gib=2, per_token_kib=100, capacity_gib=80)
    choice = find_token_budget(4_096, gpu.try_step, 80 * GIB, maximum=32_768)
    assert [t for t, _ in choice.trials][:3] == [4_096, 5_120, 6_400]  # x1.25 per trial
    assert max(t for t, _ in choice.trials) <= 32_768
    assert choice.tokens <= 32_768 * 0.9


@pytest.mark.parametrize("rows", [1, 2, 8, 9, 10, 40])
def test_rows_per_batch_bounds_the_trials_and_the_choice(rows):
    """data.rows_per_batch: batches fill at most that many rows, so with memory to spare the finder tries no more
    than what backs off to them and chooses exactly them (not 0.9 x them: 1 row of 2 at rows_per_batch 2); where
    they do not fit, less, as without the cap."""
    seq = 2048
    gpu = SimulatedGpu(fixed_gib=2, per_token_kib=100, capacity_gib=80)
    most = most_for_rows(rows, seq)
    choice = find_token_budget(4 * seq, gpu.try_step, 80 * GIB, granularity=seq, minimum=seq, maximum=most,
                               per_token_bytes=gpu.per_token)
    assert choice.tokens == rows * seq and max(t for t, _ in choice.trials) <= most
    assert (most - seq) * 0.9 // seq < rows  # the fewest rows that back off to `rows`
    small = SimulatedGpu(fixed_gib=6, per_token_kib=2500, capacity_gib=24)  # ~6,500 tokens fit 90% of 24 GiB
    choice = find_token_budget(4 * seq, small.try_step, 24 * GIB, granularity=seq, minimum=seq, maximum=most,
                               per_token_bytes=small.per_token)
    assert choice.tokens == min(rows, 2) * seq  # 3 rows fit, backed off 10%: 2


@pytest.mark.parametrize("model_kib", [4000, 3000, 5000])
def test_the_model_slope_aims_trials_at_the_line(model_kib):
    # the model's fixed part is off by 14 GiB (its prediction OOMs) and its slope by up to 25%
    gpu = SimulatedGpu(fixed_gib=6, per_token_kib=4000, capacity_gib=40)
    choice = find_token_budget(20_000, gpu.try_step, 40 * GIB, per_token_bytes=model_kib * 1024)
    limit = 0.9 * 40 * GIB
    good = max(t for t, p in choice.trials if p is not None and p <= limit)
    assert (limit - gpu.peak(good)) < 2 * 256 * gpu.per_token  # within two granularity steps of the line
    assert len(choice.trials) <= 6, choice.trials


def test_nothing_fits_names_the_setting():
    gpu = SimulatedGpu(fixed_gib=79, per_token_kib=4000, capacity_gib=80)
    with pytest.raises(ValueError, match="data.tokens_per_batch: auto found no budget"):
        find_token_budget(1_000, gpu.try_step, 80 * GIB)


def _model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))
    ids, targets = torch.randint(0, 50, (2, 8, 32))  # one step: 8 rows x 32 = 256 tokens
    return model, ids, targets


def _step_fn(model, ids, targets, fail_above):
    """One optimizer step's gradient, in micro-batches of `tokens` tokens (whole rows); OOM above `fail_above`."""
    attempts = []

    def step(tokens):
        attempts.append(tokens)
        model.zero_grad(set_to_none=True)  # a retried step starts from zero gradients
        rows = max(1, tokens // 32)
        n = targets.numel()
        for i in range(0, 8, rows):
            logits = model(ids[i:i + rows])
            (F.cross_entropy(logits.flatten(0, 1), targets[i:i + rows].flatten(), reduction="sum") / n).backward()
            if tokens > fail_above:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")  # after a backward: partial grads
        return [p.grad.clone() for p in model.parameters()]

    return step, attempts


def test_injected_oom_backs_off_and_the_step_is_unchanged():
    model, ids, targets = _model_and_data()
    reference, _ = _step_fn(model, ids, targets, fail_above=10**9)[0](256), None
    step, attempts = _step_fn(model, ids, targets, fail_above=100)
    told = []
    grads, tokens = run_with_oom_backoff(step, 256, torch.device("cpu"), shrink=0.5, granularity=32, minimum=32,
                                         on_oom=lambda old, new: told.append((old, new)))
    assert attempts == [256, 128, 64] and tokens == 64 and told == [(256, 128), (128, 64)]
    for g, r in zip(grads, reference):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)  # the same step's gradient, in smaller pieces


def test_oom_below_the_minimum_is_raised():
    model, ids, targets = _model_and_data()
    step, attempts = _step_fn(model, ids, targets, fail_above=0)
    with pytest.raises(torch.OutOfMemoryError, match="after 2 back-offs"):
        run_with_oom_backoff(step, 256, torch.device("cpu"), shrink=0.5, granularity=32, minimum=64)
    assert attempts == [256, 128, 64]


# -- wired into the loop: data.tokens_per_batch auto, and an OOM mid-run

def _demo_config(tmp_path, out, **overrides):
    from gapless import demo_task
    from gapless.config import load_config
    from gapless.demo import write_base_model

    if not (tmp_path / "base").is_dir():
        write_base_model(tmp_path / "base", seed=0)
        demo_task.write_jsonl(demo_task.make_examples(100, seed=1), tmp_path / "train.jsonl")
    raw = {"model": {"path": str(tmp_path / "base"), "dtype": "float32", "device": "cpu"},
           "data": {"sources": [{"path": str(tmp_path / "train.jsonl"), "format": "messages"}], "max_seq_len": 64,
                    "tokens_per_batch": 256, "cache_dir": str(tmp_path / "cache"), "num_workers": 0},
           "lora": {"r": 4, "alpha": 8}, "optim": {"lr": 1e-2},
           "train": {"steps": 3, "grad_accum": 2, "log_every": 1, "seed": 3},
           "output_dir": str(tmp_path / out), "progress": False}
    return load_config(data=raw, overrides=[f"{k}={v}" for k, v in overrides.items()])


def test_auto_is_a_config_value_that_needs_a_gpu(tmp_path):
    import io

    from gapless.data.batching import BatchSampler
    from gapless.train.loop import train

    cfg = _demo_config(tmp_path, "auto", **{"data.tokens_per_batch": "auto"})
    assert cfg.data.tokens_per_batch == "auto"
    with pytest.raises(ValueError, match=r"data.tokens_per_batch: 'autoo' matches none.*|did you mean 'auto'"):
        _demo_config(tmp_path, "x", **{"data.tokens_per_batch": "autoo"})
    with pytest.raises(ValueError, match="data.tokens_per_batch: auto is chosen by `gapless train` on a GPU"):
        BatchSampler.from_config(cfg.data, None)
    with pytest.raises(ValueError, match="data.tokens_per_batch: auto measures the GPU's memory"):
        train(cfg, out=io.StringIO())


def test_a_resume_with_auto_reuses_the_runs_number(tmp_path):
    """Resumed with data.tokens_per_batch auto, a run keeps its batches: the batch finder's record where there is
    one, else the number its config.yaml holds (a run started with a number); neither measures anything (the
    model, the method and the device are never touched)."""
    from gapless.train.loop import auto_tokens_per_batch
    from gapless.train.runlock import write_run_config

    class Said:
        def __init__(self):
            self.lines = []

        def message(self, line):
            self.lines.append(line)

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_run_config(run_dir, _demo_config(tmp_path, "run", **{"data.tokens_per_batch": 4096}))
    cfg = _demo_config(tmp_path, "run", **{"data.tokens_per_batch": "auto", "resume": "true"})
    said = Said()
    assert auto_tokens_per_batch(cfg, None, None, None, None, run_dir, said).data.tokens_per_batch == 4096
    assert said.lines == [f"data.tokens_per_batch auto: 4,096, as the run used ({run_dir / 'config.yaml'})"]
    (run_dir / "batch_finder.json").write_text('{"tokens": 2048}')
    assert auto_tokens_per_batch(cfg, None, None, None, None, run_dir, said).data.tokens_per_batch == 2048


def test_split_rows_keeps_the_loss_and_the_token_counts(tmp_path):
    from gapless.data.batching import BatchSampler
    from gapless.data.pipeline import build_data
    from gapless.model.loading import load_model
    from gapless.train.batch_finder import split_rows
    from gapless.train.step import loss_sum

    cfg = _demo_config(tmp_path, "split")
    mix, _, _ = build_data(cfg.data, cfg.model.path)
    batch = next(iter(BatchSampler.from_config(cfg.data, mix).epoch_batches(0)))  # 4 packed rows of 64
    model = load_model(cfg.model.path)
    pieces = split_rows(batch, 1)
    assert len(pieces) == 4 and sum(p.num_target_tokens for p in pieces) == batch.num_target_tokens
    assert all(int(p.cu_seqlens[-1]) == 64 and int(p.cu_seqlens[0]) == 0 for p in pieces)
    with torch.no_grad():
        whole = loss_sum(model, batch)
        parts = sum(loss_sum(model, p) for p in pieces)
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


def test_an_oom_mid_run_backs_off_and_the_run_finishes(tmp_path, monkeypatch):
    import io
    import json

    from gapless.train import loop
    from gapless.train.step import train_step

    reference = loop.train(_demo_config(tmp_path, "reference"), out=io.StringIO())
    calls = []

    def flaky_step(model, micro, *args, **kwargs):
        calls.append(max(b.input_ids.shape[0] for b in micro))  # rows per piece
        if len(calls) == 2:  # step 2's first attempt, after a partial forward and backward
            model(micro[0].input_ids).sum().backward()  # gradients the retry must not keep
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return train_step(model, micro, *args, **kwargs)

    monkeypatch.setattr(loop, "train_step", flaky_step)
    result = loop.train(_demo_config(tmp_path, "oom"), out=io.StringIO())
    records = [json.loads(line) for line in open(result.run_dir / "metrics.jsonl")]
    backoffs = [r for r in records if r.get("kind") == "oom_backoff"]
    assert backoffs == [{"kind": "oom_backoff", "step": 2, "rows_per_micro_batch": [4, 2]}]
    assert calls == [4, 4, 2, 2]  # step 1 whole, step 2 OOM then in halves, step 3 keeps the halves
    assert result.final_dir is not None and sorted(result.losses) == [1, 2, 3]
    for s in (1, 2, 3):  # the same tokens per step in smaller pieces: the same losses
        assert result.losses[s] == pytest.approx(reference.losses[s], rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_a_gpu_chooses_records_and_resumes(tmp_path):
    import io
    import json

    from gapless.train.loop import train

    cfg = _demo_config(tmp_path, "gpu", **{"data.tokens_per_batch": "auto", "model.device": "cuda",
                                           "model.dtype": "bfloat16", "checkpoint.every": 1})
    result = train(cfg, stop_after=2, out=io.StringIO())
    chosen = json.loads((result.run_dir / "batch_finder.json").read_text())
    assert chosen["tokens"] >= 64 and chosen["tokens"] % 64 == 0 and chosen["trials"], chosen
    import yaml

    assert yaml.safe_load((result.run_dir / "config.yaml").read_text())["data"]["tokens_per_batch"] == chosen["tokens"]
    resumed = train(_demo_config(tmp_path, "gpu", **{"data.tokens_per_batch": "auto", "model.device": "cuda",
                                                     "model.dtype": "bfloat16", "checkpoint.every": 1,
                                                     "resume": "true"}), out=io.StringIO())
    assert resumed.final_dir is not None
    assert json.loads((result.run_dir / "batch_finder.json").read_text()) == chosen
