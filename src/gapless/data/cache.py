"""The tokenized-data cache: one folder per (source files' content, tokenizer, template, settings).

A folder holds the documents of one source, concatenated:
  ids.bin      int32  [num_tokens]   token ids
  mask.bin     uint8  [num_tokens]   1 where the token is trained (an assistant token, its end-of-turn included)
  offsets.npy  int64  [num_docs + 1] document d is tokens offsets[d]:offsets[d+1]
  records.npy  int32  [num_docs]     the index of the input record each document came from
  groups.npy   int32  [num_docs]     the group of that record, which the eval split holds out whole: the index of
                                     the group's first record (an OpenAssistant tree's first thread), else its own
  meta.json           the key's inputs, the tokenizer's pad id, the reading/tokenizing counts
The arrays are memory-mapped on open, so a run holds no copy of the data in RAM. A folder is
written under a temporary name and renamed into place, so a crashed run never leaves a half cache.
The temporary name holds the writer's host and process id (`.KEY16-HOST8-PID-XXXX`): a run that was
killed (SIGKILL, out of memory) cannot remove its own, so `clean_stale` removes those whose process
is gone when the next run starts.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

import numpy as np

# Bump when the meaning of the cached arrays changes (masking rules, layout): old folders stop matching.
CACHE_VERSION = 10  # 2: OpenAI tool_calls kept as JSON text under templates without tool_calls; 3: content parts,
# conversational prompt-completion and per-file format detection read records that were skipped as errors before;
# 4: chat-template masking (sessions 13-14): turns a template rewrites are located or skipped, JSON-string tool-call
# arguments parsed, null content beside calls, named template sets, Qwen3's earlier turns trained; 5: groups.npy (the
# threads of an OpenAssistant tree, held out together; a version-4 folder of oasst data would split them apart);
# 6: prompt-completion records keep their tools; 7: tool definitions without null keys (Arrow's padding);
# 8: KTO rows of label false left out; 9: KTO labels as text ("False" in a CSV) left out too, Capybara's
# {input, output} pairs and glaive-function-calling-v2's chat strings read (refused before); 10: tool calls in the
# form the template renders (null content, arguments as text: DeepSeek-R1's), a call turn whose prompt the template
# rewrites located from the shared part of its generation prompt (QwQ's "<think>\n"), and a turn whose calls the
# template drops skipped as tool_calls_not_rendered (it trained an empty answer)


class TokenizedDataset:
    """Documents of (token ids, loss mask), memory-mapped; optionally a subset of a cache folder's documents."""

    def __init__(self, ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray, records: np.ndarray,
                 meta: dict, docs: np.ndarray | None = None, groups: np.ndarray | None = None):
        self.ids, self.mask, self.offsets, self.records, self.meta = ids, mask, offsets, records, meta
        self.groups = records if groups is None else groups  # None: each record a group of its own
        self.docs = np.arange(len(offsets) - 1) if docs is None else docs
        self.lengths = (offsets[self.docs + 1] - offsets[self.docs]).astype(np.int64)

    @classmethod
    def open(cls, folder: Path) -> TokenizedDataset:
        # the folder's name is the cache key: the content of the files and the settings that tokenized them
        meta = {**json.loads((folder / "meta.json").read_text()), "key": folder.name}
        offsets = np.load(folder / "offsets.npy")
        n = int(offsets[-1])
        # np.memmap refuses empty files; an all-dropped source has no tokens
        ids = np.memmap(folder / "ids.bin", np.int32, "r") if n else np.zeros(0, np.int32)
        mask = np.memmap(folder / "mask.bin", np.uint8, "r") if n else np.zeros(0, np.uint8)
        return cls(ids, mask, offsets, np.load(folder / "records.npy"), meta, groups=np.load(folder / "groups.npy"))

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        d = self.docs[i]
        lo, hi = self.offsets[d], self.offsets[d + 1]
        return self.ids[lo:hi], self.mask[lo:hi]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def pad_id(self) -> int:
        return self.meta["pad_id"]

    def record_of(self, i: int) -> int:
        return int(self.records[self.docs[i]])

    def subset(self, indices: np.ndarray) -> TokenizedDataset:
        return TokenizedDataset(self.ids, self.mask, self.offsets, self.records, self.meta, self.docs[indices],
                                self.groups)


class CacheWriter:
    """Streams a source's documents into a temporary folder; `commit` renames it to the key's folder."""

    def __init__(self, root: Path, key: str):
        root.mkdir(parents=True, exist_ok=True)
        self.final = root / key
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-{_HOST}-{os.getpid()}-", dir=root))
        self._ids = open(self.tmp / "ids.bin", "wb")
        self._mask = open(self.tmp / "mask.bin", "wb")
        self._lengths: list[np.ndarray] = []
        self._records: list[np.ndarray] = []
        self._groups: list[np.ndarray] = []

    def add(self, ids: list[np.ndarray], mask: list[np.ndarray], records: np.ndarray, groups: np.ndarray) -> None:
        """A run of documents: each one's token ids and mask, the index of its record and its record's group."""
        for doc_ids, doc_mask in zip(ids, mask):
            self._ids.write(np.ascontiguousarray(doc_ids, np.int32).tobytes())
            self._mask.write(np.ascontiguousarray(doc_mask, np.uint8).tobytes())
        self._lengths.append(np.asarray([len(x) for x in ids], np.int64))
        self._records.append(np.asarray(records, np.int32))
        self._groups.append(np.asarray(groups, np.int32))

    def commit(self, meta: dict) -> TokenizedDataset:
        self._ids.close()
        self._mask.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        np.save(self.tmp / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        np.save(self.tmp / "records.npy", np.concatenate(self._records) if self._records else np.zeros(0, np.int32))
        np.save(self.tmp / "groups.npy", np.concatenate(self._groups) if self._groups else np.zeros(0, np.int32))
        (self.tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(self.tmp, self.final)
        except OSError:  # another run committed the same key first: its folder is as good as ours
            shutil.rmtree(self.tmp, ignore_errors=True)
        return TokenizedDataset.open(self.final)

    def abort(self) -> None:
        self._ids.close()
        self._mask.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


# The host part of a temporary folder's name: a cache folder on a shared file system sees the writes of
# several machines, and a process id says nothing about another machine's processes.
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_TMP = re.compile(r"\.[0-9a-f]{16}-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-.+")


def clean_stale(root: Path) -> list[Path]:
    """Remove the temporary folders that writers on this host left when they were killed; returns them."""
    removed = []
    if not root.is_dir():
        return removed
    for path in root.iterdir():
        m = _TMP.fullmatch(path.name)
        if m and m["host"] == _HOST and path.is_dir() and not _alive(int(m["pid"])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def lookup(root: Path, key: str) -> TokenizedDataset | None:
    folder = root / key
    return TokenizedDataset.open(folder) if (folder / "meta.json").is_file() else None


def cache_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps({"version": CACHE_VERSION, **parts}, sort_keys=True).encode()).hexdigest()


class FileHashes:
    """sha256 of file contents, remembered by (path, size, mtime) in root/file_hashes.json.

    The cache is keyed by content, so a file that is only touched still hits; the memo just saves
    re-reading unchanged files (hashing runs at ~1 GB/s, which matters for 100 GB sources).
    """

    def __init__(self, root: Path):
        self.path = root / "file_hashes.json"
        try:
            self.memo = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.memo = {}
        self.changed = False

    def __call__(self, file: Path) -> str:
        st = file.stat()
        stamp = [st.st_size, st.st_mtime_ns]
        name = str(file.resolve())
        hit = self.memo.get(name)
        if hit and hit[:2] == stamp:
            return hit[2]
        h = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        self.memo[name] = [*stamp, h.hexdigest()]
        self.changed = True
        return h.hexdigest()

    def save(self) -> None:
        if not self.changed:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.memo))
        os.replace(tmp, self.path)
