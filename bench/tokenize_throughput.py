"""Tokenization throughput of the data path on the whole shared mix (../shared/data/messages).

For each worker count: a cold run into an empty cache (read + render + tokenize + mask + write),
then a warm run of the same config (content hashes checked, memory-mapped arrays opened, no
tokenizing). Both are full `build_data` calls, so both include the packing plan of epoch 0 that
the summary's efficiency needs. Prints one JSON line per run and a Markdown table.

    python bench/tokenize_throughput.py [--tokenizer llama3] [--workers 0 2] [--max-seq-len 16384]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path

from gapless.config import DataConfig, from_dict
from gapless.data.pipeline import build_data

SHARED = Path(__file__).resolve().parents[2] / "shared"


def run(cfg: DataConfig) -> tuple[float, dict]:
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Llama 3's template has no tools section: a known, counted warning
        _, _, summary = build_data(cfg)
    return time.perf_counter() - t0, summary.to_dict()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shared", type=Path, default=SHARED)
    p.add_argument("--tokenizer", default="llama3")
    p.add_argument("--workers", type=int, nargs="+", default=[0, os.cpu_count()])
    p.add_argument("--max-seq-len", type=int, default=16384)
    args = p.parse_args()
    rows = []
    for workers in args.workers:
        with tempfile.TemporaryDirectory() as cache:
            cfg = from_dict(DataConfig, {
                "sources": [{"path": str(args.shared / "data/messages/*.jsonl")}],
                "tokenizer": str(args.shared / "tokenizers" / args.tokenizer), "cache_dir": cache,
                "max_seq_len": args.max_seq_len, "tokens_per_batch": args.max_seq_len, "num_workers": workers}, "data")
            load = os.getloadavg()[0]
            cold, summary = run(cfg)
            warm, again = run(cfg)
            assert summary["sources"][0]["cache"] == "miss" and again["sources"][0]["cache"] == "hit"
            tokens = summary["tokens"]
            row = {"tokenizer": args.tokenizer, "workers": workers, "cpus": os.cpu_count(),
                   "records": summary["records"], "tokens": tokens, "cold_s": round(cold, 2),
                   "cold_tok_s": round(tokens / cold), "tokenize_s": summary["tokenize_seconds"],
                   "warm_s": round(warm, 2), "warm_tok_s": round(tokens / warm), "load_avg_before": round(load, 2),
                   "packing_efficiency": summary["packing_efficiency"], "machine": platform.machine()}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| tokenizer | workers | records | tokens | cold (s) | cold tok/s | cached (s) | cached tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokenizer']} | {r['workers']} | {r['records']:,} | {r['tokens']:,} | {r['cold_s']} | "
              f"{r['cold_tok_s']:,} | {r['warm_s']} | {r['warm_tok_s']:,} |")


if __name__ == "__main__":
    main()
