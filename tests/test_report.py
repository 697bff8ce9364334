import base64
import io
import json
import math
import random
import re
import sys
from pathlib import Path

import pytest
import yaml

from gapless.cli import main
from gapless.config import load_config, to_dict
from gapless.meter.report import read_run, throughput, write_report
from gapless.meter.sinks import write_tensorboard
from gapless.meter.timeline import CATEGORIES

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llama-3.1-8b-lora.yaml"
PNG = b"\x89PNG\r\n\x1a\n"


def make_run(path: Path, steps: int = 200, *, gpu: bool = True, gap: bool = True, data_wait: float = 0.01,
             mfu: bool = True, seed: int = 0) -> Path:
    """A synthetic run folder of an 8B LoRA run on one H200: config.yaml, metrics.jsonl (training, eval and
    time records as the loop writes them), gpu.jsonl at 2 Hz and gap.json, all consistent with each other."""
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    log_every, ckpt_every, eval_every, warmup = 10, steps // 4, steps // 4, max(steps // 30, 1)
    # attention and compile as an H200 run resolves "auto" into its config.yaml
    cfg = to_dict(load_config(EXAMPLE, [f"train.steps={steps}", f"checkpoint.every={ckpt_every}",
                                        f"train.eval_every={eval_every}", f"output_dir={path}",
                                        "model.attn_backend=varlen", "model.compile=true"]))
    (path / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    seconds = dict.fromkeys(CATEGORIES, 0.0)
    seconds["startup"] = 92.0
    spans = [("startup", 0.0, 92.0)]  # (what the GPU is doing, from, to) for gpu.jsonl
    t = 92.0
    records, window_real, window_trained, window_start = [], 0, 0, t
    for step in range(1, steps + 1):
        compute = 1.62 * rng.uniform(0.98, 1.02)
        wait = data_wait * rng.uniform(0.5, 1.5)
        seconds["compute"] += compute
        seconds["data_wait"] += wait
        seconds["h2d_copy"] += 0.002
        seconds["other"] += 0.003
        spans.append(("compute", t + wait, t + wait + compute))
        t += compute + wait + 0.005
        real = int(16384 * rng.uniform(0.95, 0.99))
        window_real += real
        window_trained += int(real * 0.62)
        if step % log_every == 0 or step == steps:
            seconds["logging"] += 0.02
            t += 0.02
            lr = 2e-4 * (step / warmup if step < warmup else
                         0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup))))
            loss = 0.85 + 0.75 * math.exp(-step / (steps / 5)) + rng.gauss(0, 0.02)
            rec = {"step": step, "loss": loss, "lr": lr, "grad_norm": rng.uniform(0.3, 0.6),
                   "real_tokens": window_real, "trained_tokens": window_trained,
                   "tokens_per_s": window_real / (t - window_start), "elapsed_s": t}
            if mfu:
                rec["mfu"] = 0.41 * rng.uniform(0.97, 1.0)
            records.append(rec)
            records.append({"kind": "time", "step": step, "started": 1764756000.0, "wall_s": t, "final": False,
                            "seconds": dict(seconds)})
            window_real = window_trained = 0
            window_start = t
        if step % ckpt_every == 0:
            stall = rng.uniform(9, 13)
            seconds["checkpoint"] += stall
            spans.append(("checkpoint", t, t + stall))
            t += stall
        if step % eval_every == 0:
            ev = rng.uniform(20, 24)
            seconds["eval"] += ev
            spans.append(("eval", t, t + ev))
            t += ev
            records.append({"step": step, "eval_loss": 0.95 + 0.6 * math.exp(-step / (steps / 5)),
                            "eval_tokens": 81920, "elapsed_s": t})
    records.append({"kind": "time", "step": steps, "started": 1764756000.0, "wall_s": t, "final": True,
                    "seconds": dict(seconds)})
    with open(path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)

    if gpu:
        with open(path / "gpu.jsonl", "w") as f:
            i, now = 0, 0.0
            while now < t:
                doing = next((k for k, a, b in spans if a <= now < b), "gap")
                util = {"startup": 0, "compute": rng.randint(95, 100), "checkpoint": rng.randint(0, 6),
                        "eval": rng.randint(55, 75), "gap": rng.randint(30, 90)}[doing]
                mem = min(now / 92, 1.0) * 16.5e3 if doing == "startup" else 61.8e3 + rng.uniform(-200, 200)
                power = 90 + 6.1 * util + rng.uniform(-15, 15)
                throttle = ["sw_power_cap"] if power > 680 else (["gpu_idle"] if util == 0 else [])
                sample = {"t": round(now, 3), "gpu": "NVIDIA H200", "util": util, "mem_used_mib": round(mem, 1),
                          "mem_total_mib": 143771.0, "power_w": round(min(power, 700.0), 1), "power_limit_w": 700.0,
                          "sm_clock_mhz": 1755 if throttle == ["sw_power_cap"] else 1980,
                          "temp_c": 38 + util // 4, "throttle": throttle}
                f.write(json.dumps(sample) + "\n")
                i += 1
                now = i * 0.5
    if gap:
        base = sum(r["real_tokens"] for r in records if "loss" in r) / sum(
            r["real_tokens"] / r["tokens_per_s"] for r in records if "loss" in r)
        factors = [("checkpoint stalls", 0.035, "checkpoint.every: 500 and async_write"),
                   ("evaluation", 0.06, "train.eval_every: 1000"),
                   ("attention kernel", 0.19, "model.attn_backend: varlen"),
                   ("fused loss", 0.07, "the chunked cross-entropy kernel")]
        steps_out, value = [], base
        for factor, share, fix in factors:
            new = value * (1 + share)
            steps_out.append({"factor": factor, "tokens_per_s": new, "delta": new - value, "fix": fix})
            value = new
        (path / "gap.json").write_text(json.dumps({"baseline": {"label": "this run", "tokens_per_s": base},
                                                   "steps": steps_out}, indent=1))
    return path


def images(page: str) -> list[bytes]:
    found = re.findall(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)">', page)
    return [base64.b64decode(b) for b in found]


def assert_png(data: bytes) -> None:
    from matplotlib.image import imread

    assert data.startswith(PNG)
    pixels = imread(io.BytesIO(data), format="png")
    assert pixels.shape[0] > 100 and pixels.shape[1] > 300
    assert pixels.std() > 0.01  # not a blank image


def test_report_embeds_one_png_per_plot(tmp_path):
    run = make_run(tmp_path / "run")
    out = write_report(run)
    assert out == run / "report.html"
    page = out.read_text()
    pngs = images(page)
    assert len(pngs) == 6 == page.count("<img ")  # loss, lr, grad norm, tokens/s, GPU, gap waterfall
    for png in pngs:
        assert_png(png)
    # self-contained: every src/href is a data URI, no script, no stylesheet link, no web address
    assert all(u.startswith("data:") for u in re.findall(r'(?:src|href)="([^"]*)"', page))
    text = re.sub(r"<img [^>]*>", "", page)
    assert "<script" not in text and "<link" not in text and "http" not in text
    for caption in ("Loss", "Learning rate", "Gradient norm", "Throughput (real tokens/s)", "GPU utilisation and memory",
                    "Where the time went", "Throughput gap, factor by factor"):
        assert f"<figcaption>{caption}</figcaption>" in page


def test_report_header_numbers_and_findings(tmp_path):
    run = make_run(tmp_path / "run")
    page = re.sub(r"<img [^>]*>", "", write_report(run).read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    real = sum(r["real_tokens"] for r in train)
    steady = real / sum(r["real_tokens"] / r["tokens_per_s"] for r in train)
    wall = records[-1]["wall_s"]
    assert f"{real:,}" in page and f"{steady:,.0f}" in page and f"{real / wall:,.0f}" in page
    assert "MFU" in page and f"{train[-1]['loss']:.4f}" in page
    assert "models/Llama-3.1-8B-Instruct" in page and "cosine, warmup 3% of steps" in page
    assert "varlen, compiled layers" in page and "concat" in page  # what ran: attention, compile, LoRA kernel
    assert "power throttling" in page and "input-bound" not in page  # the recording caps power at 700 W
    for label in ("startup", "compute", "waiting for data", "checkpoint stall", "evaluation"):
        assert f"<td>{label}</td>" in page
    # an input-bound run says so
    slow = write_report(make_run(tmp_path / "slow", steps=60, data_wait=0.6, gpu=False, gap=False)).read_text()
    assert "input-bound" in slow and "waiting for data" in slow


def test_report_config_says_the_batch_size_in_documents():
    from gapless.meter.report import _config_rows

    def batching(data):
        return dict(_config_rows({"data": data}))["batching"]

    assert batching({"batching": "packed", "tokens_per_batch": 16384}) == "packed, tokens/batch 16384"
    assert batching({"batching": "padded", "tokens_per_batch": 4096, "rows_per_batch": 2}) == \
        "padded, tokens/batch 4096, documents/batch at most 2"


def test_report_without_gpu_and_gap(tmp_path):
    run = make_run(tmp_path / "run", steps=40, gpu=False, gap=False, mfu=False)
    page = write_report(run).read_text()
    pngs = images(page)
    assert len(pngs) == 4 == page.count("<img ")  # loss, lr, grad norm, tokens/s
    for png in pngs:
        assert_png(png)
    text = re.sub(r"<img [^>]*>", "", page)  # base64 can spell anything
    assert "No gpu.jsonl in this run: the GPU monitor did not run" in text
    assert "Throughput gap" not in text and "MFU" not in text


def test_resumed_run_adds_sessions(tmp_path):
    run = make_run(tmp_path / "run", steps=40, gap=False)
    metrics = run / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    first = [r for r in records if r["step"] <= 20 and r.get("final") is not True]
    second = [({**r, "started": 1764759999.0, "wall_s": r["wall_s"] - 50.0} if r.get("kind") == "time" else r)
              for r in records if r["step"] > 20]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in first + second) + '{"step": 41, "lo')  # torn line
    samples = (run / "gpu.jsonl").read_text().splitlines()
    (run / "gpu.jsonl").write_text("\n".join(samples + samples) + "\n")  # a second session restarts t at 0
    page = write_report(run).read_text()
    assert "over 2 sessions (resumed)" in page
    r = read_run(run)
    assert len(r.train) == 4 and len(r.time) == len([x for x in first + second if x.get("kind") == "time"])
    assert len(images(page)) == 5


def test_gap_json_is_checked(tmp_path):
    run = make_run(tmp_path / "run", steps=40)
    gap = json.loads((run / "gap.json").read_text())
    gap["steps"][1]["delta"] += 500
    (run / "gap.json").write_text(json.dumps(gap))
    with pytest.raises(ValueError, match=r"gap.json: steps\[1\] \(evaluation\): delta"):
        write_report(run)
    (run / "gap.json").write_text(json.dumps({"steps": []}))
    with pytest.raises(ValueError, match="gap.json: expected"):
        write_report(run)


def test_throughput_counts_real_tokens_only(tmp_path):
    run = make_run(tmp_path / "run", steps=20, gpu=False, gap=False)
    numbers = throughput(read_run(run))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert numbers["real_tokens"] == sum(r["real_tokens"] for r in records if "loss" in r)
    assert numbers["trained_tokens"] < numbers["real_tokens"]
    assert numbers["end_to_end"] < numbers["steady"]  # startup, evaluation and checkpoints count end to end


def test_cli_report(tmp_path, capsys):
    run = make_run(tmp_path / "run", steps=20, gpu=False, gap=False)
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {run / 'report.html'}"
    assert (run / "report.html").read_text().startswith("<!doctype html>")
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "no metrics.jsonl here" in capsys.readouterr().err


def test_tensorboard_optional(tmp_path, monkeypatch):
    run = make_run(tmp_path / "run", steps=20, gap=False)
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"--tensorboard: .*pip install 'gapless\[tensorboard\]'"):
            write_tensorboard(run)
        assert main(["report", str(run), "--tensorboard"]) == 2  # the HTML report is still written
        assert (run / "report.html").is_file()
        return
    out = write_tensorboard(run)
    assert any(p.name.startswith("events.out.tfevents") for p in out.iterdir())
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ValueError, match=r"--tensorboard: .*pip install 'gapless\[tensorboard\]'"):
        write_tensorboard(run)


def test_checkpoint_steps_follow_auto_choices():
    """checkpoint.every auto: the steps come from metrics.jsonl's checkpoint_interval records (chosen at step 4, 10;
    re-resolved at the first save, 10, to 25), plus the last step; a fixed interval from the config."""
    from gapless.meter.report import Run, checkpoint_steps

    train = [{"step": s} for s in range(1, 61)]
    auto = Run(Path("."), {"checkpoint": {"every": "auto"}}, train=train,
               intervals=[{"step": 4, "every": 10}, {"step": 10, "every": 25}])
    assert checkpoint_steps(auto) == [10, 25, 50, 60]
    short = Run(Path("."), {"checkpoint": {"every": "auto"}}, train=train[:3], intervals=[{"step": 0, "every": None}])
    assert checkpoint_steps(short) == [3]
    assert checkpoint_steps(Run(Path("."), {"checkpoint": {"every": 20}}, train=train)) == [20, 40, 60]
    assert checkpoint_steps(Run(Path("."), {"checkpoint": {"every": 0}}, train=train)) == []
    from gapless.meter.report import checkpoint_every_text

    assert checkpoint_every_text("auto", auto.intervals) == "auto: 10 from step 4, 25 from step 10"
    assert checkpoint_every_text("auto", short.intervals) == "auto"  # nothing chosen: the run ended first
    assert checkpoint_every_text(20, []) == 20


def make_ranks(run: Path, world: int = 3) -> Path:
    """`run` (make_run) as a torchrun run of `world` ranks: the training records carry world_size, and rank r's
    GPU samples go to gpu.rank{r}.jsonl (parallel.per_rank). Ranks 0 and 1 run unthrottled, rank 1 with 6 GiB
    more memory and 8 points less utilisation when busy; rank 2 is power-capped at 1,605 MHz in every busy sample,
    so it sets the pace."""
    base = [json.loads(line) for line in (run / "gpu.jsonl").read_text().splitlines()]
    for r in range(world):
        rows = []
        for s in base:
            busy = s["util"] >= 50
            s = {**s, "throttle": [x for x in s["throttle"] if x != "sw_power_cap"], "sm_clock_mhz": 1980}
            if r == 1:
                s.update(mem_used_mib=round(s["mem_used_mib"] + 6144, 1), util=s["util"] - 8 * busy)
            if r == 2 and busy:
                s.update(throttle=["sw_power_cap"], sm_clock_mhz=1605, power_w=699.0)
            rows.append(s)
        name = "gpu.jsonl" if r == 0 else f"gpu.rank{r}.jsonl"
        (run / name).write_text("".join(json.dumps(s) + "\n" for s in rows))
    metrics = run / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps({**r, "world_size": world} if "loss" in r else r) + "\n" for r in records))
    return run


def test_report_of_several_ranks_names_the_outlier_gpu(tmp_path):
    run = make_ranks(make_run(tmp_path / "run", steps=40, gap=False))
    with open(run / "gpu.rank1.jsonl", "a") as f:
        f.write('{"t": 999.5, "util": 9')  # rank 1 killed mid-write: its torn last line left out
    r = read_run(run)
    assert sorted(r.gpu_ranks) == [0, 1, 2] and r.gpu == r.gpu_ranks[0]
    page = write_report(run).read_text()
    text = re.sub(r"<img [^>]*>", "", page)
    assert "<h2>Ranks and communication</h2>" in text and "<h3>GPUs per rank</h3>" in text
    assert "<figcaption>GPU utilisation and memory per rank</figcaption>" in text
    assert "<figcaption>GPU utilisation and memory (rank 0)</figcaption>" in text
    assert "<td>slowest rank</td>" not in text  # no per-rank meter fields in these records: the GPUs alone
    for rank in range(3):
        assert f"<tr><td>{rank}</td><td>NVIDIA H200</td>" in text
    assert "most throttled</td><td>rank 2: power-capped in 100%" in text
    assert re.search(r"lowest utilisation</td><td>rank 1: \d+% mean against \d+% on the other ranks", text)
    assert "highest memory</td><td>rank 1: peak 66.5 GiB, 6.0 GiB above the lowest rank" in text
    assert "SM clock when busy, mean per rank</td><td>1605 MHz (rank 2) to 1980 MHz (rank 0)" in text
    # the finding names rank 2 alone
    assert "power throttling on rank 2" in text and "not on ranks 0, 1" in text
    assert text.count("power throttling") == 1 and "less busy" not in text  # 8 points: named, not a finding
    pngs = images(page)
    assert len(pngs) == 6  # loss, lr, grad norm, tokens/s, rank 0's GPU, and every rank's GPU
    assert_png(pngs[-1])
    # `gapless doctor RUN` reads the same evidence
    from gapless.diagnosis.doctor import run_findings

    ids = [f.id for f in run_findings(run)]
    assert "run.power_throttling_on_rank_2" in ids


def test_report_of_several_ranks_with_a_silent_rank(tmp_path):
    run = make_ranks(make_run(tmp_path / "run", steps=40, gap=False), world=3)
    (run / "gpu.rank2.jsonl").unlink()  # rank 2's monitor wrote nothing (no NVML there)
    (run / "gpu.rank1.jsonl").write_text('{"t": 0.0, "ut')  # rank 1: one torn line, no sample
    page = write_report(run).read_text()
    text = re.sub(r"<img [^>]*>", "", page)
    assert "<tr><td>0</td><td>NVIDIA H200</td>" in text
    for rank in (1, 2):
        assert f"<tr><td>{rank}</td><td colspan=\"8\">no samples" in text
    assert "lowest utilisation" not in text and "spread" not in text  # one rank recorded: nothing to compare
    assert len(images(page)) == 6


def test_one_process_report_is_unchanged_by_the_rank_code(tmp_path):
    """A single-process run folder: no per-rank part, the findings as diagnose gives them for gpu.jsonl alone."""
    run = make_run(tmp_path / "run", steps=40, gap=False)
    from gapless.meter.monitor import diagnose
    from gapless.meter.report import checkpoint_steps, findings, joined_sessions
    from gapless.meter.timeline import session_totals

    r = read_run(run)
    assert list(r.gpu_ranks) == [0]
    steps = {x["step"]: x["elapsed_s"] for x in r.train}
    assert findings(r) == diagnose(joined_sessions(r.gpu), session_totals(r.time), checkpoint_steps(r), steps)
    page = write_report(run).read_text()
    assert "Ranks and communication" not in page and "GPUs per rank" not in page and "(rank 0)" not in page
    assert len(images(page)) == 5
