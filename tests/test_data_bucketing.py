"""Tests for bucketing, long-sentence policies, the batch sampler and collation."""

from __future__ import annotations

import itertools
import logging

import hypothesis
import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_mp_lstm.data.batch import LMBatch, collate_lm
from lightning_mp_lstm.data.buckets import BucketedDataset, auto_buckets, resolve_buckets
from lightning_mp_lstm.data.sampler import BucketBatchSampler

BOS = 2


def _sentences(n: int, seed: int = 0, max_len: int = 40, vocab: int = 50) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, size=n)
    return [[*rng.integers(3, vocab, size=k - 1).tolist(), BOS] for k in lengths]


def _padding_cost(lengths: np.ndarray, buckets: list[int]) -> int:
    b = np.asarray(buckets)
    return int((b[np.searchsorted(b, lengths)] - lengths).sum())


# ------------------------------------------------------------------ buckets
def test_auto_buckets_minimal_padding_matches_brute_force() -> None:
    rng = np.random.default_rng(1)
    for trial in range(5):
        lengths = rng.integers(1, 25, size=60)
        values = np.unique(lengths)
        for k in (1, 2, 3, 4):
            got = auto_buckets(lengths, k)
            assert got[-1] == lengths.max() and len(got) == min(k, values.size)
            best = min(
                _padding_cost(lengths, [*c, int(values[-1])])
                for c in itertools.combinations(values[:-1].tolist(), min(k, values.size) - 1)
            )
            assert _padding_cost(lengths, got) == best, (trial, k)


def test_auto_buckets_edge_cases() -> None:
    assert auto_buckets([7, 7, 7], 4) == [7]
    assert auto_buckets([1, 2, 3], 10) == [1, 2, 3]
    with pytest.raises(ValueError, match="empty"):
        auto_buckets([], 3)
    with pytest.raises(ValueError, match="num_buckets"):
        auto_buckets([3], 0)


def test_resolve_buckets() -> None:
    lengths = [3, 9, 12, 40]
    assert resolve_buckets([32, 8, 16, 8], lengths) == [8, 16, 32]
    assert resolve_buckets(None, lengths) == [40]
    assert resolve_buckets("auto", lengths, num_auto_buckets=2)[-1] == 40
    with pytest.raises(ValueError, match="'auto' or None"):
        resolve_buckets("quantile", lengths)
    with pytest.raises(ValueError, match="positive"):
        resolve_buckets([0, 8], lengths)


# ------------------------------------------------------------------ dataset
def test_examples_padded_to_bucket_length_and_shifted() -> None:
    sents = _sentences(200)
    ds = BucketedDataset(sents, [8, 16, 24, 32, 40])
    assert len(ds) == 200 and ds.num_long == 0
    for i, s in enumerate(sents):
        inputs, targets = ds[i]
        t = ds.buckets[ds.bucket_indices[i]]
        assert inputs.dtype == targets.dtype == torch.int64
        assert inputs.shape == targets.shape == (t,)
        assert t >= len(s) and (ds.bucket_indices[i] == 0 or ds.buckets[ds.bucket_indices[i] - 1] < len(s))
        n = len(s)
        assert targets[:n].tolist() == s and inputs[0] == BOS and inputs[1:n].tolist() == s[:-1]
        assert not targets[n:].any() and not inputs[n:].any()


def test_pad_to_max_single_bucket() -> None:
    sents = _sentences(30)
    ds = BucketedDataset(sents, None)
    assert ds.buckets == [max(map(len, sents))] and set(ds.bucket_indices.tolist()) == {0}


def test_split_policy_loses_and_duplicates_nothing(caplog: pytest.LogCaptureFixture) -> None:
    sents = _sentences(50, max_len=70)
    n_long = sum(len(s) > 16 for s in sents)
    with caplog.at_level(logging.WARNING, logger="lightning_mp_lstm.data"):
        ds = BucketedDataset(sents, [8, 16], long_policy="split")
    assert ds.num_long == n_long > 0
    assert any(f"{n_long} of 50 sentences" in r.getMessage() and "split" in r.getMessage() for r in caplog.records)
    # reconstruct: examples are in sentence order, pieces consecutive
    stream_in, stream_tgt = [], []
    for i in range(len(ds)):
        inputs, targets = ds[i]
        n = ds.example_length(i)
        assert 1 <= n <= 16
        stream_in += inputs[:n].tolist()
        stream_tgt += targets[:n].tolist()
    flat = [t for s in sents for t in s]
    assert stream_tgt == flat  # every token predicted exactly once
    assert stream_in == [BOS, *flat[:-1]]  # input = target stream shifted by one


def test_truncate_and_drop_policies(caplog: pytest.LogCaptureFixture) -> None:
    sents = _sentences(40, max_len=30)
    long = [s for s in sents if len(s) > 12]
    with caplog.at_level(logging.WARNING, logger="lightning_mp_lstm.data"):
        tr = BucketedDataset(sents, [6, 12], long_policy="truncate")
        dr = BucketedDataset(sents, [6, 12], long_policy="drop")
    assert tr.num_long == dr.num_long == len(long) > 0
    assert len(tr) == len(sents) and len(dr) == len(sents) - len(long)
    for i, s in enumerate(sents):
        assert tr[i][1][: min(len(s), 12)].tolist() == s[:12]
    kept = [s for s in sents if len(s) <= 12]
    assert [dr[i][1][: len(s)].tolist() for i, s in enumerate(kept)] == kept
    messages = [r.getMessage() for r in caplog.records]
    assert any("truncated" in m for m in messages) and any("dropped" in m for m in messages)


def test_invalid_policy_names_allowed_ones() -> None:
    with pytest.raises(ValueError, match="split, truncate, drop"):
        BucketedDataset([[3, BOS]], [4], long_policy="wrap")


def test_min_bucket_size_moves_examples_up() -> None:
    sents = [[3, BOS]] * 1 + [[3, 4, 5, BOS]] * 5 + [[3] * 7 + [BOS]] * 1
    ds = BucketedDataset(sents, [2, 4, 8], min_bucket_size=3)
    counts = np.bincount(ds.bucket_indices, minlength=3)
    assert counts.tolist() == [0, 0, 7]  # [1] -> bucket 4, then the lone 8 absorbs the 4s
    assert all(ds[i][0].shape == (8,) for i in range(len(ds)))
    with pytest.raises(ValueError, match="fewer than the required 8"):
        BucketedDataset(sents, [2, 4, 8], min_bucket_size=8)


# ------------------------------------------------------------------ sampler
@pytest.fixture(scope="module")
def dataset() -> BucketedDataset:
    return BucketedDataset(_sentences(500, seed=3), [8, 16, 24, 32, 40])


def _sampler(ds: BucketedDataset, **kw) -> BucketBatchSampler:
    kw.setdefault("batch_size", 16)
    return BucketBatchSampler(ds.bucket_indices, ds.buckets, **kw)


def test_batches_from_one_bucket_cover_everything(dataset: BucketedDataset) -> None:
    s = _sampler(dataset, batch_size=16, shuffle=True, seed=1)
    batches = list(s)
    assert len(batches) == len(s)
    assert sorted(i for b in batches for i in b) == list(range(len(dataset)))
    for b in batches:
        assert len({int(dataset.bucket_indices[i]) for i in b}) == 1 and 1 <= len(b) <= 16
    for bucket in range(len(dataset.buckets)):  # sizes inside a bucket differ by at most one
        sizes = [len(b) for b in batches if dataset.bucket_indices[b[0]] == bucket]
        assert max(sizes) - min(sizes) <= 1


def test_token_budget_respected(dataset: BucketedDataset) -> None:
    s = _sampler(dataset, batch_size=None, max_tokens=200)
    loader = DataLoader(dataset, batch_sampler=s, collate_fn=collate_lm)
    shapes = [tuple(b.inputs.shape) for b in loader]
    assert len(shapes) == len(s)
    assert all(rows * t <= 200 for rows, t in shapes)
    assert any(rows * t > 150 for rows, t in shapes)  # and actually used
    assert sum(rows for rows, _ in shapes) == len(dataset)
    both = _sampler(dataset, batch_size=4, max_tokens=200)
    assert all(len(b) <= 4 for b in both)


def test_shuffling_deterministic_per_seed_and_epoch(dataset: BucketedDataset) -> None:
    a, b = _sampler(dataset, seed=7), _sampler(dataset, seed=7)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    second = list(a)
    assert second != first and sorted(map(sorted, second)) != sorted(map(sorted, first))
    b.set_epoch(1)
    assert list(b) == second
    assert list(_sampler(dataset, seed=8)) != first
    # the bucket order is shuffled too
    order = [int(dataset.bucket_indices[x[0]]) for x in first]
    assert order != sorted(order)
    plain = [int(dataset.bucket_indices[x[0]]) for x in _sampler(dataset, shuffle=False)]
    assert plain == sorted(plain)


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_replica_shards_concatenate_to_global_batch(dataset: BucketedDataset, num_replicas: int) -> None:
    glob = _sampler(dataset, batch_size=10, seed=4)
    glob.set_epoch(2)
    shards = []
    for rank in range(num_replicas):
        s = _sampler(dataset, batch_size=10, seed=4, num_replicas=num_replicas, rank=rank)
        s.set_epoch(2)
        shards.append(list(s))
        assert len(s) == len(glob)
    assert len({len(x) for x in shards}) == 1
    for k, global_batch in enumerate(glob):
        parts = [shards[r][k] for r in range(num_replicas)]
        assert all(parts) and sum(parts, []) == global_batch
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_replica_weights_proportional(dataset: BucketedDataset) -> None:
    shards = [list(_sampler(dataset, batch_size=16, num_replicas=2, rank=r, replica_weights=[1, 3])) for r in (0, 1)]
    sizes = [(len(a), len(b)) for a, b in zip(*shards)]
    assert (4, 12) in sizes
    for a, b in sizes:
        assert a >= 1 and abs(b - 3 * a) <= 3
    with pytest.raises(ValueError, match="one per replica"):
        _sampler(dataset, num_replicas=2, replica_weights=[1.0])
    with pytest.raises(ValueError, match="positive"):
        _sampler(dataset, num_replicas=2, replica_weights=[1.0, 0.0])


def test_sampler_argument_errors(dataset: BucketedDataset) -> None:
    with pytest.raises(ValueError, match="batch_size and/or max_tokens"):
        BucketBatchSampler(dataset.bucket_indices, dataset.buckets)
    with pytest.raises(ValueError, match="need at least one per replica"):
        _sampler(dataset, batch_size=2, num_replicas=3)
    with pytest.raises(ValueError, match="allows only 2 sentences"):
        _sampler(dataset, batch_size=None, max_tokens=80, num_replicas=3)
    with pytest.raises(ValueError, match="rank"):
        _sampler(dataset, num_replicas=2, rank=2)
    small = BucketedDataset([[3, BOS]] * 2 + [[3] * 5 + [BOS]] * 9, [2, 8])
    with pytest.raises(ValueError, match="min_bucket_size"):
        _sampler(small, num_replicas=3)


def test_lightning_set_epoch_hook_reaches_sampler(dataset: BucketedDataset) -> None:
    from lightning.fabric.utilities.data import _set_sampler_epoch

    s = _sampler(dataset)
    loader = DataLoader(dataset, batch_sampler=s, collate_fn=collate_lm)
    _set_sampler_epoch(loader, 5)
    assert s.epoch == 5


# ----------------------------------------------------------------- collation
def test_collate(dataset: BucketedDataset) -> None:
    loader = DataLoader(dataset, batch_sampler=_sampler(dataset, batch_size=7), collate_fn=collate_lm)
    batch = next(iter(loader))
    assert isinstance(batch, LMBatch) and batch.inputs.dtype == torch.int64
    assert batch.inputs.shape[1] in dataset.buckets
    from lightning.fabric.utilities.apply_func import move_data_to_device

    moved = move_data_to_device(batch, torch.device("cpu"))
    assert isinstance(moved, LMBatch)


def test_padding_does_not_change_the_loss() -> None:
    """Summed CE with ignore_index=0 over a padded bucket == per-sentence unpadded computation."""
    torch.manual_seed(0)
    vocab = 30
    emb, lstm, out = nn.Embedding(vocab, 8), nn.LSTM(8, 12, batch_first=True), nn.Linear(12, vocab)

    def logits(x: torch.Tensor) -> torch.Tensor:
        return out(lstm(emb(x))[0])

    sents = _sentences(9, seed=5, max_len=10, vocab=vocab)
    ds = BucketedDataset(sents, [10])
    real = collate_lm([ds[i] for i in range(len(ds))])
    empty = torch.zeros(3, 10, dtype=torch.long)  # 3 extra all-pad rows, as a pipeline adds to fill its microbatches
    batch = LMBatch(torch.cat([real.inputs, empty]), torch.cat([real.targets, empty]))
    with torch.no_grad():
        lg = logits(batch.inputs)
        n_real = int((batch.targets != 0).sum())
        padded_loss = F.cross_entropy(lg.reshape(-1, vocab), batch.targets.reshape(-1), ignore_index=0, reduction="sum")
        total, count = 0.0, 0
        for s in sents:
            x = torch.tensor([[BOS, *s[:-1]]])
            y = torch.tensor(s)
            total += F.cross_entropy(logits(x)[0], y, reduction="sum").item()
            count += len(s)
    assert n_real == count == sum(map(len, sents))
    assert (padded_loss / n_real).item() == pytest.approx(total / count, rel=1e-5)


# ------------------------------------------------------- global batches every replica can share
@pytest.mark.timeout(10)  # the old sampler looped forever in _split_counts
def test_global_batch_smaller_than_replicas_raises_instead_of_hanging() -> None:
    # 3 sentences, at most 2 per global batch: batches of 2 and 1; 2 replicas cannot share the batch of 1
    with pytest.raises(ValueError, match="length 8 has 3 sentences") as err:
        list(BucketBatchSampler([0, 0, 0], [8], batch_size=2, num_replicas=2))
    message = str(err.value)
    assert "(batch_size=2)" in message and "2 replicas" in message and "batch_size >= 3" in message
    with pytest.raises(ValueError, match=r"length 8 has 3 sentences.*\(max_tokens=16 // 8 tokens\).*2 replicas"):
        list(BucketBatchSampler([0, 0, 0], [8], max_tokens=16, num_replicas=2))
    with pytest.raises(ValueError, match="max_tokens >= 3 x 8 = 24"):
        BucketBatchSampler([0] * 7, [8], max_tokens=16, num_replicas=2)  # 7 = 2 + 2 + 2 + 1
    # the remedies of the message work, and the global batches are those of one replica
    one = list(BucketBatchSampler([0, 0, 0], [8], batch_size=3, shuffle=False))
    shards = [list(BucketBatchSampler([0, 0, 0], [8], batch_size=3, shuffle=False, num_replicas=2, rank=r))
              for r in (0, 1)]
    assert one == [[0, 1, 2]] and shards == [[[0, 1]], [[2]]]
    shards = [list(BucketBatchSampler([0] * 7, [8], max_tokens=24, shuffle=False, num_replicas=2, rank=r))
              for r in (0, 1)]
    assert shards == [[[0, 1], [3], [5]], [[2], [4], [6]]]  # global batches 3 + 2 + 2


@pytest.mark.timeout(10)
def test_split_counts_refuses_more_replicas_than_items() -> None:
    from lightning_mp_lstm.data.sampler import _split_counts

    with pytest.raises(ValueError, match="each of 2 replicas at least one of 1"):
        _split_counts(1, np.ones(2))
    assert _split_counts(2, np.array([1.0, 100.0])).tolist() == [1, 1]
    assert _split_counts(16, np.array([1.0, 3.0])).tolist() == [4, 12]


def _expected_to_fail(sizes: list[int], lengths: list[int], batch_size: int | None, max_tokens: int | None,
                      replicas: int) -> bool:
    """The construction rule, computed independently of the sampler."""
    for n, length in zip(sizes, lengths):
        if n == 0:
            continue
        cap = min(batch_size or n, max_tokens // length if max_tokens is not None else n)
        if cap < replicas or n < replicas:
            return True
        m = -(-n // min(cap, n))
        if n // m < replicas:
            return True
    return False


@hypothesis.settings(max_examples=150, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(
    sizes=st.lists(st.integers(0, 25), min_size=1, max_size=4),
    limits=st.one_of(  # (batch_size, max_tokens), at least one given
        st.tuples(st.integers(1, 16), st.none()),
        st.tuples(st.none(), st.integers(1, 200)),
        st.tuples(st.integers(1, 16), st.integers(1, 200)),
    ),
    replicas=st.integers(1, 4),
    weights=st.lists(st.floats(0.1, 10.0), min_size=4, max_size=4),
    shuffle=st.booleans(),
    epoch=st.integers(0, 3),
)
@pytest.mark.timeout(120)  # the old sampler hung on some of these
def test_property_every_rank_gets_a_share_and_global_batches_ignore_replicas(
    sizes: list[int], limits: tuple[int | None, int | None], replicas: int, weights: list[float], shuffle: bool,
    epoch: int,
) -> None:
    batch_size, max_tokens = limits
    lengths = [4 * (b + 1) for b in range(len(sizes))]
    indices = np.repeat(np.arange(len(sizes)), sizes)
    np.random.default_rng(sum(sizes)).shuffle(indices)
    kw = dict(batch_size=batch_size, max_tokens=max_tokens, shuffle=shuffle, seed=5)
    expected_failure = _expected_to_fail(sizes, lengths, batch_size, max_tokens, replicas)
    cap_ok = all(n == 0 or min(batch_size or n, max_tokens // b if max_tokens else n) >= 2 * replicas - 1
                 for n, b in zip(sizes, lengths))
    if cap_ok and all(n == 0 or n >= replicas for n in sizes):
        assert not expected_failure  # a cap of 2R - 1 always works (the proof in the docstring)
    samplers = []
    try:
        for rank in range(replicas):
            samplers.append(BucketBatchSampler(indices, lengths, num_replicas=replicas, rank=rank,
                                               replica_weights=weights[:replicas], **kw))
    except ValueError:
        hypothesis.event("construction refused")
        assert expected_failure
        return
    hypothesis.event(f"accepted with {replicas} replicas")
    assert not expected_failure
    reference = BucketBatchSampler(indices, lengths, **kw)  # one replica
    reference.set_epoch(epoch)
    glob = [b.tolist() for b in reference.global_batches()]
    assert sorted(sum(glob, [])) == list(range(len(indices)))
    shards = []
    for s in samplers:
        s.set_epoch(epoch)
        assert [b.tolist() for b in s.global_batches()] == glob  # independent of the replica count
        shards.append(list(s))
        assert len(shards[-1]) == len(s) == len(reference)
    for k, batch in enumerate(glob):
        parts = [shard[k] for shard in shards]
        assert all(parts) and sum(parts, []) == batch
