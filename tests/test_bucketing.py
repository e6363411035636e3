"""pipecomm.bucketing: one bucketing rule, checked against a naive re-statement of it."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from pipecomm.bucketing import bucket_bytes, bucket_indices, bucket_nbytes


def _t(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


def _oracle(params, cap, visit, kinds):
    """The rule written out naively: closes after adding; per-kind or single open bucket."""
    cap = math.inf if cap is None else cap
    buckets, open_ = [], {}
    for i in visit:
        k = (params[i].dtype, params[i].device)
        if kinds == "consecutive" and open_ and k not in open_:
            buckets += list(open_.values())
            open_ = {}
        open_.setdefault(k, []).append(i)
        if sum(params[j].numel() * params[j].element_size() for j in open_[k]) >= cap:
            buckets.append(open_.pop(k))
    buckets += list(open_.values())
    pos = {i: n for n, i in enumerate(visit)}
    return sorted(buckets, key=lambda b: max(pos[i] for i in b))


def test_sizes_and_order():
    ps = [_t(256), _t(256), _t(512)]  # 1, 1, 2 KiB
    assert bucket_indices(ps, 2048) == [[2], [1, 0]]
    assert bucket_indices(ps, 2048, order="forward") == [[0, 1], [2]]
    assert bucket_indices(ps, 2048, order=[1, 2, 0]) == [[1, 2], [0]]
    assert bucket_nbytes(ps, [[2], [1, 0]]) == [2048, 2048]
    # closes once it reaches the cap: exactly at the cap, or past it
    assert bucket_indices(ps, 1024, order="forward") == [[0], [1], [2]]
    assert bucket_indices(ps, 1025, order="forward") == [[0, 1], [2]]
    assert bucket_indices(ps, None) == [[2, 1, 0]]
    assert bucket_indices(ps, math.inf, order="forward") == [[0, 1, 2]]


def test_oversize_parameter_gets_its_own_bucket():
    ps = [_t(10), _t(10_000), _t(10), _t(10)]
    assert bucket_indices(ps, 100, order="forward") == [[0, 1], [2, 3]]
    assert bucket_indices(ps, 1, order="forward") == [[0], [1], [2], [3]]
    assert bucket_indices([_t(10_000)], 1) == [[0]]


def test_empty():
    assert bucket_indices([], 100) == []
    assert bucket_indices([], None, order=[]) == []
    assert bucket_nbytes([], []) == []
    # zero-size tensors are bucketed like any other and never close a bucket by themselves
    ps = [_t(0), _t(4), _t(0)]
    assert bucket_indices(ps, 16, order="forward") == [[0, 1], [2]]
    assert bucket_indices([_t(0), _t(0)], 1) == [[1, 0]]


def test_mixed_dtypes():
    f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16
    ps = [_t(3, f32), _t(5, f64), _t(4, f32), _t(2, bf16), _t(6, f32)]
    assert bucket_indices(ps, None, order="forward") == [[0], [1], [2], [3], [4]]
    assert bucket_indices(ps, None, order="forward", kinds="interleaved") == [[1], [3], [0, 2, 4]]
    # interleaved, capped: f32 closes at 3+4 floats = 28 bytes >= 20
    assert bucket_indices(ps, 20, order="forward", kinds="interleaved") == [[1], [0, 2], [3], [4]]
    for b in bucket_indices(ps, 1e9, kinds="interleaved") + bucket_indices(ps, 1e9):
        assert len({ps[i].dtype for i in b}) == 1


def test_meta_device_kinds():
    ps = [_t(4), torch.zeros(4, device="meta"), _t(4)]
    assert bucket_indices(ps, None, order="forward") == [[0], [1], [2]]
    assert bucket_indices(ps, None, order="forward", kinds="interleaved") == [[1], [0, 2]]


def test_random_against_oracle():
    rng = random.Random(0)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.int64]
    for _ in range(300):
        n = rng.randrange(0, 9)
        ps = [_t(rng.randrange(0, 40), rng.choice(dtypes[: rng.randrange(1, 5)])) for _ in range(n)]
        cap = rng.choice([None, 1, 7, 64, 100, 333, 1e6])
        perm = list(range(n))
        rng.shuffle(perm)
        for order, kinds in itertools.product(
            ["reverse", "forward", perm], ["consecutive", "interleaved"]
        ):
            visit = {"reverse": list(reversed(range(n))), "forward": list(range(n))}.get(
                order if isinstance(order, str) else "", perm
            )
            got = bucket_indices(ps, cap, order=order, kinds=kinds)
            assert got == _oracle(ps, cap, visit, kinds)
            assert sorted(i for b in got for i in b) == list(range(n))


def test_bad_arguments():
    ps = [_t(3), _t(5)]
    with pytest.raises(TypeError, match="params"):
        bucket_indices(torch.zeros(3), 10)
    with pytest.raises(TypeError, match=r"params\[1\]"):
        bucket_indices([_t(3), 5], 10)
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="bucket_bytes"):
            bucket_indices(ps, bad)
    for bad in (True, "10", [10]):
        with pytest.raises(TypeError, match="bucket_bytes"):
            bucket_indices(ps, bad)
    with pytest.raises(ValueError, match="order"):
        bucket_indices(ps, 10, order="backward")
    with pytest.raises(ValueError, match="permutation"):
        bucket_indices(ps, 10, order=[0])
    with pytest.raises(ValueError, match="permutation"):
        bucket_indices(ps, 10, order=[0, 0])
    with pytest.raises(ValueError, match="permutation"):
        bucket_indices(ps, 10, order=[0, 2])
    with pytest.raises(TypeError, match="order"):
        bucket_indices(ps, 10, order=[0, 1.0])
    with pytest.raises(TypeError, match="order"):
        bucket_indices(ps, 10, order={0, 1})
    with pytest.raises(ValueError, match="kinds"):
        bucket_indices(ps, 10, kinds="split")


def test_bucket_bytes():
    assert bucket_bytes(25.0) == 25 * 2**20
    assert bucket_bytes(1) == 2**20
    for bad in (0, -2.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="X: bucket_mb"):
            bucket_bytes(bad, where="X")
    for bad in (True, None, "25"):
        with pytest.raises(TypeError, match="bucket_mb"):
            bucket_bytes(bad)


def test_one_bucket_per_kind_in_first_seen_order():
    f32, f64, f16 = torch.float32, torch.float64, torch.float16
    ps = [_t(3, f64), _t(5, f32), _t(4, f64), _t(2, f16), _t(6, f32)]
    got = sorted(bucket_indices(ps, None, order="forward", kinds="interleaved"))
    assert got == [[0, 2], [1, 4], [3]]
