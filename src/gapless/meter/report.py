"""The run report: RUN/report.html from the files of a run folder (TensorBoard and W&B: gapless.meter.sinks).

The report only reads files; metrics.jsonl stays the source of truth. It reads:

    config.yaml     the run's config (the header's summary)
    metrics.jsonl   one JSON object a line: training records ({"step", "loss", "lr", "real_tokens",
                    "trained_tokens", "tokens_per_s", "elapsed_s", ...; "mfu" as a fraction of peak when
                    the loop measures it}), evaluation records ({"step", "eval_loss", ...}) and time records
                    ({"kind": "time", ...}, see gapless.meter.timeline), checkpoint.every auto's choices
                    ({"kind": "checkpoint_interval", "step", "every", ...}, gapless.train.checkpoint_interval)
    gpu.jsonl       GPU samples (optional; see gapless.meter.monitor); under torchrun rank 0's, and rank r's
                    in gpu.rank{r}.jsonl
    gap.json        the throughput gap waterfall (optional; format below)

A run of several processes (training records with world_size > 1 and the per-rank meter's fields, defined in
gapless.train.parallel) adds a "Ranks and communication" section: the slowest rank, the spread of real tokens per
rank, the waiting for slower ranks, and exposed versus overlapped communication, over the run and per window; with
the GPU monitor's files of several ranks, each rank's GPU too (utilisation, memory, power, clocks, throttling, the
spread over the ranks and the outlier rank: a table and a plot), and the findings' GPU rules run per rank.

report.html is one self-contained file: inline CSS, each plot a PNG in a base64 data URI, no script and
no external resource, so it can be mailed or attached to an issue as is.

gap.json: how far this run's throughput is from another one, factor by factor, as a waterfall.

    {"baseline": {"label": "advertised conditions", "tokens_per_s": 10400.0, "note": "full rows, ..."},
     "steps": [{"factor": "real lengths", "setting": "data.batching: padded", "tokens_per_s": 8300.0,
                "delta": -2100.0, "fix": "data.batching: packed", "note": "31% of the slots are padding"},
               {"factor": "gradient accumulation", "skipped": "train.grad_accum is 1, as advertised"},
               {"factor": "checkpoints", "setting": "checkpoint.every: 500", "tokens_per_s": 8200.0,
                "delta": -100.0, "fix": "", "note": "amortised: ..."}],
     "final": {"label": "your run"}}

`baseline.tokens_per_s` is where the waterfall starts (real tokens/s). Each step changes one factor, in order
(`gapless gap` switches one of the run's settings on; a hand-written file may instead remove one): its
`tokens_per_s` is the throughput with that and every earlier step applied, and `delta` is the change from the
previous value (`tokens_per_s` minus the previous one: negative when the factor costs throughput). `fix` says
what recovers it ("" when nothing needs recovering). A step with `skipped` (the reason) instead of numbers was
not measured and draws no bar. The last measured step's `tokens_per_s` is the final bar, labelled
`final.label` (default "reachable"), so the bars' deltas sum to final minus baseline. `setting` and `note`
are optional text. `gapless gap` adds "measured": {"steps", "device", "dtype", "noise": how much two windows
of the baseline's conditions differ (a fraction), "windows": each window's steady seconds by category}.
"""
from __future__ import annotations

import base64
import datetime
import html
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from gapless.config import read_yaml
from gapless.meter.monitor import Finding, diagnose, load_samples, summarise
from gapless.meter.timeline import CATEGORIES, LABELS, session_totals

COLORS = {"train": "#2f6db5", "eval": "#e07b28", "grid": "#e6e8eb", "up": "#3a9a5b", "down": "#c8473d",
          "base": "#7a8591"}
CATEGORY_COLORS = {"startup": "#9aa5b1", "compute": "#2f6db5", "data_wait": "#e07b28", "h2d_copy": "#c9a227",
                   "checkpoint": "#c8473d", "eval": "#7d5ba6", "logging": "#3a9a5b", "communication": "#b5527a",
                   "other": "#5d6b78"}


@dataclass
class Run:
    """What a run folder holds, as read by `read_run`."""
    path: Path
    config: dict
    train: list[dict] = field(default_factory=list)  # one per logged step (the last one written wins)
    eval: list[dict] = field(default_factory=list)
    time: list[dict] = field(default_factory=list)
    gpu: list[dict] = field(default_factory=list)  # rank 0's samples (the only ones of a single process)
    gpu_ranks: dict[int, list[dict]] = field(default_factory=dict)  # rank -> its samples, every gpu*.jsonl read
    gap: dict | None = None
    compile: list[dict] = field(default_factory=list)  # {"kind": "compile"}: frames torch.compile gave up on
    environment: list[dict] = field(default_factory=list)  # {"kind": "environment"}: one per session
    intervals: list[dict] = field(default_factory=list)  # {"kind": "checkpoint_interval"}: checkpoint.every auto
    evals: list[dict] = field(default_factory=list)  # eval.json: `gapless eval` records


def read_run(run_dir: str | Path, pending: list[dict] = ()) -> Run:
    """The run folder's files; `pending`: records not yet in metrics.jsonl, read as if they ended it."""
    path = Path(run_dir)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"{path}: no metrics.jsonl here; give the folder of a run (its output_dir)")
    config_file = path / "config.yaml"
    config = read_yaml(config_file) if config_file.is_file() else {}
    run = Run(path, config)
    train: dict[int, dict] = {}
    for r in [*load_samples(metrics), *pending]:  # JSON lines, a torn last line left out
        if r.get("kind") == "time":
            run.time.append(r)
        elif r.get("kind") == "compile":
            run.compile.append(r)
        elif r.get("kind") == "environment":
            run.environment.append(r)
        elif r.get("kind") == "checkpoint_interval":
            run.intervals.append(r)
        elif "eval_loss" in r:
            run.eval.append(r)
        elif "loss" in r:  # a step whose loss was not finite is null in the strict JSON: a gap in the plots
            train[r["step"]] = {**r, "loss": math.nan if r["loss"] is None else r["loss"]}
    run.train = [train[s] for s in sorted(train)]
    files = {0: path / "gpu.jsonl"} | {int(m[1]): f for f in path.glob("gpu.rank*.jsonl")
                                       if (m := re.fullmatch(r"gpu\.rank(\d+)\.jsonl", f.name))}
    run.gpu_ranks = {r: load_samples(f) for r, f in sorted(files.items()) if f.is_file()}
    run.gpu = run.gpu_ranks.get(0, [])
    if (path / "gap.json").is_file():
        run.gap = read_gap(path / "gap.json")
    if (path / "eval.json").is_file():
        run.evals = json.loads((path / "eval.json").read_text())
    return run


def read_gap(path: Path) -> dict:
    """gap.json, checked against the format in the module doc; `final` filled in."""
    try:
        gap = json.loads(path.read_text())
        base = gap["baseline"]
        label, previous = str(base["label"]), float(base["tokens_per_s"])
        steps = list(gap["steps"])
        final = dict(gap.get("final") or {"label": "reachable"})
        final["label"] = str(final["label"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: expected {{'baseline': {{'label', 'tokens_per_s'}}, 'steps': [...]}} "
                         f"({e!r})") from None
    for i, step in enumerate(steps):
        if "skipped" in step:
            if "factor" not in step:
                raise ValueError(f"{path}: steps[{i}] lacks ['factor']")
            continue
        missing = {"factor", "tokens_per_s", "delta", "fix"} - set(step)
        if missing:
            raise ValueError(f"{path}: steps[{i}] lacks {sorted(missing)}")
        expected = step["tokens_per_s"] - previous
        if not math.isclose(step["delta"], expected, rel_tol=0.01, abs_tol=1.0):
            raise ValueError(f"{path}: steps[{i}] ({step['factor']}): delta {step['delta']} but tokens_per_s "
                             f"goes from {previous} to {step['tokens_per_s']} ({expected:+})")
        previous = step["tokens_per_s"]
    ceiling = gap.get("ceiling")
    if ceiling is not None and not (isinstance(ceiling, dict) and isinstance(ceiling.get("tokens_per_s"), (int, float))
                                    and ceiling["tokens_per_s"] > 0 and "label" in ceiling):
        raise ValueError(f"{path}: ceiling must be {{'label', 'tokens_per_s' > 0}}, got {ceiling!r}")
    return {**gap, "baseline": {**base, "label": label, "tokens_per_s": float(base["tokens_per_s"])},
            "steps": steps, "final": final}


# ---------------------------------------------------------------------------------------------
# numbers


def throughput(run: Run) -> dict:
    """Real tokens, trained tokens and tokens/s of the run.

    steady: real tokens over the time of the logged windows, each window's time being
    real_tokens / tokens_per_s (the windows tile the training from the first step to the last log,
    checkpoints and evaluations inside them included; a window's rate leaves out the run's compiling first
    step, and a window of that step alone, compute_tokens_per_s null, is left out). end_to_end: real tokens
    over the wall time (startup included) when time records exist.
    """
    real = sum(r.get("real_tokens", 0) for r in run.train)
    trained = sum(r.get("trained_tokens", 0) for r in run.train)
    steady = [r for r in run.train if r.get("tokens_per_s") and r.get("real_tokens")
              and not ("compute_tokens_per_s" in r and r["compute_tokens_per_s"] is None)]
    seconds = sum(r["real_tokens"] / r["tokens_per_s"] for r in steady)
    steady_real = sum(r["real_tokens"] for r in steady)
    totals = session_totals(run.time)
    out = {"real_tokens": real, "trained_tokens": trained, "steady": steady_real / seconds if seconds else None,
           "end_to_end": real / totals["wall"] if totals and totals["wall"] > 0 else None}
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    out["mfu"] = sum(mfus) / len(mfus) if mfus else None
    return out


def checkpoint_steps(run: Run) -> list[int]:
    every = (run.config.get("checkpoint") or {}).get("every") or 0
    last = run.train[-1]["step"] if run.train else 0
    if not every or not last:
        return []
    # (from step, interval): a fixed interval from the start; auto's choices from the steps they were made at
    spans = [(0, every)] if every != "auto" else [(r["step"], r["every"]) for r in run.intervals if r.get("every")]
    steps = []
    for (start, n), (end, _) in zip(spans, [*spans[1:], (last, 0)]):
        steps += range((start // n + 1) * n, min(end, last) + 1, n)
    return steps if steps and steps[-1] == last else [*steps, last]  # the loop also saves the last step


def findings(run: Run) -> list[Finding]:
    step_times = {r["step"]: r["elapsed_s"] for r in run.train if "elapsed_s" in r}
    found = diagnose(joined_sessions(run.gpu), session_totals(run.time), checkpoint_steps(run), step_times,
                     ranks=gpu_ranks(run) or None)
    if run.compile:
        frames = sum(r.get("frames_not_compiled", 0) for r in run.compile)
        found.append(Finding(
            "compiled layers partly eager", f"torch.compile gave up on {frames} frame(s) in the first step, which "
            "then ran eager (metrics.jsonl, kind compile)",
            "rerun a few steps with TORCH_LOGS=recompiles,graph_breaks to see why; a recompile limit hit means "
            "code guarding on something per layer"))
    return found


def gpu_ranks(run: Run) -> dict[int, list[dict]]:
    """A run of several processes with the GPU monitor's files: every rank's samples, each rank's sessions joined
    (`joined_sessions`), [] for a rank of the run without a file or samples; {} for one process or no GPU files.
    The ranks are those of the files and of the last training record's world_size (a run resumed at another world
    size keeps the files of ranks it no longer has)."""
    world = max((r.get("world_size", 1) for r in run.train[-1:]), default=1)
    ranks = set(run.gpu_ranks) | set(range(world))
    if not run.gpu_ranks or len(ranks) < 2:
        return {}
    return {r: joined_sessions(run.gpu_ranks.get(r, [])) for r in sorted(ranks)}


def joined_sessions(samples: list[dict]) -> list[dict]:
    """GPU samples on one time axis: a resumed run's samples restart at t=0; shift each session to follow the last."""
    out, offset, last = [], 0.0, None
    for s in samples:
        if last is not None and s["t"] < last:
            offset += last
        last = s["t"]
        out.append({**s, "t": s["t"] + offset})
    return out


# ---------------------------------------------------------------------------------------------
# plots: one matplotlib Figure each (no pyplot, so no global figure state), returned as PNG bytes


OUTLIER_UTIL = 3.0  # per-rank table: a rank is named lowest in utilisation this many points under the others' mean
OUTLIER_MEM_MIB = 512.0  # ... highest in memory this far above the lowest rank's peak
SMALL, WIDE = 5.6, 10.2  # inches at 110 dpi: a grid cell (~535 px, shown downscaled) and the full width (~1100 px)


def _figure(height: float = 3.2, width: float = SMALL, rows: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, color=COLORS["grid"], linewidth=0.8)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.tick_params(labelsize=8)
    return fig, axes


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def _step_axis(ax, run: Run) -> None:
    """The training plots share one step axis: the same limits on each, from step 0 to the last logged step."""
    last = run.train[-1]["step"] if run.train else 1
    ax.set_xlim(0, max(last, 1))
    ax.set_xlabel("step", fontsize=9)


def plot_loss(run: Run) -> bytes:
    fig, (ax,) = _figure()
    ax.plot([r["step"] for r in run.train], [r["loss"] for r in run.train], color=COLORS["train"], lw=1.4,
            label="train loss")
    if run.eval:
        ax.plot([r["step"] for r in run.eval], [r["eval_loss"] for r in run.eval], "o-", color=COLORS["eval"],
                ms=4, lw=1.2, label="eval loss")
    _step_axis(ax, run)
    ax.set_ylabel("loss (per trained token)", fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    return _png(fig)


def plot_lr(run: Run) -> bytes:
    fig, (ax,) = _figure()
    ax.plot([r["step"] for r in run.train], [r["lr"] for r in run.train], color=COLORS["train"], lw=1.4)
    _step_axis(ax, run)
    ax.set_ylabel("learning rate", fontsize=9)
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:.2e}" if v else "0")
    return _png(fig)


def plot_tokens_per_s(run: Run, steady: float | None) -> bytes:
    fig, (ax,) = _figure()
    ax.plot([r["step"] for r in run.train], [r["tokens_per_s"] for r in run.train], color=COLORS["train"], lw=1.4,
            label="each logged window")
    if steady:
        ax.axhline(steady, color=COLORS["base"], ls="--", lw=1, label=f"run: {steady:,.0f}")
    ax.set_ylim(bottom=0)
    _step_axis(ax, run)
    ax.set_ylabel("real tokens / s", fontsize=9)
    ax.legend(fontsize=8, frameon=False, loc="lower right")
    return _png(fig)


def plot_grad_norm(run: Run) -> bytes:
    """The global gradient norm before clipping at each logged step, and the clipping threshold."""
    fig, (ax,) = _figure()
    rows = [r for r in run.train if r.get("grad_norm") is not None]
    ax.plot([r["step"] for r in rows], [r["grad_norm"] for r in rows], color=COLORS["train"], lw=1.4,
            label="grad norm (before clipping)")
    clip = (run.config.get("optim") or {}).get("grad_clip")
    if clip:
        ax.axhline(clip, color=COLORS["down"], ls="--", lw=1, label=f"optim.grad_clip {clip:g}")
    ax.set_ylim(bottom=0)
    _step_axis(ax, run)
    ax.set_ylabel("L2 norm", fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    return _png(fig)


def plot_gpu(samples: list[dict]) -> bytes:
    fig, (top, bottom) = _figure(rows=2)
    t = [s["t"] for s in samples]
    top.plot(t, [s.get("util") for s in samples], color=COLORS["train"], lw=1.0)
    top.set_ylim(0, 105)
    top.set_ylabel("utilisation %", fontsize=9)
    used = [None if s.get("mem_used_mib") is None else s["mem_used_mib"] / 1024 for s in samples]
    bottom.plot(t, used, color=COLORS["eval"], lw=1.2, label="used")
    totals = [s["mem_total_mib"] / 1024 for s in samples if s.get("mem_total_mib")]
    if totals:
        bottom.axhline(max(totals), color=COLORS["base"], ls="--", lw=1, label=f"total {max(totals):.0f} GiB")
        bottom.set_ylim(0, max(totals) * 1.08)
    bottom.set_ylabel("memory GiB", fontsize=9)
    bottom.set_xlabel("run time (s)", fontsize=9)
    bottom.legend(fontsize=8, frameon=False, loc="lower right")
    return _png(fig)


def signed(value: float) -> str:
    """A change in tokens/s with its sign: whole numbers from 10 up, one decimal below (never "-0")."""
    return f"{value:+,.0f}" if abs(value) >= 9.95 else f"{value:+.1f}".replace("-0.0", "0.0").replace("+0.0", "0.0")


def rank_records(run: Run) -> list[dict]:
    """The training records of a run of several processes (torchrun, world size > 1) that carry the per-rank
    meter (gapless.train.parallel.aggregate; a run folder written before it has none); [] otherwise."""
    return [r for r in run.train if r.get("world_size", 1) > 1 and "slowest_rank" in r]


def plot_ranks(run: Run) -> bytes:
    """Per logged window, milliseconds per step: exposed communication, overlapped communication and the mean
    rank's waiting for slower ranks (gapless.train.parallel defines them)."""
    fig, (ax,) = _figure()
    rows = rank_records(run)
    steps = [r["step"] for r in rows]

    def per_step(key: str) -> list:
        return [None if r.get(key) is None else 1e3 * r[key] / max(r.get("window_steps", 1), 1) for r in rows]

    ax.plot(steps, per_step("comm_exposed_s"), color=COLORS["down"], lw=1.4, marker="o", ms=3, label="exposed")
    ax.plot(steps, per_step("comm_overlapped_s"), color=COLORS["up"], lw=1.2, marker="o", ms=3, label="overlapped")
    ax.plot(steps, per_step("collective_wait_s_mean"), color=COLORS["eval"], lw=1.2, marker="o", ms=3,
            label="waiting for ranks (mean)")
    ax.set_ylim(bottom=0)
    _step_axis(ax, run)
    ax.set_ylabel("ms per step", fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    return _png(fig)


def ranks_section(run: Run, png: bytes | None = None) -> str:
    """Several processes: the slowest rank, the spread of real tokens per rank, the waiting and the communication
    (exposed and overlapped), over the run's logged windows, as a table, and per window as a plot."""
    rows = rank_records(run)
    steady = [r for r in rows if r.get("compute_tokens_per_s") is not None] or rows  # the warm-up's window out
    steps = max(sum(r.get("window_steps", 0) for r in steady), 1)
    seconds = sum(r["rank_step_s_max"] for r in steady)
    last = rows[-1]

    def ms(key: str) -> str | None:
        if any(r.get(key) is None for r in steady):
            return None
        total = sum(r[key] for r in steady)
        return f"{1e3 * total / steps:.2f} ms per step ({100 * total / max(seconds, 1e-9):.1f}% of the time)"

    slowest = [r["slowest_rank"] for r in steady]
    top = max(set(slowest), key=slowest.count)  # the rank the others waited for in most windows
    its = [r for r in steady if r["slowest_rank"] == top]
    own = 1e3 * sum(r["slowest_rank_compute_s"] for r in its) / max(sum(r.get("window_steps", 0) for r in its), 1)
    items = [("processes", f"{last['world_size']} ({last['strategy']})"),
             ("slowest rank", f"rank {top}: the others waited for it in {len(its)} of {len(steady)} windows; "
                              f"{own:.1f} ms of its own compute per step"),
             ("real tokens per rank", f"{sum(r['rank_real_tokens_min'] for r in steady):,} to "
              f"{sum(r['rank_real_tokens_max'] for r in steady):,} summed over the windows; the busiest rank "
              f"{100 * max(r['rank_imbalance'] for r in steady):.1f}% above an even share at worst, "
              f"{100 * sum(r['rank_imbalance'] for r in steady) / len(steady):.1f}% on average"),
             ("waiting for slower ranks", ms("collective_wait_s_mean") and
              f"{ms('collective_wait_s_mean')} on the mean rank; at most "
              f"{1e3 * sum(r['collective_wait_s_max'] for r in steady) / steps:.2f} ms per step on one rank"),
             ("communication, exposed", ms("comm_exposed_s") or last.get("comm_measured", "not measured")),
             ("communication, overlapped", ms("comm_overlapped_s") or "not measured"),
             ("communication alone", f"{1e3 * last['comm_serial_s_per_step']:.2f} ms per step: "
              f"{last['comm_bytes_per_step'] / 2 ** 20:,.1f} MiB at the bandwidth measured at the log points"),
             ("how measured", last.get("comm_measured"))]
    table = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in items if v)
    return (f'<table>{table}</table><p class="sub">over {len(steady)} logged windows, {steps} steps (the warm-up '
            "step's window left out); metrics.jsonl holds each window's numbers</p>"
            + _figure_html("Communication and waiting per step", png if png is not None else plot_ranks(run)))


def _binned(samples: list[dict], key: str, width: float) -> tuple[list[float], list[float]]:
    """The mean of `key` in bins of `width` seconds (x: each bin's middle): 8 ranks of a long run stay readable."""
    bins: dict[int, list[float]] = {}
    for s in samples:
        if s.get(key) is not None:
            bins.setdefault(int(s["t"] // width), []).append(s[key])
    keys = sorted(bins)
    return [(k + 0.5) * width for k in keys], [sum(bins[k]) / len(bins[k]) for k in keys]


def plot_gpu_ranks(ranks: dict[int, list[dict]]) -> bytes:
    """Each rank's GPU utilisation and memory used over run time, one line per rank, averaged in bins of 1/150 of
    the run (at least 1 s)."""
    fig, (top, bottom) = _figure(height=3.6, width=WIDE, rows=2)
    end = max((s["t"] for samples in ranks.values() for s in samples), default=1.0)
    width = max(end / 150, 1.0)
    for r, samples in ranks.items():
        if samples:
            top.plot(*_binned(samples, "util", width), color=f"C{r % 10}", lw=1.1, label=f"rank {r}")
            gib = [{"t": s["t"], "v": s["mem_used_mib"] / 1024} for s in samples if s.get("mem_used_mib") is not None]
            bottom.plot(*_binned(gib, "v", width), color=f"C{r % 10}", lw=1.1)
    top.set_ylim(0, 105)
    top.set_ylabel("utilisation %", fontsize=9)
    top.legend(fontsize=8, frameon=False, loc="lower left", bbox_to_anchor=(0, 1), ncol=min(len(ranks), 8))
    bottom.set_ylim(bottom=0)
    bottom.set_ylabel("memory used GiB", fontsize=9)
    bottom.set_xlabel(f"run time (s), means over {width:.0f} s", fontsize=9)
    return _png(fig)


def gpu_ranks_section(run: Run, png: bytes | None = None) -> str:
    """Several processes with the GPU monitor's files: one row per rank (gapless.meter.monitor.summarise), the
    spread over the ranks and the outlier rank of utilisation, throttling and memory, and the plot per rank."""
    ranks = gpu_ranks(run)
    totals = session_totals(run.time)
    stats = {r: summarise(samples, totals["startup"] if totals else 0.0) for r, samples in ranks.items()}
    recorded = {r: x for r, x in stats.items() if x["samples"]}

    def num(value, fmt: str, scale: float = 1.0) -> str:
        return "-" if value is None else format(value * scale, fmt)

    def share(x: dict, kind: str) -> str:
        return num(x.get(f"{kind}_share"), ".0%")

    rows = []
    for r, x in stats.items():
        if not x["samples"]:
            rows.append(f'<tr><td>{r}</td><td colspan="8">no samples: this rank\'s monitor recorded nothing (no '
                        'NVML there, or its file is missing)</td></tr>')
            continue
        rows.append(
            f"<tr><td>{r}</td><td>{html.escape(x['gpu'] or '-')}</td><td class=\"n\">{x['samples']:,}</td>"
            f"<td class=\"n\">{num(x['util_mean'], '.0f')} ({num(x['util_median'], '.0f')})</td>"
            f"<td class=\"n\">{num(x['mem_mean_mib'], '.1f', 1 / 1024)} / {num(x['mem_peak_mib'], '.1f', 1 / 1024)} "
            f"of {num(x['mem_total_mib'], '.0f', 1 / 1024)}</td>"
            f"<td class=\"n\">{num(x['power_mean_w'], '.0f')} of {num(x['power_limit_w'], '.0f')}</td>"
            f"<td class=\"n\">{num(x['sm_clock_mean_mhz'], '.0f')}</td>"
            f"<td class=\"n\">{num(x['temp_max_c'], '.0f')}</td>"
            f"<td class=\"n\">{share(x, 'power')} / {share(x, 'thermal')}</td></tr>")
    table = ("<table><tr><th>rank</th><th>GPU</th><th>samples</th><th>utilisation % mean (median)</th>"
             "<th>memory GiB mean / peak</th><th>power W mean</th><th>SM clock MHz (busy)</th><th>max &deg;C</th>"
             "<th>throttled: power / thermal (busy samples)</th></tr>" + "".join(rows) + "</table>")
    items = []
    if len(recorded) > 1:
        def spread(key: str, what: str, fmt: str, scale: float = 1.0, unit: str = "",
                   apart: str = "") -> tuple[str, str] | None:
            have = {r: x[key] * scale for r, x in recorded.items() if x.get(key) is not None}
            if len(have) < 2:
                return None
            lo, hi = min(have, key=have.get), max(have, key=have.get)
            if f"{have[lo]:{fmt}}" == f"{have[hi]:{fmt}}":
                return what, f"{have[lo]:{fmt}}{unit} on every rank"
            return what, (f"{have[lo]:{fmt}}{unit} (rank {lo}) to {have[hi]:{fmt}}{unit} (rank {hi}), a spread of "
                          f"{have[hi] - have[lo]:{fmt}}{apart or unit}")

        items += [spread("util_mean", "utilisation, mean per rank", ".0f", unit="%", apart=" points"),
                  spread("mem_peak_mib", "memory peak per rank", ".1f", 1 / 1024, " GiB"),
                  spread("power_mean_w", "power, mean per rank", ".0f", unit=" W"),
                  spread("sm_clock_mean_mhz", "SM clock when busy, mean per rank", ".0f", unit=" MHz")]
        utils = {r: x["util_mean"] for r, x in recorded.items() if x["util_mean"] is not None}
        low = min(utils, key=utils.get, default=None)
        rest = [u for r, u in utils.items() if r != low]
        if rest and sum(rest) / len(rest) - utils[low] >= OUTLIER_UTIL:
            items.append(("lowest utilisation", f"rank {low}: {utils[low]:.0f}% mean against "
                                                f"{sum(rest) / len(rest):.0f}% on the other ranks"))
        throttled = {r: (x["power_share"] or 0) + (x["thermal_share"] or 0) for r, x in recorded.items()}
        worst = max(throttled, key=throttled.get)
        if throttled[worst] > 0:
            x = recorded[worst]
            items.append(("most throttled", f"rank {worst}: power-capped in {share(x, 'power')} and thermally limited "
                                            f"in {share(x, 'thermal')} of its busy samples; each step waits for the "
                                            "slowest rank"))
        peaks = {r: x["mem_peak_mib"] for r, x in recorded.items() if x["mem_peak_mib"] is not None}
        if len(peaks) > 1 and max(peaks.values()) - min(peaks.values()) >= OUTLIER_MEM_MIB:
            top = max(peaks, key=peaks.get)
            above = (peaks[top] - min(peaks.values())) / 1024
            items.append(("highest memory", f"rank {top}: peak {peaks[top] / 1024:.1f} GiB, {above:.1f} GiB above "
                                            "the lowest rank"))
    summary = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in filter(None, items))
    plot = png if png is not None else (plot_gpu_ranks(ranks) if recorded else None)
    return (f"<h3>GPUs per rank</h3>{table}" + (f'<table style="margin-top:10px">{summary}</table>' if summary else "")
            + '<p class="sub">from gpu.jsonl (rank 0) and gpu.rank{r}.jsonl (rank r): utilisation after startup, '
            "memory, power and temperature over every sample</p>"
            + _figure_html("GPU utilisation and memory per rank", plot, "no rank recorded GPU samples"))


def plot_gap(gap: dict) -> bytes:
    """The waterfall (the ceiling for the user's lengths, when gap.json has it, as an outlined bar before the
    baseline; the baseline; one floating bar per measured step, its delta; the final bar) and, below it, each
    step's change as a share of the baseline on its own scale, so a cost of 0.5% is as visible as one of 50%."""
    from matplotlib.figure import Figure

    steps = [s for s in gap["steps"] if "skipped" not in s]
    base = gap["baseline"]["tokens_per_s"]
    final = steps[-1]["tokens_per_s"] if steps else base
    ceiling = (gap.get("ceiling") or {}).get("tokens_per_s")
    fig = Figure(figsize=(WIDE, 5.6 if steps else 3.4), layout="constrained")
    axes = fig.subplots(2 if steps else 1, 1, squeeze=False, gridspec_kw={"height_ratios": [3, 2]} if steps else None)
    for ax in axes[:, 0]:
        ax.grid(True, color=COLORS["grid"], linewidth=0.8)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.tick_params(labelsize=8)
    ax = axes[0, 0]
    first = -1 if ceiling else 0
    labels = ([gap["ceiling"]["label"]] if ceiling else []) + [gap["baseline"]["label"]] + \
        [s["factor"] for s in steps] + [(gap.get("final") or {}).get("label", "reachable")]
    if ceiling:
        ax.bar(-1, ceiling, color="none", edgecolor=COLORS["base"], hatch="//", width=0.6)
        ax.text(-1, ceiling, f"{ceiling:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.bar(0, base, color=COLORS["base"], width=0.6)
    ax.text(0, base, f"{base:,.0f}", ha="center", va="bottom", fontsize=8)
    previous = base
    for i, s in enumerate(steps, 1):
        delta = s["tokens_per_s"] - previous
        ax.bar(i, delta, bottom=previous, color=COLORS["up"] if delta >= 0 else COLORS["down"], width=0.6)
        ax.text(i, max(previous, s["tokens_per_s"]), signed(delta), ha="center", va="bottom", fontsize=8)
        ax.plot([i - 1 + 0.3, i - 0.3], [previous, previous], color=COLORS["base"], lw=0.8, ls=":")
        previous = s["tokens_per_s"]
    n = len(steps) + 1
    ax.plot([n - 1 + 0.3, n - 0.3], [previous, previous], color=COLORS["base"], lw=0.8, ls=":")
    ax.bar(n, final, color=COLORS["train"], width=0.6)
    share = f" ({100 * final / base:.0f}%" + (f", {100 * final / ceiling:.0f}% of the ceiling)" if ceiling else ")")
    ax.text(n, final, f"{final:,.0f}{share if base else ''}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(first, n + 1), labels, fontsize=8, rotation=20 if len(labels) > 6 else 0, ha="center")
    ax.set_ylabel("real tokens / s", fontsize=9)
    ax.set_ylim(0, max(base, final, ceiling or 0, *(s["tokens_per_s"] for s in steps)) * 1.12)
    ax.grid(False, axis="x")
    if steps:  # the zoom: the changes on a scale set by the second largest, the largest clipped at the edge
        zoom = axes[1, 0]
        changes = [100 * s["delta"] / base for s in steps] if base else [0.0] * len(steps)
        sizes = sorted(map(abs, changes), reverse=True)
        span = (sizes[1] if len(sizes) > 1 and sizes[1] > 0 else sizes[0]) or 1.0
        y = range(len(steps))
        shown = [max(-1.2 * span, min(1.2 * span, c)) for c in changes]
        zoom.barh(y, shown, color=[COLORS["up"] if c >= 0 else COLORS["down"] for c in changes], height=0.6,
                  hatch=["//" if c != v else "" for c, v in zip(changes, shown)])
        for yi, c, v in zip(y, changes, shown):
            clipped = " (clipped)" if c != v else ""
            zoom.text(v, yi, f" {c:+.2f}%{clipped} ", va="center", ha="left" if c >= 0 else "right", fontsize=8)
        zoom.set_xlim(-span * 1.6, span * 1.6)
        zoom.set_yticks(list(y), [s["factor"] for s in steps], fontsize=8)
        zoom.invert_yaxis()
        zoom.axvline(0, color=COLORS["base"], lw=0.8)
        zoom.set_xlabel(f"change, % of {gap['baseline']['label']} (zoomed to the second largest; larger ones "
                        "clipped)", fontsize=9)
        zoom.grid(False, axis="y")
    return _png(fig)


# ---------------------------------------------------------------------------------------------
# the page

CSS = """
body{margin:0;background:#f5f6f8;color:#1d2733;
font:14px/1.45 -apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif}
main{max-width:1120px;margin:0 auto;padding:24px 28px 48px}
h1{font-size:22px;margin:0 0 2px}h1 span{color:#5d6b78;font-weight:400}
h2{font-size:16px;margin:28px 0 10px;padding-bottom:4px;border-bottom:1px solid #dde1e6}
.sub{color:#5d6b78;margin:0 0 18px;font-size:12px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(160px,1fr));gap:10px}
.card{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:10px 12px}
.card .v{font-size:19px;font-weight:600;font-variant-numeric:tabular-nums}.card .k{color:#5d6b78;font-size:12px}
table{border-collapse:collapse;background:#fff;border:1px solid #dde1e6;font-size:13px}
td,th{padding:4px 10px;border-bottom:1px solid #eceff2;text-align:left;vertical-align:top}
th{background:#f0f2f5;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.config{display:grid;grid-template-columns:repeat(auto-fill,minmax(320px,1fr));gap:0 18px}
.config div{display:flex;justify-content:space-between;align-items:baseline;border-bottom:1px solid #e6e8eb;
padding:3px 0}
.config span:first-child{color:#5d6b78}.config span:last-child{font-family:ui-monospace,Menlo,Consolas,monospace;
font-size:12px;overflow-wrap:anywhere;text-align:right;padding-left:12px}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:14px}
figure{margin:0;background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:8px}
figure img{width:100%;height:auto;display:block}figcaption{font-size:13px;font-weight:600;margin:0 0 4px 4px}
.note{background:#fff;border:1px dashed #c3cad2;border-radius:6px;padding:14px;color:#5d6b78}
.finding{background:#fff;border:1px solid #dde1e6;border-left:4px solid #c8473d;border-radius:4px;padding:8px 12px;
margin-bottom:8px}.finding b{display:block}.finding .e,.finding .f{font-size:13px}.finding .f{color:#2f5f3a}
.ok{border-left-color:#3a9a5b}
table.time{width:100%;border:0}td.bar{width:55%}td.bar span{display:block;height:12px;min-width:2px;border-radius:2px}
"""


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def _figure_html(title: str, png: bytes | None, note: str = "") -> str:
    body = _img(png, title) if png is not None else f'<div class="note">{html.escape(note)}</div>'
    return f"<figure><figcaption>{html.escape(title)}</figcaption>{body}</figure>"


def checkpoint_every_text(every, intervals: list[dict]) -> object:
    """checkpoint.every as the run used it: auto with the intervals it chose (metrics.jsonl's checkpoint_interval
    records: "auto: 10 from step 4, 25 from step 10"), else the config's value."""
    chosen = [f"{r['every']} from step {r['step']}" for r in intervals if r.get("every")]
    return f"auto: {', '.join(chosen)}" if every == "auto" and chosen else every


def _config_rows(config: dict, intervals: list[dict] = ()) -> list[tuple[str, str]]:
    def get(dotted: str):
        node = config
        for key in dotted.split("."):
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    data = config.get("data") or {}
    sources = ", ".join(str(s.get("name") or s.get("path")) for s in data.get("sources") or [])
    rows = [("model", get("model.path")), ("dtype / device", _join(get("model.dtype"), get("model.device"))),
            ("ran on", get("environment.device_name")),
            ("method", get("method")),
            ("LoRA r / alpha", _join(get("lora.r"), get("lora.alpha")) if get("method") == "lora" else None),
            ("LoRA kernel", get("lora.kernel") if get("method") == "lora" else None),
            ("attention / compile", _join(get("model.attn_backend"),
                                          {True: "compiled layers", False: "eager"}.get(get("model.compile"),
                                                                                       get("model.compile")),
                                          sep=", ")),
            ("data", sources or None),
            ("batching", _join(_join(get("data.batching"), get("data.tokens_per_batch"), sep=", tokens/batch "),
                               get("data.rows_per_batch"), sep=", documents/batch at most ")),
            ("max_seq_len", get("data.max_seq_len")), ("grad_accum", get("train.grad_accum")),
            ("steps / epochs", _join(get("train.steps") or "-", get("train.epochs"))),
            ("optimizer lr", get("optim.lr")), ("schedule", _join(get("schedule.kind"), _warmup(config), sep=", ")),
            ("checkpoint every", checkpoint_every_text(get("checkpoint.every"), list(intervals))),
            ("seed", get("train.seed"))]
    return [(k, f"{v:g}" if isinstance(v, float) else str(v)) for k, v in rows if v is not None]


def _warmup(config: dict) -> str | None:
    schedule = config.get("schedule") or {}
    if schedule.get("warmup_steps"):
        return f"warmup {schedule['warmup_steps']} steps"
    if schedule.get("warmup_ratio"):
        return f"warmup {schedule['warmup_ratio']:.0%} of steps"
    return None


def _join(*values, sep: str = " / ") -> str | None:
    present = [str(v) for v in values if v is not None]
    return sep.join(present) if present else None


def _card(value: str, key: str) -> str:
    return f'<div class="card"><div class="v">{html.escape(value)}</div><div class="k">{html.escape(key)}</div></div>'


def plots_of(run: Run) -> dict[str, bytes | None]:
    """The report's plots, the slow part of writing it (matplotlib: ~1 s for a 400-step run on a small CPU). They
    read the training, GPU and gap records only, so the loop draws them before its last record and writes the page
    around them after it, in milliseconds: the page then prints the last record's numbers, and that record still
    holds the run's every second."""
    grad_norms = any("grad_norm" in r for r in run.train)
    ranks = gpu_ranks(run)
    return {"loss": plot_loss(run) if run.train else None, "lr": plot_lr(run) if run.train else None,
            "grad_norm": plot_grad_norm(run) if grad_norms else None,
            "tokens_per_s": plot_tokens_per_s(run, throughput(run)["steady"]) if run.train else None,
            "gpu": plot_gpu(joined_sessions(run.gpu)) if run.gpu else None,
            "gap": plot_gap(run.gap) if run.gap else None,
            "ranks": plot_ranks(run) if rank_records(run) else None,
            "gpu_ranks": plot_gpu_ranks(ranks) if any(ranks.values()) else None}


def time_bars(totals: dict[str, float], title: str) -> str:
    """The time accounting as a table with a bar per category (HTML, no plot: a share of 0.1% still shows)."""
    wall = max(totals["wall"], 1e-9)
    rows = "".join(f'<tr><td>{LABELS[c]}</td><td class="n">{totals[c]:,.1f}</td>'
                   f'<td class="n">{100 * totals[c] / wall:.1f}%</td><td class="bar"><span style="width:'
                   f'{100 * totals[c] / wall:.2f}%;background:{CATEGORY_COLORS[c]}"></span></td></tr>'
                   for c in CATEGORIES)
    return (f'<figure><figcaption>{html.escape(title)}</figcaption><table class="time"><tr><th>category</th>'
            f'<th>seconds</th><th>share</th><th></th></tr>{rows}<tr><th>wall</th><th class="n">{totals["wall"]:,.1f}'
            '</th><th class="n">100%</th><th></th></tr></table></figure>')


def render(run: Run, plots: dict[str, bytes | None] | None = None) -> str:
    """The report page of `run` as one HTML string (`plots`: plots_of(run), drawn earlier)."""
    plots = plots if plots is not None else plots_of(run)
    numbers = throughput(run)
    totals = session_totals(run.time)
    last = run.train[-1] if run.train else {}
    cards = [_card(f"{last.get('step', 0):,}", "optimizer steps"),
             _card(f"{last['loss']:.4f}" if last else "-", "final train loss")]
    if run.eval:
        cards.append(_card(f"{run.eval[-1]['eval_loss']:.4f}", "final eval loss"))
    cards.append(_card(f"{numbers['real_tokens']:,}", "real tokens (no padding)"))
    if numbers["steady"]:
        cards.append(_card(f"{numbers['steady']:,.0f}", "real tokens/s, training"))
    if numbers["end_to_end"]:
        cards.append(_card(f"{numbers['end_to_end']:,.0f}", "real tokens/s, end to end"))
    if numbers["mfu"] is not None:
        cards.append(_card(f"{100 * numbers['mfu']:.1f}%", "MFU (mean over the run)"))
    if totals:
        cards.append(_card(_duration(totals["wall"]), "wall time"))

    found = findings(run)
    monitor_note = "" if run.gpu else (" No gpu.jsonl: the GPU monitor did not run (a CPU run, or NVML not "
                                       "available), so the rules use the time accounting only.")
    if found:
        finding_html = "".join(f'<div class="finding"><b>{html.escape(f.cause)}</b>'
                               f'<div class="e">{html.escape(f.evidence)}</div>'
                               f'<div class="f">fix: {html.escape(f.fix)}</div></div>' for f in found)
    else:
        finding_html = (f'<div class="finding ok"><b>no findings</b><div class="e">none of the rules (input-bound, '
                        f'I/O-bound, throttling, under-used GPU, eager compiled layers) fired.</div></div>')
    if monitor_note:
        finding_html += f'<p class="note">{html.escape(monitor_note.strip())}</p>'

    none = "no training records yet"
    figures = [_figure_html("Loss", plots["loss"], none), _figure_html("Learning rate", plots["lr"], none),
               _figure_html("Gradient norm", plots["grad_norm"], "no grad_norm in the training records"),
               _figure_html("Throughput (real tokens/s)", plots["tokens_per_s"], none),
               _figure_html("GPU utilisation and memory" + (" (rank 0)" if gpu_ranks(run) else ""), plots["gpu"],
                            "No gpu.jsonl in this run: the GPU monitor did not run (a CPU run, or NVML not available).")]

    if totals:
        sessions = len({r["started"] for r in run.time})
        resumed = f" over {sessions} sessions (resumed)" if sessions > 1 else ""
        time_html = time_bars(totals, f"Where the time went{resumed}")
    else:
        time_html = '<div class="note">No time records ({"kind": "time"}) in metrics.jsonl.</div>'

    gap_html = f"<h2>Throughput gap</h2>{gap_section(run.gap, plots['gap'])}" if run.gap else ""
    several = bool(gpu_ranks(run))
    ranks_html = ("<h2>Ranks and communication</h2>"
                  + (ranks_section(run, plots.get("ranks")) if rank_records(run) else "")
                  + (gpu_ranks_section(run, plots.get("gpu_ranks")) if several else "")
                  if rank_records(run) or several else "")
    eval_html = f"<h2>Evaluations (gapless eval)</h2>{eval_section(run.evals)}" if run.evals else ""

    env = run.environment[-1] if run.environment else {}
    config_html = "".join(f"<div><span>{html.escape(k)}</span><span>{html.escape(v)}</span></div>"
                          for k, v in _config_rows({**run.config, "environment": env}, run.intervals)
                          ) or "<p class='note'>no config.yaml</p>"
    name = html.escape(run.path.resolve().name)
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    sources = ", ".join(["metrics.jsonl"] + ["gpu.jsonl"] * bool(run.gpu)
                        + ["gpu.rank*.jsonl"] * bool(set(run.gpu_ranks) - {0}) + ["gap.json"] * bool(run.gap))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gapless report: {name}</title><style>{CSS}</style></head>
<body><main>
<h1>gapless run report <span>{name}</span></h1>
<p class="sub">{html.escape(str(run.path.resolve()))} &middot; generated {when} from {sources}</p>
<div class="cards">{''.join(cards)}</div>
<h2>Findings</h2>{finding_html}
<h2>Run config</h2><div class="config">{config_html}</div>
<h2>Training</h2><div class="grid">{''.join(figures)}</div>
<h2>Time accounting</h2>{time_html}
{ranks_html}
{eval_html}
{gap_html}
</main></body></html>
"""


def eval_section(evals: list[dict]) -> str:
    """One row per `gapless eval` record, and the sample generations of the newest exact-match one."""
    rows = []
    for r in evals:
        if r["kind"] == "loss":
            result = f"loss {r['loss']:.4f}, perplexity {r['perplexity']:.2f} ({r['tokens']:,} tokens)"
        else:
            result = f"exact match {r['correct']}/{r['total']} = {r['exact_match']:.1%}"
        rows.append(f"<tr><td>{html.escape(r.get('time', ''))}</td><td>{html.escape(r['data'])}</td>"
                    f"<td>{html.escape(result)}</td></tr>")
    samples = next((r["samples"] for r in reversed(evals) if r.get("samples")), [])
    sample_rows = "".join(f"<tr><td>{html.escape(s['question'])}</td><td>{html.escape(str(s['expected']))}</td>"
                          f"<td>{html.escape(s['reply'])}</td></tr>" for s in samples)
    return ("<table><tr><th>when</th><th>data</th><th>result</th></tr>" + "".join(rows) + "</table>"
            + ("<h3>Sample generations</h3><table><tr><th>prompt</th><th>expected</th><th>reply</th></tr>"
               + sample_rows + "</table>" if samples else ""))


def gap_section(gap: dict, png: bytes | None = None) -> str:
    """The waterfall (`png`: plot_gap(gap), drawn earlier) and its table, one row per step (skipped ones with their
    reason)."""
    base = gap["baseline"]["tokens_per_s"]

    def esc(value) -> str:
        return html.escape(str(value))

    ceiling = gap.get("ceiling")
    rows = [f'<tr><td>{esc(ceiling["label"])}</td><td></td><td class="n">{ceiling["tokens_per_s"]:,.0f}</td><td></td>'
            f'<td class="n">{100 * ceiling["tokens_per_s"] / base:.0f}%</td><td></td>'
            f'<td>{esc(ceiling.get("note", ""))}</td></tr>'] if ceiling else []
    rows.append(f'<tr><th>{esc(gap["baseline"]["label"])}</th><td></td><td class="n">{base:,.0f}</td><td></td>'
                f'<td class="n">100%</td><td></td><td>{esc(gap["baseline"].get("note", ""))}</td></tr>')
    value = base
    for s in gap["steps"]:
        if "skipped" in s:
            rows.append(f'<tr><td>{esc(s["factor"])}</td><td colspan="6">skipped: {esc(s["skipped"])}</td></tr>')
            continue
        value = s["tokens_per_s"]
        rows.append(f'<tr><td>{esc(s["factor"])}</td><td>{esc(s.get("setting", ""))}</td>'
                    f'<td class="n">{value:,.0f}</td><td class="n">{signed(s["delta"])}</td>'
                    f'<td class="n">{100 * value / base:.1f}%</td><td>{esc(proposed_fix(s))}</td>'
                    f'<td>{esc(s.get("note", ""))}</td></tr>')
    rows.append(f'<tr><th>{esc(gap["final"]["label"])}</th><td></td><th class="n">{value:,.0f}</th>'
                f'<th class="n">{signed(value - base)}</th><th class="n">{100 * value / base:.1f}%</th><td></td>'
                '<td>the sum of the changes above</td></tr>')
    noise = (gap.get("measured") or {}).get("noise")  # `gapless gap`: two windows of the baseline's conditions
    noise_html = ("" if noise is None else f'<p class="sub">noise: two windows of {esc(gap["baseline"]["label"])} '
                  f'differ by {100 * noise:.1f}%; changes within it are not costs</p>')
    return (_figure_html("Throughput gap, factor by factor", png if png is not None else plot_gap(gap))
            + '<table style="margin-top:10px"><tr><th>factor</th><th>setting</th><th>tokens/s</th><th>change</th>'
            f'<th>of {esc(gap["baseline"]["label"])}</th><th>fix</th><th>how measured</th></tr>{"".join(rows)}</table>'
            + noise_html)


def proposed_fix(step: dict) -> str:
    """The step's fix, without any alternative that is the value already set (`checkpoint.every: 500` proposed to a
    run with checkpoint.every 500 asks the user to change nothing)."""
    setting = _settings(step.get("setting", ""))
    kept = [alt for alt in step.get("fix", "").split(" or ") if not (_settings(alt) and _settings(alt) <= setting)]
    if step.get("fix") and not kept:
        return "none: the proposed value is already set"
    return " or ".join(kept)


def _settings(text: str) -> set[tuple[str, str]]:
    """`key: value` pairs of a setting or fix text (`a: 1 with b: 2` -> {(a, 1), (b, 2)}); empty for prose."""
    pairs = set()
    for part in text.split(" with "):
        key, sep, value = part.partition(": ")
        if not sep or " " in key.strip():
            return set()
        pairs.add((key.strip(), value.split(" (")[0].strip()))
    return pairs


def gap_title(gap: dict) -> str:
    """The gap page's title: model, GPU, date and config, as far as gap.json records them."""
    m = gap.get("measured") or {}
    parts = [m.get("model") and Path(str(m["model"])).name, m.get("device_name") or m.get("device"),
             m.get("dtype"), m.get("date"), gap.get("config") and Path(str(gap["config"])).name]
    return "gapless gap: " + ", ".join(str(p) for p in parts if p) if any(parts) else \
        f"gapless gap: {gap['baseline']['label']} to {gap['final']['label']}"


def write_gap_page(gap: dict, path: Path) -> Path:
    """A self-contained page with the gap's waterfall and table (`gapless gap`'s gap.html)."""
    title = gap_title(gap)
    path.write_text(f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{CSS}</style></head>
<body><main><h1>{html.escape(title)}</h1>{gap_section(gap)}</main></body></html>
""", encoding="utf-8")
    return path


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s"


def write_report(run_dir: str | Path, pending: list[dict] = (), plots: dict | None = None) -> Path:
    """Write RUN/report.html (self-contained) and return its path (`pending`: see read_run; `plots`: plots_of)."""
    run = read_run(run_dir, pending)
    out = run.path / "report.html"
    tmp = out.with_name(f".report.html.tmp-{os.getpid()}")  # a rename: a reader never sees half a report
    try:
        tmp.write_text(render(run, plots), encoding="utf-8")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# ---------------------------------------------------------------------------------------------
# several runs: `gapless report RUN_A RUN_B ...`

RUN_COLORS = ["#2f6db5", "#e07b28", "#3a9a5b", "#c8473d", "#7d5ba6", "#c9a227", "#5d6b78"]


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differences(items: list[dict]) -> list[tuple[str, list]]:
    """The keys whose values are not all equal across `items` (flat dicts), with each item's value."""
    keys = sorted({k for item in items for k in item})
    return [(k, [item.get(k) for item in items]) for k in keys if len({repr(item.get(k)) for item in items}) > 1]


def plot_overlay(runs: list[Run], key: str, ylabel: str, source: str = "train") -> bytes:
    fig, (ax,) = _figure(width=WIDE / 2)
    for i, run in enumerate(runs):
        rows = [r for r in getattr(run, source) if r.get(key) is not None]
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], color=RUN_COLORS[i % len(RUN_COLORS)], lw=1.3,
                marker="o" if source == "eval" else None, ms=3, label=_label(run, runs))
    last = max((r["step"] for run in runs for r in run.train), default=1)
    ax.set_xlim(0, max(last, 1))
    ax.set_xlabel("step", fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    return _png(fig)


def _label(run: Run, runs: list[Run]) -> str:
    names = [r.path.resolve().name for r in runs]
    return run.path.resolve().name if names.count(run.path.resolve().name) == 1 else str(run.path)


def render_compare(runs: list[Run]) -> str:
    """One page: the runs' curves overlaid on the step axis, their headline numbers, and every config and
    environment setting that differs between them."""
    labels = [_label(r, runs) for r in runs]
    head = "".join(f"<th>{html.escape(x)}</th>" for x in labels)

    def row(name: str, values: list[str]) -> str:
        return f"<tr><td>{html.escape(name)}</td>" + "".join(f'<td class="n">{html.escape(v)}</td>' for v in values) \
            + "</tr>"

    numbers = [throughput(r) for r in runs]
    totals = [session_totals(r.time) for r in runs]
    summary = [row("optimizer steps", [f"{r.train[-1]['step']:,}" if r.train else "-" for r in runs]),
               row("final train loss", [f"{r.train[-1]['loss']:.4f}" if r.train else "-" for r in runs]),
               row("final eval loss", [f"{r.eval[-1]['eval_loss']:.4f}" if r.eval else "-" for r in runs]),
               row("real tokens/s, training", [f"{n['steady']:,.0f}" if n["steady"] else "-" for n in numbers]),
               row("real tokens/s, end to end", [f"{n['end_to_end']:,.0f}" if n["end_to_end"] else "-"
                                                 for n in numbers]),
               row("wall time", [_duration(t["wall"]) if t else "-" for t in totals])]

    def diff_table(items: list[dict], what: str) -> str:
        diffs = differences(items)
        if not diffs:
            return f'<p class="note">no {what} differences</p>'
        return (f"<table><tr><th>{what}</th>{head}</tr>"
                + "".join(row(k, ["-" if v is None else str(v) for v in values]) for k, values in diffs) + "</table>")

    env_keys = ("device", "device_name", "device_count", "gapless", "torch", "cuda", "python", "host")
    envs = [{k: r.environment[-1].get(k) for k in env_keys} if r.environment else {} for r in runs]
    plots = [_figure_html("Loss", plot_overlay(runs, "loss", "train loss")),
             _figure_html("Gradient norm", plot_overlay(runs, "grad_norm", "L2 norm")),
             _figure_html("Throughput (real tokens/s)", plot_overlay(runs, "tokens_per_s", "real tokens / s")),
             _figure_html("Learning rate", plot_overlay(runs, "lr", "learning rate"))]
    if any(r.eval for r in runs):
        plots.append(_figure_html("Eval loss", plot_overlay(runs, "eval_loss", "eval loss", source="eval")))
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gapless compare: {html.escape(' vs '.join(labels))}</title>
<style>{CSS}</style></head>
<body><main>
<h1>gapless compare <span>{html.escape(' vs '.join(labels))}</span></h1>
<p class="sub">{' &middot; '.join(html.escape(str(r.path.resolve())) for r in runs)} &middot; generated {when}</p>
<h2>Numbers</h2><table><tr><th></th>{head}</tr>{''.join(summary)}</table>
<h2>Config differences</h2>{diff_table([flatten(r.config) for r in runs], "config")}
<h2>Environment differences</h2>{diff_table(envs, "environment")}
<h2>Training</h2><div class="grid">{''.join(plots)}</div>
</main></body></html>
"""


def write_compare(run_dirs: list[str | Path], out: str | Path) -> Path:
    """`gapless report RUN_A RUN_B ... --out FILE`: the compare page, self-contained like report.html."""
    if len(run_dirs) < 2:
        raise ValueError("compare: give at least two run folders")
    out = Path(out)
    out.write_text(render_compare([read_run(d) for d in run_dirs]), encoding="utf-8")
    return out
