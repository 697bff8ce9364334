"""Checkpoint load time, serial against parallel (gapless.model.loading.load_weights' reading threads).

    python bench/load_time.py FOLDER [--dtype bfloat16] [--device cuda] [--threads 1,8] [--repeats 3] [--cold]
    python bench/load_time.py --write-random bench/models/llama-3.2-1b/config.json FOLDER   # random weights first

Each repeat, for each thread count and reader (--readers) in turn: build the model on meta and load the folder's weights into `--dtype` on
`--device` (CUDA: synchronized before the clock stops), then the seconds and GiB/s of the file's bytes, one JSON line
each. --cold drops the shards' pages from the OS page cache before every load (bench/startup_gpu.drop_page_cache),
so the disk is read; without it they are served from memory after the first load. On the CPU a load into the file's
own dtype maps the file and reads nothing yet (the pages come in at first use): measure a conversion (the CPU's
default float32 from a bf16 file) to see the reads.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from gapless.model.loading import build, load_weights

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup_gpu import drop_page_cache, write_model  # noqa: E402  (bench/ is not a package)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--write-random", type=Path, default=None, metavar="CONFIG_JSON",
                   help="first write random bf16 weights of this config.json into FOLDER (the tokenizer: --tokenizer)")
    p.add_argument("--tokenizer", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "tokenizers"
                   / "llama3")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", default="1,8", help="comma-separated reading-thread counts (1: serial)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="drop the shards from the page cache before each load")
    p.add_argument("--readers", default="staged,mmap", help="comma-separated: staged (pread into page-locked "
                   "buffers, the CUDA default) and mmap (safetensors' memory map, the host's), each timed in turn")
    opts = p.parse_args(argv)
    if opts.write_random is not None:
        info = write_model(opts.folder, json.loads(opts.write_random.read_text()), opts.tokenizer, 5 * 2**30)
        print(json.dumps({"wrote": str(opts.folder), **info}), flush=True)
    size = sum(f.stat().st_size for f in opts.folder.glob("*.safetensors"))
    device = torch.device(opts.device)
    for repeat in range(opts.repeats):
        for threads, reader in ((int(t), r) for t in opts.threads.split(",") for r in opts.readers.split(",")):
            dropped = drop_page_cache(opts.folder) if opts.cold else False
            t0 = time.perf_counter()
            model = load_weights(build(opts.folder), opts.dtype, device, threads=threads, staged=reader == "staged")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            del model
            print(json.dumps({"repeat": repeat, "threads": threads, "reader": reader, "dtype": opts.dtype,
                              "device": str(device),
                              "cold": dropped, "seconds": round(seconds, 3),
                              "gib_per_s": round(size / 2**30 / seconds, 3), "file_gib": round(size / 2**30, 3)}),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
