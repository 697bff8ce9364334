"""Ask the kernel to read the model's weights from disk while the process imports torch.

A start with the weights not in the page cache read them only after the imports: on a GPU machine the 3B example
config's cold start spent 15.0 s in its imports and then 7.5 s loading 6 GB of weights that a warm start loads in
2.1 (bench/RESULTS.md, fourteenth round, run s17-startup-norblock; bench/startup_gpu.py drops the weights' pages
for its cold run). `gapless train` parses its config before importing torch and starts a daemon thread that hands
the model folder's *.safetensors to the kernel's readahead (posix_fadvise WILLNEED: the kernel reads each file
whole, sequentially, into the page cache; the process copies nothing), so the load finds them there or in flight.
Files already cached cost a lookup per page (a warm start). Where the OS has no posix_fadvise (macOS, Windows) or a
file cannot be opened it is skipped: readahead never fails a run. GAPLESS_READAHEAD=0 turns it off.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path

OFF = "GAPLESS_READAHEAD"


def enabled() -> bool:
    return hasattr(os, "posix_fadvise") and os.environ.get(OFF, "1") != "0"


def weight_files(model_path: str | Path) -> list[Path]:
    """A model folder's safetensors files, largest first (none where the path is not a folder)."""
    folder = Path(model_path)
    if not folder.is_dir():
        return []
    return sorted(folder.glob("*.safetensors"), key=lambda f: -f.stat().st_size)


def advise(files: Iterable[Path]) -> int:
    """posix_fadvise(WILLNEED) on each file, in order; returns the bytes handed to the kernel."""
    total = 0
    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            total += os.fstat(fd).st_size
        except OSError:
            pass
        finally:
            os.close(fd)
    return total


def read_ahead(model_path: str | Path) -> threading.Thread | None:
    """Start advise(weight_files(model_path)) in a daemon thread, where enabled(); the thread, or None."""
    if not enabled():
        return None
    thread = threading.Thread(target=lambda: advise(weight_files(model_path)), name="gapless-readahead",
                              daemon=True)
    thread.start()
    return thread
