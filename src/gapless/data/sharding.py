"""Per-rank sharding of the global batch stream, balanced by real tokens.

The global stream is what a 1-process run sees: BatchSampler's plan, batch after batch, its state two integers
(epoch, position). With W ranks every rank walks the same plan; each global batch's packed rows are split into W
disjoint sets of rows / W rows (BatchSampler.rows: tokens_per_batch // max_seq_len), and each rank collates its
set. So:
- the order of the data does not depend on W: a checkpoint's sampler state (the global position) resumes at any
  other number of ranks with exactly the next global batch;
- the W ranks of one step together train the rows one process trains in that step, so with the loss divided by
  the global trained tokens (counted here, on the host, from the global batch: no collective) they give the same
  gradient.

Balance: every rank gets the same number of rows (so the same tensor shapes, and the same matmul work: a row is
max_seq_len slots whatever it holds), but rows hold different numbers of real tokens (ragged documents; the last
rows of a packing are often half empty), and the varlen attention's work grows with the documents' lengths (sum of
n^2), none with a padding tail. Rows are dealt longest first to the rank with the fewest real tokens that still has
room (LPT scheduling). The spread of real tokens per rank is carried on every batch and reported in metrics.jsonl;
the slowest rank's compute time beside it says what the imbalance costs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gapless.data.batching import Batch, BatchSampler


@dataclass
class ShardBatch(Batch):
    """This rank's part of a global batch, with host counts of the whole global batch."""
    global_real_tokens: int = 0
    global_target_tokens: int = 0  # what the loss of the step is divided by (gapless.train.parallel.loss_divisor)
    rank_real_tokens: tuple[int, ...] = ()  # real tokens of each rank's part of this global batch

    def _global(self) -> dict:
        return {"global_real_tokens": self.global_real_tokens, "global_target_tokens": self.global_target_tokens,
                "rank_real_tokens": self.rank_real_tokens}

    def to(self, device, non_blocking: bool = True) -> ShardBatch:
        return ShardBatch(**vars(Batch.to(self, device, non_blocking)), **self._global())

    def pin_memory(self) -> ShardBatch:
        return ShardBatch(**vars(Batch.pin_memory(self)), **self._global())


def split_rows(tokens: list[int], ranks: int, per_rank: int) -> list[list[int]]:
    """Indices of `tokens` (real tokens per row) dealt to `ranks` ranks of at most `per_rank` rows each: longest
    row first, to the rank with the fewest tokens that has room. Each rank's indices in ascending order."""
    assert len(tokens) <= ranks * per_rank, (len(tokens), ranks, per_rank)
    parts: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(tokens)), key=lambda i: -tokens[i]):
        r = min((r for r in range(ranks) if len(parts[r]) < per_rank), key=lambda r: (load[r], r))
        parts[r].append(i)
        load[r] += tokens[i]
    return [sorted(p) for p in parts]


def rank_tokens(strategy: str, tokens_per_batch: int, max_seq_len: int, world_size: int,
                sharded: bool = False) -> int:
    """Slots of each rank's micro-batch: data.tokens_per_batch is the GLOBAL micro-batch, its packed rows dealt
    out equally (tokens_per_batch // max_seq_len / world_size rows of max_seq_len each), so a step trains the same
    tokens at any number of GPUs. ValueError when `world_size` processes cannot share it (what ShardedSampler
    refuses). sharded: the stream is split even at world_size 1 (a torchrun launch of one process)."""
    if world_size == 1 and not sharded:
        return tokens_per_batch
    if strategy != "packed":
        raise ValueError(f"data.batching: {strategy!r} with {world_size} processes; several processes "
                         "split packed rows between them: use data.batching: packed")
    rows = tokens_per_batch // max_seq_len
    if rows % world_size:
        raise ValueError(
            f"data.tokens_per_batch: {tokens_per_batch} is {rows} rows of max_seq_len {max_seq_len}, which "
            f"{world_size} processes cannot share equally; it is the global batch: make it a multiple of "
            f"{world_size * max_seq_len}")
    return rows // world_size * max_seq_len


class ShardedSampler(BatchSampler):
    """The global BatchSampler's stream (same plan, same iteration, same state), each batch collated as this rank's
    rows of it."""

    def __init__(self, mix, *, rank: int, world_size: int, **settings):
        super().__init__(mix, **settings)
        rank_tokens(self.strategy, self.tokens_per_batch, self.max_seq_len, world_size, sharded=True)  # or raises
        self.rank, self.world_size = rank, world_size
        self.rows_per_rank = self.rows // world_size
        # collates this rank's rows: the same data and settings, rows_per_rank rows per batch
        self.local = BatchSampler(mix, strategy="packed", max_seq_len=self.max_seq_len,
                                  tokens_per_batch=self.rows_per_rank * self.max_seq_len,
                                  pack_algorithm=self.pack_algorithm, seed=self.seed, pad_id=self.pad_id)

    @classmethod
    def of(cls, sampler: BatchSampler, rank: int, world_size: int) -> ShardedSampler:
        """`sampler`'s stream (its settings and state), sharded."""
        sharded = cls(sampler.mix, rank=rank, world_size=world_size, strategy=sampler.strategy,
                      max_seq_len=sampler.max_seq_len, tokens_per_batch=sampler.tokens_per_batch,
                      rows_per_batch=sampler.rows_per_batch, pad_to_multiple_of=sampler.pad_to_multiple_of,
                      pack_algorithm=sampler.pack_algorithm, seed=sampler.seed, pad_id=sampler.pad_id,
                      shuffle=sampler.shuffle)
        sharded.load_state_dict(sampler.state_dict())
        return sharded

    def collate(self, rows: list[list[int]]) -> ShardBatch:
        """This rank's part of the global batch `rows` (lists of document ids)."""
        lengths = self.mix.lengths
        tokens = [int(sum(lengths[d] for d in row)) for row in rows]
        parts = split_rows(tokens, self.world_size, self.rows_per_rank)
        batch = self.local.collate([rows[i] for i in parts[self.rank]])
        # the trained tokens of the global batch: every document's mask, read (memory-mapped), not collated
        trained = sum(int((self.mix.doc(d)[1][1:] == 1).sum()) for row in rows for d in row)
        return ShardBatch(**vars(batch), global_real_tokens=sum(tokens), global_target_tokens=trained,
                          rank_real_tokens=tuple(sum(tokens[i] for i in p) for p in parts))


def spread(batches: list[ShardBatch]) -> dict:
    """Real tokens per rank summed over `batches`: min, max and (max / mean - 1), the fraction by which the
    busiest rank exceeds an even split."""
    per_rank = np.sum([b.rank_real_tokens for b in batches], axis=0)
    return {"min": int(per_rank.min()), "max": int(per_rank.max()),
            "imbalance": float(per_rank.max() / max(per_rank.mean(), 1) - 1.0)}
