"""Batching: tokenized documents -> one Batch type, packed or padded, in a seeded, resumable order.

Strategies (data.batching), all giving the same Batch:
  packed          documents packed into rows of max_seq_len slots (best-fit or first-fit decreasing);
                  tokens_per_batch // max_seq_len rows per batch; cu_seqlens and per-document
                  position_ids keep attention and the loss inside each document
  padded          dynamic padding: documents in shuffled order, each batch padded to its longest
                  document rounded up to pad_to_multiple_of, as many as fit in tokens_per_batch slots
                  (at most rows_per_batch of them, where set: a peer's per-device batch size)
  length_grouped  the same, but documents of similar length are batched together (sorted inside
                  shuffled mega-batches of ~50 batches, then the batches shuffled)
  pad_to_max      every document padded to max_seq_len, tokens_per_batch // max_seq_len per batch
                  (or rows_per_batch, where fewer);
                  kept on purpose: the gap report measures what padding costs
Packing efficiency = real tokens / slots (B * T) over an epoch's batches.

The order of epoch e is a function of (seed, e) only, so the sampler's state is two integers
(epoch, position) and a resumed run continues with exactly the next batch.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from gapless.config import DataConfig, SourceConfig
from gapless.data.cache import CACHE_VERSION, TokenizedDataset

IGNORE = -100  # targets that are not trained (cross_entropy's ignore_index)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64
    # [B, T] int64: the token position t must predict (input_ids[t+1] of the same document) where
    # that token is trained, else -100 (prompt, padding, each document's last token). Already
    # shifted: loss = cross_entropy(logits[b, t], targets[b, t]) with no further shift.
    targets: torch.Tensor
    position_ids: torch.Tensor  # [B, T] int64, restarting at 0 for every document
    # int32 [segments + 1]: offsets into the flattened B*T tokens, last == B*T; the unused tail of a
    # packed row is its own segment (padding). None for padded strategies.
    cu_seqlens: torch.Tensor | None
    max_seqlen: int  # longest segment (packed) or T (padded)
    attention_mask: torch.Tensor | None  # [B, T] int64, 1 = real, 0 = padding; None for packed
    num_real_tokens: int  # host ints counted while building the batch: reading them needs no device sync
    num_target_tokens: int
    num_slots: int  # B * T
    # the real length of each document in the batch, host ints (the FLOPs of attention depend on them;
    # cu_seqlens also holds each packed row's padding tail)
    doc_lengths: tuple[int, ...] = ()

    def to(self, device, non_blocking: bool = True) -> Batch:
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return Batch(move(self.input_ids), move(self.targets), move(self.position_ids), move(self.cu_seqlens),
                     self.max_seqlen, move(self.attention_mask), self.num_real_tokens, self.num_target_tokens,
                     self.num_slots, self.doc_lengths)

    def pin_memory(self) -> Batch:
        def pin(t):
            return None if t is None else t.pin_memory()

        return Batch(pin(self.input_ids), pin(self.targets), pin(self.position_ids), pin(self.cu_seqlens),
                     self.max_seqlen, pin(self.attention_mask), self.num_real_tokens, self.num_target_tokens,
                     self.num_slots, self.doc_lengths)


# ---------------------------------------------------------------------------------------------
# mixing sources


class Mixture:
    """Several tokenized sources, each contributing `counts[s]` documents to every epoch.

    Documents are addressed by a global id: source s's document j is offsets[s] + j.
    """

    def __init__(self, datasets: list[TokenizedDataset], counts: list[int], names: list[str]):
        assert len(datasets) == len(counts) == len(names)
        self.datasets, self.counts, self.names = datasets, counts, names
        self.offsets = np.cumsum([0] + [len(d) for d in datasets])
        self.lengths = np.concatenate([d.lengths for d in datasets]) if datasets else np.zeros(0, np.int64)

    @classmethod
    def from_config(cls, datasets: list[TokenizedDataset], sources: list[SourceConfig], names: list[str]) -> Mixture:
        return cls(datasets, documents_per_epoch([len(d) for d in datasets], sources), names)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def fingerprint(self) -> str:
        """What the mix holds: each source's cache key (its files' content and how they were tokenized), its
        documents (an eval split takes some) and its share of an epoch. A resume compares it: the same number of
        documents from edited files would otherwise continue the batch order over other data."""
        parts = [[d.meta.get("key"), len(d), int(d.lengths.sum()), int(c)] for d, c in zip(self.datasets, self.counts)]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    @property
    def pad_id(self) -> int:
        return self.datasets[0].pad_id if self.datasets else 0

    def doc(self, gid: int) -> tuple[np.ndarray, np.ndarray]:
        s = int(np.searchsorted(self.offsets, gid, side="right")) - 1
        return self.datasets[s][gid - self.offsets[s]]

    def epoch_docs(self, seed: int, epoch: int) -> np.ndarray:
        """Global ids of the documents of one epoch, unshuffled: each source's share, repeats included."""
        parts = []
        for s, (n, k) in enumerate(zip(np.diff(self.offsets), self.counts)):
            if n == 0 or k == 0:
                continue
            full, rest = divmod(k, n)
            local = np.tile(np.arange(n), full)
            if rest:  # a seeded subset of the source, different every epoch
                rng = np.random.default_rng([seed, epoch, s, 0x5A3])
                local = np.concatenate([local, np.sort(rng.choice(n, rest, replace=False))])
            parts.append(self.offsets[s] + local)
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def documents_per_epoch(sizes: list[int], sources: list[SourceConfig]) -> list[int]:
    """Each source's documents per epoch: epochs * size, or its weight's share of the weighted sources."""
    weighted = [i for i, s in enumerate(sources) if s.weight is not None]
    pool = sum(sizes[i] for i in weighted)
    total_weight = sum(sources[i].weight for i in weighted)
    counts = []
    for size, src in zip(sizes, sources):
        if src.weight is not None:
            counts.append(int(round(src.weight / total_weight * pool)))
        else:
            counts.append(int(round((src.epochs if src.epochs is not None else 1.0) * size)))
    return counts


# ---------------------------------------------------------------------------------------------
# packing


def pack_best_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each document, longest first, into the fullest row it still fits.

    Returns rows as lists of indices into `lengths`. O(n log n) with a sorted list of open rows.
    """
    order = np.argsort(-lengths, kind="stable")  # stable: ties keep the (shuffled) input order
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free slots, row), sorted; full rows leave the list
    for i in order.tolist():
        n = int(lengths[i])
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            room, r = free.pop(k)
        else:
            room, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, r))
    return rows


def pack_first_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """First-fit decreasing: each document, longest first, into the first opened row it fits.

    A max-tree over the rows' free slots finds that row in O(log rows).
    """
    order = np.argsort(-lengths, kind="stable")
    size = 1
    while size < max(len(lengths), 1):
        size *= 2
    tree = [0] * (2 * size)  # tree[size + r] = free slots of row r (0 until opened)
    rows: list[list[int]] = []
    for i in order.tolist():
        n = int(lengths[i])
        if tree[1] >= n:
            node = 1
            while node < size:
                node = 2 * node if tree[2 * node] >= n else 2 * node + 1
            r = node - size
        else:
            r = len(rows)
            rows.append([])
            node = size + r
            tree[node] = capacity
        rows[r].append(i)
        tree[node] -= n
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return rows


PACKERS = {"best_fit": pack_best_fit, "first_fit": pack_first_fit}


# ---------------------------------------------------------------------------------------------
# the sampler


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pack_rows(rows: list[list[tuple[np.ndarray, np.ndarray]]], b: int, t: int, pad_id: int) -> Batch:
    """b packed rows of t slots from each row's documents, (token ids, trained mask) pairs: the documents one after
    another, each's position_ids from 0, its targets the next token where that one is trained; the unused tail of a
    row is a segment of its own, all padding (rows past len(rows) are all tail)."""
    ids = np.full((b, t), pad_id, np.int64)
    targets = np.full((b, t), IGNORE, np.int64)
    pos = np.zeros((b, t), np.int64)
    seqlens, lengths = [], []
    for r in range(b):
        c = 0
        for x, m in rows[r] if r < len(rows) else []:
            n = len(x)
            ids[r, c:c + n] = x
            targets[r, c:c + n - 1] = np.where(m[1:] == 1, x[1:], IGNORE)
            pos[r, c:c + n] = np.arange(n)
            seqlens.append(n)
            lengths.append(n)
            c += n
        if c < t:  # the unused tail of the row: a segment of its own, all padding
            pos[r, c:] = np.arange(t - c)
            seqlens.append(t - c)
    cu = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
    return Batch(torch.from_numpy(ids), torch.from_numpy(targets), torch.from_numpy(pos), torch.from_numpy(cu),
                 int(max(seqlens)), None, sum(lengths), int((targets != IGNORE).sum()), b * t, tuple(lengths))


def made_up_packed_batch(rows: int, seq_len: int, vocab_size: int, seed: int = 0) -> Batch:
    """`rows` packed rows of seq_len slots laid out as BatchSampler's (pack_rows): documents of seq_len / 2, / 4
    and / 8 random tokens, all trained, then the padding tail. What the compiled layers first run on while the
    data is still being read (gapless.train.loop.compile_beside_data); its values matter to nothing."""
    rng = np.random.default_rng(seed)
    lengths = [n for n in (seq_len // 2, seq_len // 4, seq_len // 8) if n > 1] or [seq_len]
    return pack_rows([[(rng.integers(0, vocab_size, n), np.ones(n, np.int64)) for n in lengths]
                      for _ in range(rows)], rows, seq_len, pad_id=0)


def batch_slots(strategy: str, tokens_per_batch: int, max_seq_len: int, rows_per_batch: int | None = None) -> int:
    """The slots of a full batch: whole rows of max_seq_len when packed or pad_to_max (pad_to_max: at most
    rows_per_batch of them), tokens_per_batch for the padded strategies (each batch at most that)."""
    rows = tokens_per_batch // max_seq_len
    if strategy == "pad_to_max" and rows_per_batch is not None:
        rows = min(rows, rows_per_batch)
    return rows * max_seq_len if strategy in ("packed", "pad_to_max") else tokens_per_batch


class BatchSampler:
    """An endless, seeded, resumable stream of Batches over a Mixture.

    Iterating yields batch `position` of epoch `epoch`, then advances; after the last batch of an
    epoch comes the first of the next. `state_dict()` taken after a batch was yielded resumes with
    the batch after it.
    """

    def __init__(self, mix: Mixture, *, strategy: str = "packed", max_seq_len: int, tokens_per_batch: int,
                 rows_per_batch: int | None = None, pad_to_multiple_of: int = 8, pack_algorithm: str = "best_fit",
                 seed: int = 0, pad_id: int | None = None, shuffle: bool = True):
        if tokens_per_batch < max_seq_len:
            raise ValueError(f"tokens_per_batch {tokens_per_batch} is less than max_seq_len {max_seq_len}")
        if rows_per_batch is not None and (strategy == "packed" or rows_per_batch < 1):
            raise ValueError(f"rows_per_batch {rows_per_batch}: the most documents of a padded batch, at least 1; "
                             "not with packed, whose rows hold many documents each (tokens_per_batch sets them)")
        longest = int(mix.lengths.max()) if len(mix) else 0
        if longest > max_seq_len:
            raise ValueError(f"a document has {longest} tokens, more than max_seq_len {max_seq_len}; "
                             "tokenize with the same data.max_seq_len")
        self.mix, self.strategy, self.max_seq_len = mix, strategy, max_seq_len
        self.tokens_per_batch, self.pad_to_multiple_of = tokens_per_batch, pad_to_multiple_of
        self.rows_per_batch = rows_per_batch  # documents per batch at most (padded strategies); None: as many as fit
        self.pack_algorithm, self.seed, self.shuffle = pack_algorithm, seed, shuffle
        self.pad_id = mix.pad_id if pad_id is None else pad_id
        # rows of max_seq_len slots per batch (packed, pad_to_max)
        fit = tokens_per_batch // max_seq_len
        self.rows = batch_slots(strategy, tokens_per_batch, max_seq_len, rows_per_batch) // max_seq_len
        if strategy in ("packed", "pad_to_max") and tokens_per_batch % max_seq_len and rows_per_batch is None:
            warnings.warn(f"tokens_per_batch {tokens_per_batch} is not a multiple of max_seq_len {max_seq_len}: "
                          f"batches hold {self.rows * max_seq_len} slots", stacklevel=2)
        if strategy == "pad_to_max" and rows_per_batch is not None and rows_per_batch > fit:
            warnings.warn(f"rows_per_batch {rows_per_batch} is more than the {fit} rows of max_seq_len "
                          f"{max_seq_len} that tokens_per_batch {tokens_per_batch} holds: pad_to_max batches "
                          f"hold {fit}", stacklevel=2)
        self.epoch, self.position = 0, 0
        self._plan_epoch, self._plan = -1, []

    @classmethod
    def from_config(cls, cfg: DataConfig, mix: Mixture, *, shuffle: bool = True) -> BatchSampler:
        if cfg.tokens_per_batch == "auto":
            raise ValueError("data.tokens_per_batch: auto is chosen by `gapless train` on a GPU (the batch finder); "
                             "give a number of tokens here")
        return cls(mix, strategy=cfg.batching, max_seq_len=cfg.max_seq_len, tokens_per_batch=cfg.tokens_per_batch,
                   rows_per_batch=cfg.rows_per_batch, pad_to_multiple_of=cfg.pad_to_multiple_of,
                   pack_algorithm=cfg.pack_algorithm, seed=cfg.seed, shuffle=shuffle)

    @classmethod
    def for_eval(cls, cfg: DataConfig, mix: Mixture) -> BatchSampler:
        """The sampler of held-out data (the run's evaluation, `gapless eval`): in order, and as many documents a batch
        as fit: data.rows_per_batch shapes the optimizer's steps (a peer's batch size), and a token's loss does not
        depend on its batch."""
        return cls.from_config(replace(cfg, rows_per_batch=None), mix, shuffle=False)

    # -- the plan of an epoch: a list of batches, each a list of rows (packed) or documents (padded)

    def plan(self, epoch: int) -> list[list]:
        if epoch != self._plan_epoch:
            self._plan, self._plan_epoch = self._make_plan(epoch), epoch
        return self._plan

    def _make_plan(self, epoch: int) -> list[list]:
        docs = self.mix.epoch_docs(self.seed, epoch)
        rng = np.random.default_rng([self.seed, epoch, 0xBA7C])
        if self.shuffle:
            docs = docs[rng.permutation(len(docs))]
        lengths = self.mix.lengths[docs]
        if self.strategy == "packed":
            rows = [[int(docs[i]) for i in row] for row in PACKERS[self.pack_algorithm](lengths, self.max_seq_len)]
            if self.shuffle:  # packing sorted the documents by length; spread long and short rows again
                rows = [rows[i] for i in rng.permutation(len(rows))]
            b = self.rows
            return [rows[i:i + b] for i in range(0, len(rows), b)]
        if self.strategy == "pad_to_max":
            b = self.rows
            return [docs[i:i + b].tolist() for i in range(0, len(docs), b)]
        if self.strategy == "padded":
            return self._fill(docs.tolist(), lengths.tolist())
        assert self.strategy == "length_grouped", self.strategy
        mean = int(lengths.mean()) if len(lengths) else 1
        per_batch = max(1, self.tokens_per_batch // max(1, mean))
        if self.rows_per_batch is not None:
            per_batch = min(per_batch, self.rows_per_batch)
        mega = 50 * per_batch  # ~50 batches, as HF's LengthGroupedSampler (50 x its batch size)
        batches = []
        for i in range(0, len(docs), mega):
            d, n = docs[i:i + mega], lengths[i:i + mega]
            order = np.argsort(-n, kind="stable")
            batches += self._fill(d[order].tolist(), n[order].tolist())
        return [batches[i] for i in rng.permutation(len(batches))] if self.shuffle else batches

    def _fill(self, docs: list[int], lengths: list[int]) -> list[list[int]]:
        """Greedy: add documents while (count) * (longest, rounded up) fits in tokens_per_batch slots and count is at
        most rows_per_batch."""
        batches, cur, longest = [], [], 0
        most = self.rows_per_batch or len(docs)
        for d, n in zip(docs, lengths):
            t = _round_up(max(longest, n), self.pad_to_multiple_of)
            if cur and ((len(cur) + 1) * t > self.tokens_per_batch or len(cur) == most):
                batches.append(cur)
                cur, longest = [], 0
            cur.append(d)
            longest = max(longest, n)
        if cur:
            batches.append(cur)
        return batches

    # -- batches

    def collate(self, item: list) -> Batch:
        if self.strategy == "packed":
            return self._packed(item)
        t = self.max_seq_len if self.strategy == "pad_to_max" else _round_up(
            max(int(self.mix.lengths[d]) for d in item), self.pad_to_multiple_of)
        return self._padded(item, t)

    def _packed(self, rows: list[list[int]]) -> Batch:
        return pack_rows([[self.mix.doc(d) for d in row] for row in rows], self.rows, self.max_seq_len, self.pad_id)

    def _padded(self, docs: list[int], t: int) -> Batch:
        b = len(docs)
        ids = np.full((b, t), self.pad_id, np.int64)
        targets = np.full((b, t), IGNORE, np.int64)
        attn = np.zeros((b, t), np.int64)
        for r, d in enumerate(docs):
            x, m = self.mix.doc(d)
            n = len(x)
            ids[r, :n] = x
            targets[r, :n - 1] = np.where(m[1:] == 1, x[1:], IGNORE)
            attn[r, :n] = 1
        pos = np.broadcast_to(np.arange(t), (b, t)).copy()
        return Batch(torch.from_numpy(ids), torch.from_numpy(targets), torch.from_numpy(pos), None, t,
                     torch.from_numpy(attn), int(attn.sum()), int((targets != IGNORE).sum()), b * t,
                     tuple(int(self.mix.lengths[d]) for d in docs))

    # -- iteration and state

    def __iter__(self) -> Iterator[Batch]:
        while True:
            plan = self.plan(self.epoch)
            if not plan:
                raise ValueError("no documents to batch: every source is empty after reading and filtering")
            if self.position >= len(plan):
                self.epoch, self.position = self.epoch + 1, 0
                continue
            item = plan[self.position]
            self.position += 1
            yield self.collate(item)

    def epoch_batches(self, epoch: int = 0) -> Iterator[Batch]:
        """The batches of one epoch, leaving the sampler's state alone (for eval and inspection)."""
        for item in self.plan(epoch):
            yield self.collate(item)

    def batches_per_epoch(self, epoch: int = 0) -> int:
        return len(self.plan(epoch))

    def efficiency(self, epoch: int = 0) -> float:
        """Real tokens / slots over the epoch's batches."""
        plan = self.plan(epoch)
        if not plan:
            return 0.0
        lengths = self.mix.lengths
        if self.strategy == "packed":
            real = sum(int(lengths[d]) for batch in plan for row in batch for d in row)
            return real / (len(plan) * self.rows * self.max_seq_len)
        real = slots = 0
        for batch in plan:
            n = lengths[batch]
            real += int(n.sum())
            t = self.max_seq_len if self.strategy == "pad_to_max" else _round_up(int(n.max()), self.pad_to_multiple_of)
            slots += len(batch) * t
        return real / slots

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "strategy": self.strategy,
                "num_docs": len(self.mix), "max_seq_len": self.max_seq_len, "tokens_per_batch": self.tokens_per_batch,
                "rows_per_batch": self.rows_per_batch, "data": self.mix.fingerprint, "cache_version": CACHE_VERSION}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        state = {"rows_per_batch": None, **state}  # checkpoints written before rows_per_batch: as many as fit
        for key in ("seed", "strategy", "num_docs", "max_seq_len", "tokens_per_batch", "rows_per_batch"):
            if state[key] != mine[key]:
                raise ValueError(f"data: cannot resume: the saved sampler had {key}={state[key]!r}, this run has "
                                 f"{mine[key]!r}; the batch order would not continue where it stopped")
        if state.get("data", mine["data"]) != mine["data"]:  # (checkpoints written before it was kept: unchecked)
            # the cache key holds the cache version: a gapless that reads or masks records otherwise (cache.py's
            # CACHE_VERSION) changes every source's key; checkpoints without the field are version 4 or older
            saved = state.get("cache_version", 4)
            why = (f"the gapless that wrote it tokenized data as cache version {saved}, this one as {CACHE_VERSION} "
                   f"(gapless/data/cache.py says what changed); resume with that gapless version" if saved !=
                   CACHE_VERSION else "a source's files were edited or replaced, or tokenized otherwise; resume "
                                      "with the data the run was trained on")
            raise ValueError(f"data: cannot resume: the training data differ from the checkpoint's ({why}), or "
                             "start a new run")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
