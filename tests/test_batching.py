"""Batching: packing invariants, padded strategies, mixing, seeded order and exact resume; the whole
shared mix packed at a 16,384-token budget."""
import contextlib
import hashlib
import json
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch

from gapless.config import DataConfig, SourceConfig, from_dict
from gapless.data.batching import (IGNORE, Batch, BatchSampler, Mixture, documents_per_epoch, pack_best_fit,
                                   pack_first_fit)
from gapless.data.cache import TokenizedDataset
from gapless.data.pipeline import build_data

PAD = 0


def synthetic(lengths, seed=0, first_id=1) -> TokenizedDataset:
    """Documents of random ids >= first_id (never the pad id) with a random prompt/answer mask."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int64)
    ids = rng.integers(first_id, 50_000, lengths.sum()).astype(np.int32)
    mask = np.zeros(lengths.sum(), np.uint8)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        mask[lo + rng.integers(0, hi - lo):hi] = 1  # an answer at the end of each document
    return TokenizedDataset(ids, mask, offsets, np.arange(len(lengths), dtype=np.int32), {"pad_id": PAD})


def mixture(*datasets) -> Mixture:
    return Mixture(list(datasets), [len(d) for d in datasets], [f"s{i}" for i in range(len(datasets))])


def docs_of(mix: Mixture) -> Counter:
    return Counter(np.asarray(mix.doc(i)[0]).tobytes() for i in range(len(mix)))


def check_packed(batch: Batch, mix: Mixture, T: int) -> list[bytes]:
    """Every invariant of a packed batch; returns its documents' token bytes."""
    B = batch.input_ids.shape[0]
    assert batch.input_ids.shape == batch.targets.shape == batch.position_ids.shape == (B, T)
    assert batch.input_ids.dtype == batch.targets.dtype == batch.position_ids.dtype == torch.int64
    assert batch.attention_mask is None and batch.cu_seqlens.dtype == torch.int32
    cu = batch.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == B * T and all(b > a for a, b in zip(cu, cu[1:]))
    assert set(range(0, B * T + 1, T)) <= set(cu)  # no segment crosses a row
    assert batch.max_seqlen == max(b - a for a, b in zip(cu, cu[1:]))
    ids, targets, pos = batch.input_ids.flatten(), batch.targets.flatten(), batch.position_ids.flatten()
    docs, real = [], 0
    for a, b in zip(cu, cu[1:]):
        seg = ids[a:b]
        assert torch.equal(pos[a:b], torch.arange(b - a))  # positions restart in every segment
        assert targets[b - 1] == IGNORE  # nothing is predicted across a boundary
        if bool((seg == mix.pad_id).all()):  # the unused tail of a row (no real document is all padding)
            assert bool((targets[a:b] == IGNORE).all())
            continue
        real += b - a
        docs.append(seg.numpy().astype(np.int32).tobytes())
    assert batch.num_real_tokens == real and batch.num_slots == B * T
    assert batch.num_target_tokens == int((batch.targets != IGNORE).sum())
    return docs


def expected_targets(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    t = np.full(len(x), IGNORE, np.int64)
    t[:-1] = np.where(m[1:] == 1, x[1:], IGNORE)
    return t


@pytest.mark.parametrize("algorithm", ["best_fit", "first_fit"])
def test_packed_batches_hold_every_document_once_per_epoch(algorithm):
    rng = np.random.default_rng(1)
    mix = mixture(synthetic(rng.integers(1, 300, 500), 1), synthetic(rng.integers(200, 1024, 60), 2))
    s = BatchSampler(mix, strategy="packed", max_seq_len=1024, tokens_per_batch=4096, pack_algorithm=algorithm, seed=3)
    seen = Counter()
    batches = list(s.epoch_batches(0))
    for batch in batches:
        seen.update(check_packed(batch, mix, 1024))
    assert seen == docs_of(mix)
    real = sum(b.num_real_tokens for b in batches)
    assert real == mix.lengths.sum() and s.efficiency(0) == pytest.approx(real / sum(b.num_slots for b in batches))
    assert s.efficiency(0) > 0.95
    # targets are the next token of the same document where it is trained
    batch = batches[0]
    cu = batch.cu_seqlens.tolist()
    flat_ids, flat_t = batch.input_ids.flatten().numpy(), batch.targets.flatten().numpy()
    lookup = {np.asarray(mix.doc(i)[0]).tobytes(): i for i in range(len(mix))}
    for a, b in zip(cu, cu[1:]):
        key = flat_ids[a:b].astype(np.int32).tobytes()
        if key in lookup:
            x, m = mix.doc(lookup[key])
            assert np.array_equal(flat_t[a:b], expected_targets(np.asarray(x), np.asarray(m)))


def test_packers_fill_rows_without_overflow():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 900, 3000)
    for pack in (pack_best_fit, pack_first_fit):
        rows = pack(lengths, 1000)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        fill = [lengths[row].sum() for row in rows]
        assert max(fill) <= 1000 and sum(fill) / (1000 * len(rows)) > 0.97, pack.__name__
    # first-fit puts each document in the first row it fits; best-fit in the fullest
    assert pack_first_fit(np.array([8, 6, 3, 1]), 10) == [[0, 3], [1, 2]]
    assert pack_best_fit(np.array([8, 6, 3, 1]), 10) == [[0], [1, 2, 3]]


@pytest.mark.parametrize("strategy", ["padded", "length_grouped", "pad_to_max"])
def test_padded_strategies(strategy):
    rng = np.random.default_rng(4)
    mix = mixture(synthetic(rng.integers(1, 500, 400), 4))
    s = BatchSampler(mix, strategy=strategy, max_seq_len=512, tokens_per_batch=2048, pad_to_multiple_of=8, seed=0)
    seen, real, slots = Counter(), 0, 0
    for batch in s.epoch_batches(0):
        B, T = batch.input_ids.shape
        assert batch.cu_seqlens is None and batch.max_seqlen == T and B * T <= 2048 and batch.num_slots == B * T
        assert T == 512 if strategy == "pad_to_max" else T % 8 == 0
        n = batch.attention_mask.sum(1)
        assert T - int(n.max()) < (1 if strategy == "pad_to_max" and n.max() == 512 else 8) or strategy == "pad_to_max"
        for r in range(B):
            k = int(n[r])
            assert bool((batch.attention_mask[r, :k] == 1).all()) and bool((batch.attention_mask[r, k:] == 0).all())
            assert bool((batch.input_ids[r, k:] == PAD).all()) and bool((batch.targets[r, k - 1:] == IGNORE).all())
            seen[batch.input_ids[r, :k].numpy().astype(np.int32).tobytes()] += 1
        real += batch.num_real_tokens
        slots += batch.num_slots
        assert batch.num_real_tokens == int(n.sum())
    assert seen == docs_of(mix)
    assert s.efficiency(0) == pytest.approx(real / slots)
    if strategy == "length_grouped":  # similar lengths together: far less padding than random batches
        padded = BatchSampler(mix, strategy="padded", max_seq_len=512, tokens_per_batch=2048, seed=0)
        assert s.efficiency(0) > padded.efficiency(0) + 0.15


@pytest.mark.parametrize("strategy", ["padded", "length_grouped", "pad_to_max"])
def test_rows_per_batch_caps_the_documents_of_every_batch(strategy):
    """rows_per_batch 2 (a peer's per-device batch size, unpacked): 2 documents per batch, not as many as fit in
    2,048 slots (pad_to_max: 2 rows, not 4), each document once per epoch, within tokens_per_batch slots."""
    rng = np.random.default_rng(6)
    mix = mixture(synthetic(rng.integers(1, 500, 300), 6), synthetic(rng.integers(1, 60, 200), 7))
    s = BatchSampler(mix, strategy=strategy, max_seq_len=512, tokens_per_batch=2048, rows_per_batch=2, seed=3)
    uncapped = BatchSampler(mix, strategy=strategy, max_seq_len=512, tokens_per_batch=2048, seed=3)
    assert max(len(b) for b in uncapped.plan(0)) > 2  # the cap binds
    for epoch in (0, 1):
        plan = s.plan(epoch)
        assert Counter(d for batch in plan for d in batch) == Counter(range(len(mix)))  # each document once
        assert [len(b) for b in plan] == [2] * (len(mix) // 2)  # any 2 fit: every batch holds 2
    seen, real, slots = Counter(), 0, 0
    for batch in s.epoch_batches(0):
        B, T = batch.input_ids.shape
        assert B == 2 and B * T <= 2048
        n = batch.attention_mask.sum(1)
        for r in range(B):
            seen[batch.input_ids[r, :int(n[r])].numpy().astype(np.int32).tobytes()] += 1
        real, slots = real + batch.num_real_tokens, slots + batch.num_slots
    assert seen == docs_of(mix) and s.efficiency(0) == pytest.approx(real / slots)


def test_evaluation_batches_are_not_capped_by_rows_per_batch():
    """rows_per_batch shapes the optimizer's steps; held-out data is batched as many documents as fit, in order (the
    run's evaluation and `gapless eval` alike), the same batches as without the cap."""
    rng = np.random.default_rng(6)
    mix = mixture(synthetic(rng.integers(1, 60, 200), 7))
    cfg = DataConfig(sources=[SourceConfig(path="x")], batching="padded", max_seq_len=512, tokens_per_batch=2048,
                     rows_per_batch=1)
    plan = BatchSampler.for_eval(cfg, mix).plan(0)
    assert plan == BatchSampler.from_config(replace(cfg, rows_per_batch=None), mix, shuffle=False).plan(0)
    assert max(len(b) for b in plan) > 1 and [d for b in plan for d in b] == list(range(len(mix)))
    assert max(len(b) for b in BatchSampler.from_config(cfg, mix).plan(0)) == 1  # training keeps the cap


def test_rows_per_batch_unset_keeps_the_plan():
    """rows_per_batch None is the plan gapless made before the setting existed (digests of the plans of epochs 0
    and 1 taken then), and a cap that never binds changes nothing either: a resumed run continues its order."""
    rng = np.random.default_rng(6)
    mix = mixture(synthetic(rng.integers(1, 500, 300), 6), synthetic(rng.integers(1, 60, 200), 7))
    before = {"padded": "d04880088a993530", "length_grouped": "f98d85c8d020e46c", "pad_to_max": "e0829a340e7199e0",
              "packed": "a6d23250d2287e93"}
    for strategy, digest in before.items():
        s = BatchSampler(mix, strategy=strategy, max_seq_len=512, tokens_per_batch=2048, seed=3)
        plans = [s.plan(e) for e in (0, 1)]
        assert hashlib.sha256(json.dumps(plans).encode()).hexdigest()[:16] == digest, strategy
        if strategy != "packed":
            with pytest.warns(UserWarning, match="pad_to_max batches hold 4") if strategy == "pad_to_max" else \
                    contextlib.nullcontext():
                roomy = BatchSampler(mix, strategy=strategy, max_seq_len=512, tokens_per_batch=2048,
                                     rows_per_batch=len(mix), seed=3)
            assert [roomy.plan(e) for e in (0, 1)] == plans, strategy


def test_pad_to_max_rows_are_the_fewer_of_rows_per_batch_and_the_budget():
    mix = mixture(synthetic([5, 7, 300, 40, 90, 12, 8]))
    s = BatchSampler(mix, strategy="pad_to_max", max_seq_len=512, tokens_per_batch=2048, rows_per_batch=3)
    assert [len(b) for b in s.plan(0)] == [3, 3, 1] and s.efficiency(0) == pytest.approx(462 / (7 * 512))
    with pytest.warns(UserWarning, match="rows_per_batch 6 is more than the 4 rows of max_seq_len 512"):
        s = BatchSampler(mix, strategy="pad_to_max", max_seq_len=512, tokens_per_batch=2048, rows_per_batch=6)
    assert [len(b) for b in s.plan(0)] == [4, 3]


def test_order_is_seeded_and_resume_yields_exactly_the_next_batch():
    rng = np.random.default_rng(5)
    mix = mixture(synthetic(rng.integers(1, 400, 300), 5))

    def sampler(seed=7):
        return BatchSampler(mix, strategy="packed", max_seq_len=512, tokens_per_batch=1024, seed=seed)

    n = sampler().batches_per_epoch(0)
    reference = [b.input_ids for _, b in zip(range(2 * n + 3), iter(sampler()))]  # crosses two epoch ends
    assert not torch.equal(reference[0], reference[n])  # each epoch has its own order
    other = next(iter(sampler(seed=8)))
    assert not torch.equal(other.input_ids, reference[0])
    for stop in (1, n - 1, n, n + 2):
        s = sampler()
        it = iter(s)
        for _ in range(stop):
            next(it)
        state = s.state_dict()
        resumed = sampler()
        resumed.load_state_dict(state)
        assert torch.equal(next(iter(resumed)).input_ids, reference[stop]), stop
    with pytest.raises(ValueError, match="cannot resume: the saved sampler had seed=7"):
        sampler(seed=9).load_state_dict(state)


def test_a_resume_with_another_rows_per_batch_is_refused():
    """Another cap is another batch order: refused as another tokens_per_batch is. A checkpoint written before the
    setting existed (no rows_per_batch in its state) was as many as fit, and resumes where that is still so."""
    mix = mixture(synthetic(np.random.default_rng(5).integers(1, 400, 300), 5))

    def sampler(rows):
        return BatchSampler(mix, strategy="padded", max_seq_len=512, tokens_per_batch=2048, rows_per_batch=rows,
                            seed=7)

    s = sampler(2)
    it = iter(s)
    next(it), next(it)
    state = s.state_dict()
    assert state["rows_per_batch"] == 2
    resumed = sampler(2)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed)).input_ids, next(it).input_ids)
    for rows in (3, None):
        with pytest.raises(ValueError, match=rf"cannot resume: the saved sampler had rows_per_batch=2, this run has "
                                             rf"{rows}"):
            sampler(rows).load_state_dict(state)
    old = {k: v for k, v in sampler(None).state_dict().items() if k not in ("rows_per_batch", "data", "cache_version")}
    sampler(None).load_state_dict({**old, "position": 3})
    with pytest.raises(ValueError, match="the saved sampler had rows_per_batch=None, this run has 2"):
        sampler(2).load_state_dict(old)


def test_mixing_by_epochs_and_weights():
    a, b, c = synthetic([10] * 100, 1), synthetic([20] * 40, 2), synthetic([30] * 10, 3)
    sources = [SourceConfig(path="a", epochs=0.5), SourceConfig(path="b", epochs=2.0), SourceConfig(path="c")]
    assert documents_per_epoch([100, 40, 10], sources) == [50, 80, 10]
    weighted = [SourceConfig(path="a", weight=1.0), SourceConfig(path="b", weight=3.0), SourceConfig(path="c")]
    assert documents_per_epoch([100, 40, 10], weighted) == [35, 105, 10]  # the 140 weighted documents, 1:3
    mix = Mixture.from_config([a, b, c], sources, ["a", "b", "c"])
    e0, e1 = mix.epoch_docs(0, 0), mix.epoch_docs(0, 1)
    per_source = np.searchsorted(mix.offsets, e0, side="right") - 1
    assert np.bincount(per_source).tolist() == [50, 80, 10]
    assert len(set(e0[per_source == 0].tolist())) == 50  # half of a, no repeats
    assert Counter(Counter(e0[per_source == 1].tolist()).values()) == {2: 40}  # all of b, twice
    e1_source = np.searchsorted(mix.offsets, e1, side="right") - 1
    assert set(e0[per_source == 0].tolist()) != set(e1[e1_source == 0].tolist())  # another half next epoch
    s = BatchSampler(mix, strategy="packed", max_seq_len=64, tokens_per_batch=256, seed=0)
    assert sum(b.num_real_tokens for b in s.epoch_batches(0)) == 50 * 10 + 80 * 20 + 10 * 30


def test_batch_to_and_sampler_errors():
    mix = mixture(synthetic([5, 7, 300]))
    batch = next(iter(BatchSampler(mix, strategy="padded", max_seq_len=512, tokens_per_batch=512)))
    moved = batch.to("cpu")
    assert moved is not batch and torch.equal(moved.input_ids, batch.input_ids) and moved.cu_seqlens is None
    assert (moved.num_real_tokens, moved.num_target_tokens) == (batch.num_real_tokens, batch.num_target_tokens)
    if torch.cuda.is_available():
        assert batch.pin_memory().input_ids.is_pinned()
    with pytest.raises(ValueError, match="a document has 300 tokens, more than max_seq_len 256"):
        BatchSampler(mix, strategy="packed", max_seq_len=256, tokens_per_batch=256)
    with pytest.warns(UserWarning, match="not a multiple of max_seq_len"):
        BatchSampler(mix, strategy="packed", max_seq_len=512, tokens_per_batch=1000)
    with pytest.raises(ValueError, match="rows_per_batch 2: .* not with packed"):
        BatchSampler(mix, strategy="packed", max_seq_len=512, tokens_per_batch=1024, rows_per_batch=2)
    with pytest.raises(ValueError, match="rows_per_batch 0: .* at least 1"):
        BatchSampler(mix, strategy="padded", max_seq_len=512, tokens_per_batch=1024, rows_per_batch=0)


# ---------------------------------------------------------------------------------------------
# the whole shared mix (../shared/data/messages with the Llama 3 tokenizer), tokenized once per module


@pytest.fixture(scope="module")
def shared_mix(shared, tmp_path_factory):
    cfg = from_dict(DataConfig, {
        "sources": [{"path": str(p)} for p in sorted((shared / "data/messages").glob("*.jsonl"))],
        "tokenizer": str(shared / "tokenizers/llama3"), "cache_dir": str(tmp_path_factory.mktemp("cache")),
        "max_seq_len": 16384, "tokens_per_batch": 16384}, "data")
    with pytest.warns(UserWarning, match="glaive_toolcall_en_demo.jsonl: 191 records have tool definitions"):
        mix, _, summary = build_data(cfg)  # Llama 3's template has no tools section
    return cfg, mix, summary


def test_the_shared_mix_packs_at_98_percent_with_every_token_once(shared_mix):
    cfg, mix, summary = shared_mix
    assert summary.kept == summary.records == len(mix) == 16359 and summary.dropped == {}
    s = BatchSampler.from_config(cfg, mix)
    seen = Counter()
    real = slots = 0
    for batch in s.epoch_batches(0):
        seen.update(check_packed(batch, mix, 16384))
        real += batch.num_real_tokens
        slots += batch.num_slots
    assert seen == docs_of(mix)  # every token of every kept document, exactly once
    assert real == summary.train_tokens == mix.lengths.sum()
    assert real / slots == pytest.approx(summary.packing_efficiency, abs=1e-5)
    assert real / slots >= 0.98
    # the same mix padded shows what padding costs
    padded = BatchSampler(mix, strategy="pad_to_max", max_seq_len=16384, tokens_per_batch=16384)
    assert padded.efficiency(0) == pytest.approx(mix.lengths.mean() / 16384)  # ~2%
