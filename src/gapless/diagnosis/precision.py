"""`gapless compare-precision CONFIG --steps N`: does the faster precision change training?

The same config, seeds and batches (train.seed and data.seed fix the LoRA init and the batch order) run N steps
under each precision, logging every step:
  fp32   model.dtype float32, TF32 off (torch.backends.cuda.matmul.allow_tf32 = False, cuDNN too): the reference
  tf32   model.dtype float32, TF32 on (NVIDIA GPUs of compute capability 8.0+; the CPU has no TF32: same as fp32)
  bf16   model.dtype bfloat16
  fp16   model.dtype float16, trained with the dynamic loss scaler (gapless.train.loss_scale.DynamicLossScaler:
         the loop makes one for every float16 run; start 2^16, halved and the step skipped on an inf/nan gradient,
         doubled after 2,000 good steps); its row adds the final loss scale and the skipped steps (metrics.jsonl),
         since a skipped step is a step the other variants took
Per variant: the loss curve, its largest and final difference from the reference (absolute and relative), and the
steady real tokens/s (gapless.train.loop.RunResult). One HTML page with the curves and the differences.
"""
from __future__ import annotations

import html
import io
import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml

from gapless.config import load_config
from gapless.convert import load_any

VARIANTS = ("fp32", "tf32", "bf16", "fp16")


def loss_scale_record(run_dir: Path) -> dict:
    """The last loss scale and count of skipped steps an fp16 run logged (metrics.jsonl), {} when none was."""
    last = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss_scale" in record:
            last = {"loss_scale": record["loss_scale"], "skipped_steps": record.get("skipped_steps", 0)}
    return last


@contextmanager
def tf32(enabled: bool):
    """TF32 for matmuls and cuDNN convolutions, restored afterwards (the flags are process-global)."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


def variant_overrides(name: str, steps: int, out: Path) -> list[str]:
    dtype = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}[name]
    return [f"model.dtype={dtype}", f"train.steps={steps}", "train.log_every=1", "train.eval_every=0",
            "checkpoint.every=0", "resume=false", "progress=false", f"output_dir={out / name}"]


def compare_precision(config: str | Path | None, overrides: list[str] = (), *, steps: int = 50,
                      out: str | Path = "runs/compare-precision", variants: tuple[str, ...] = VARIANTS,
                      data: dict | None = None, log=None) -> dict:
    """Run each variant for `steps` optimizer steps; returns the comparison (also written to out/precision.json
    and out/precision.html). `data`: a config dict instead of a file (tests)."""
    from gapless.train.loop import train

    log = log or (lambda s: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    gpu = torch.cuda.is_available()
    for name in variants:
        variant = [*overrides, *variant_overrides(name, steps, out)]
        # a gapless, Axolotl, TRL or LLaMA-Factory config (gapless.convert), its mapping printed once
        cfg = (load_config(config, variant, data=data) if data is not None else
               load_any(config, variant, out=None if name == variants[0] else io.StringIO()))
        note = "" if gpu or name != "tf32" else "the CPU has no TF32: the same computation as fp32"
        if name in ("bf16", "fp16") and (not gpu or cfg.model.device == "cpu"):
            note = f"{name} on the CPU: correct but slow (no {name} matmul units on most CPUs)"
        with tf32(name == "tf32"), open(out / f"{name}.log", "w") as stream:
            result = train(cfg, out=stream)
        # what ran, as the run folder's config.yaml records it: `auto` picks sdpa for float32 and varlen for
        # bf16 on a GPU, so the speed column compares whole settings, not the matmul precision alone
        resolved = yaml.safe_load((out / name / "config.yaml").read_text())["model"]
        rows.append({"variant": name, "status": "ran", "note": note, "dtype": cfg.model.dtype,
                     "attn_backend": resolved["attn_backend"], "compile": resolved["compile"],
                     "losses": {int(k): v for k, v in result.losses.items()},
                     "tokens_per_s": result.steady_tokens_per_s, **loss_scale_record(out / name)})
        if name == "fp16":
            rows[-1]["note"] = (f"loss scale {rows[-1].get('loss_scale', 0):g}, {rows[-1].get('skipped_steps', 0)} "
                                "skipped steps; " + note).rstrip("; ")
        log(f"{name}: final loss {final_loss(result.losses):.4f}, {result.steady_tokens_per_s:,.0f} "
            "real tokens/s")
    ref = next((r for r in rows if r["variant"] == "fp32" and r["status"] == "ran"), None)
    for r in rows:
        if r["status"] != "ran" or ref is None:
            continue
        r.update(differences(r["losses"], ref["losses"]))
        r["speedup"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref["tokens_per_s"] else None
    result = {"config": str(config) if config else None, "steps": steps, "device": "cuda" if gpu else "cpu",
              "variants": rows}
    (out / "precision.json").write_text(json.dumps(result, indent=2))
    write_page(result, out / "precision.html")
    return result


def differences(losses: dict[int, float], ref: dict[int, float]) -> dict:
    """A variant's loss curve against the reference's at the steps both logged a loss: the largest absolute and
    relative difference and the last one. A logged loss is NaN when every step of its window was skipped (fp16's
    loss scaler on an overflow, or the non-finite guard: no update applied, so no loss to compare): such steps
    are left out and counted, never compared (a NaN would hide in max())."""
    common = sorted(set(losses) & set(ref))
    kept = [s for s in common if math.isfinite(losses[s]) and math.isfinite(ref[s])]
    diffs = [losses[s] - ref[s] for s in kept]
    return {"max_abs_diff": max(map(abs, diffs), default=0.0),
            "max_rel_diff": max((abs(d) / abs(ref[s]) for d, s in zip(diffs, kept)), default=0.0),
            "final_diff": diffs[-1] if diffs else 0.0, "steps_without_loss": len(common) - len(kept)}


def final_loss(losses: dict[int, float]) -> float:
    """The last finite logged loss (NaN when none is)."""
    return next((losses[s] for s in sorted(losses, reverse=True) if math.isfinite(losses[s])), math.nan)


def format_comparison(result: dict) -> str:
    lines = [f"{'variant':<8} {'tokens/s':>10} {'speed':>7} {'final loss':>10} {'max |diff|':>10} "
             f"{'max rel':>8}  {'attention':<9}  note"]
    for r in result["variants"]:
        if r["status"] != "ran":
            lines.append(f"{r['variant']:<8} {r['status']}")
            continue
        final = final_loss(r["losses"])
        speed = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        skipped = r.get("steps_without_loss", 0)
        note = ((f"{skipped} logged step(s) without a loss (every step skipped), left out; " if skipped else "")
                + r.get("note", "")).rstrip("; ")
        lines.append(f"{r['variant']:<8} {r['tokens_per_s']:>10,.0f} {speed:>7} {final:>10.4f} "
                     f"{r.get('max_abs_diff', 0):>10.2e} {r.get('max_rel_diff', 0):>8.2%}  "
                     f"{r['attn_backend'] + (' comp.' if r['compile'] else ''):<9}  {note}")
    lines.append(f"differences are against fp32 with TF32 off at the same step, over {result['steps']} steps with "
                 "the same seeds and batches")
    return "\n".join(lines)


def plot(result: dict) -> bytes:
    from gapless.meter.report import WIDE, _figure, _png

    fig, (ax, dx) = _figure(height=5.6, width=WIDE, rows=2)
    ran = [r for r in result["variants"] if r["status"] == "ran"]
    ref = next((r for r in ran if r["variant"] == "fp32"), None)
    for r in ran:
        steps = sorted(r["losses"])
        color = f"C{VARIANTS.index(r['variant'])}"  # one color per variant in both panels
        ax.plot(steps, [r["losses"][s] for s in steps], lw=1.3, color=color, label=r["variant"])
        if ref is not None and r is not ref:
            common = [s for s in steps if s in ref["losses"]]
            dx.plot(common, [r["losses"][s] - ref["losses"][s] for s in common], lw=1.2, color=color,
                    label=r["variant"])
    ax.set_ylabel("loss", fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    dx.axhline(0.0, color="#888", lw=0.8)
    dx.set_ylabel("loss - fp32 loss", fontsize=9)
    dx.set_xlabel("step", fontsize=9)
    if len(dx.get_lines()) > 1:  # beyond the zero line
        dx.legend(fontsize=8, frameon=False)
    return _png(fig)


def write_page(result: dict, path: Path) -> Path:
    from gapless.meter.report import CSS, _img

    title = f"gapless compare-precision: {result['config'] or 'config'} ({result['steps']} steps, {result['device']})"
    table = html.escape(format_comparison(result))
    path.write_text(f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{CSS}</style></head>
<body><main><h1>{html.escape(title)}</h1><figure>{_img(plot(result), "loss curves")}</figure>
<pre>{table}</pre></main></body></html>
""", encoding="utf-8")
    return path
