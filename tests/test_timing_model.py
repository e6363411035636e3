"""Tests of pipecomm.lab.training.pipesgd_timing_model: closed-form limits, breakdown bookkeeping, monotonicity,
compression ratios and bad arguments."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecomm.lab.networks import cost
from pipecomm.lab.networks.cost import LinkModel
from pipecomm.lab.training import pipesgd_timing_model as timing_model
from pipecomm.lab.training.pipesgd_timing_model import (
    breakdown,
    compression_ratio,
    iteration_time,
    speedup,
)

# alpha = 0, gamma = 0: ring allreduce of n bytes over p = 2 ranks costs exactly n * beta
BW_ONLY = LinkModel(alpha=0.0, beta=1e-9)
LINK = LinkModel(alpha=50e-6, beta=1 / 1.25e9, gamma=1e-10)


def kw(compute_s=0.1, update_s=0.0, nbytes=10**8, p=2, link=BW_ONLY, **extra):
    return dict(compute_s=compute_s, update_s=update_s, nbytes=nbytes, p=p, link=link, **extra)


def test_sync_is_sum():
    args = kw(compute_s=0.05, update_s=0.004, nbytes=3 * 2**20, p=8, link=LINK)
    a = cost.allreduce_time("ring", 3 * 2**20, 8, LINK)
    assert iteration_time("sync", **args) == pytest.approx(0.05 + a + 0.004)
    b = cost.allreduce_time("lp", 3 * 2**20, 8, LINK)
    assert iteration_time("sync", algorithm="lp", **args) == pytest.approx(0.054 + b)


def test_equal_compute_and_comm_gives_2x():
    # M = 10^8 B * 1 ns/B = 0.1 s = C, U = 0: sync 0.2 s, pipe max(0.1, 0.1) = 0.1 s
    assert iteration_time("sync", **kw()) == pytest.approx(0.2)
    assert iteration_time("pipe", **kw()) == pytest.approx(0.1)
    assert speedup("pipe", **kw()) == pytest.approx(2.0)


def test_communication_bound_limit():
    # C + U = 0.011 s << M = 1 s: pipe hides all compute, speedup (C + M + U) / M
    args = kw(compute_s=0.01, update_s=0.001, nbytes=10**9)
    assert iteration_time("pipe", **args) == pytest.approx(1.0)
    assert speedup("pipe", **args) == pytest.approx((0.01 + 1.0 + 0.001) / 1.0)


def test_compute_bound_limit():
    # M = 1e-3 s << C: pipe costs C + U; sync C + M + U
    args = kw(compute_s=0.1, update_s=0.01, nbytes=10**6)
    assert iteration_time("pipe", **args) == pytest.approx(0.11)
    assert speedup("pipe", **args) == pytest.approx(0.111 / 0.11)


@pytest.mark.parametrize("mode", timing_model.MODES)
def test_zero_communication_gives_1x(mode):
    for args in (kw(nbytes=0), kw(p=1), kw(link=LinkModel(0.0, 0.0))):
        assert iteration_time(mode, **args) == pytest.approx(0.1)  # C + U = 0.1 + 0
        assert speedup(mode, **args) == pytest.approx(1.0)


@settings(max_examples=100, deadline=None)
@given(
    c=st.floats(0.0, 1.0),
    u=st.floats(0.0, 0.1),
    n=st.integers(0, 10**9),
    k=st.integers(1, 3),
)
def test_overlap_alone_at_most_2x(c, u, n, k):
    args = kw(compute_s=c + 1e-6, update_s=u, nbytes=n)
    s = speedup("pipe", staleness=k, **args)
    assert 1.0 - 1e-12 <= s <= 2.0 + 1e-12
    # layer-wise lies between sync and pipe, and never beats the no-communication bound
    t_lw = iteration_time("layerwise", **args)
    assert iteration_time("pipe", **args) - 1e-12 <= t_lw <= iteration_time("sync", **args) + 1e-12
    assert iteration_time("nocomm", **args) <= t_lw + 1e-12


def test_staleness_and_update_placement():
    args = kw(compute_s=0.1, update_s=0.05, nbytes=12 * 10**7)  # M = 0.12 s
    # update overlapped: max(C + U, M) = 0.15
    assert iteration_time("pipe", **args) == pytest.approx(0.15)
    assert iteration_time("delayed", staleness=2, **args) == pytest.approx(0.15)
    # update first, then launch: k = 1 -> U + max(C, M) = 0.17; k = 2 hides it again
    assert iteration_time("pipe", overlap_update=False, **args) == pytest.approx(0.17)
    assert iteration_time("pipe", staleness=2, overlap_update=False, **args) == pytest.approx(0.15)
    # staleness 0 is synchronous
    assert iteration_time("pipe", staleness=0, **args) == iteration_time("sync", **args)


def test_layerwise_fluid():
    # f = 0.5, C = 0.2: backward 0.1 s. M = 0.08 s is hidden entirely; M = 0.15 s leaves 0.05 s
    assert iteration_time(
        "layerwise", **kw(compute_s=0.2, nbytes=8 * 10**7, backward_fraction=0.5)
    ) == pytest.approx(0.2)
    assert iteration_time(
        "layerwise", **kw(compute_s=0.2, nbytes=15 * 10**7, backward_fraction=0.5)
    ) == pytest.approx(0.25)
    # backward_fraction 0: nothing to overlap -> sync
    args = kw(compute_s=0.2, nbytes=15 * 10**7, backward_fraction=0.0)
    assert iteration_time("layerwise", **args) == pytest.approx(iteration_time("sync", **args))


def test_layerwise_buckets():
    # one bucket = sync
    args = kw(compute_s=0.2, update_s=0.01, nbytes=10**8, p=4, link=LINK, backward_fraction=0.6)
    assert iteration_time("layerwise", buckets=1, **args) == pytest.approx(
        iteration_time("sync", **args)
    )
    # two buckets, alpha = 0, p = 2: each a = 0.05 s; forward 0.08, backward 0.12 (ready at 0.14,
    # 0.2): finish = max(0.14 + 0.05, 0.2) + 0.05 = 0.25; T = 0.25 + U = 0.26
    two = kw(compute_s=0.2, update_s=0.01, nbytes=10**8, backward_fraction=0.6, buckets=2)
    assert iteration_time("layerwise", **two) == pytest.approx(0.26)
    # many buckets on a latency-free link approach the fluid model: 0.2 + 0.01 + max(0, 0.1 - 0.12)
    many = dict(two, buckets=1000)
    assert iteration_time("layerwise", **many) == pytest.approx(0.21, rel=2e-3)
    # with latency, more buckets eventually cost more (m alpha per iteration)
    lat = dict(many, link=LinkModel(1e-3, 1e-9))
    assert iteration_time("layerwise", **lat) > iteration_time("layerwise", **dict(lat, buckets=10))


def test_compression():
    # fp16 halves the wire time; the codec adds (p-1)/p n codec = 0.5 * 10^8 * 1e-10 = 5 ms (ring)
    args = kw(compute_s=0.01)
    b = breakdown("sync", compression="fp16", codec_s_per_byte=1e-10, **args)
    assert b["communication"] == pytest.approx(0.05)
    assert b["compression"] == pytest.approx(0.005)
    assert b["total"] == pytest.approx(0.01 + 0.055)
    # pipe, communication bound: exposed 0.055 - 0.01, split 50:5 between the two
    b = breakdown("pipe", compression="fp16", codec_s_per_byte=1e-10, **args)
    assert b["total"] == pytest.approx(0.055)
    assert b["communication"] == pytest.approx(0.045 * 50 / 55)
    assert b["compression"] == pytest.approx(0.045 * 5 / 55)
    # int8 with per-chunk scales sends slightly more than a quarter
    t_int8 = iteration_time("sync", compression="int8", chunk=1024, **args)
    assert t_int8 == pytest.approx(0.01 + 0.1 * 1028 / 4096)
    # codec cost without compression is ignored; compression beats an uncompressed baseline
    assert iteration_time("sync", codec_s_per_byte=1.0, **args) == iteration_time("sync", **args)
    s = speedup("pipe", compression="fp16", baseline_compression=None, **args)
    assert s == pytest.approx(0.11 / 0.05)


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(timing_model.MODES),
    alg=st.sampled_from(["ring", "lp", "be", "mst"]),
    c=st.floats(0.0, 0.5),
    u=st.floats(0.0, 0.05),
    n=st.integers(0, 4 * 10**8),
)
def test_breakdown_adds_up(mode, alg, c, u, n):
    args = kw(compute_s=c, update_s=u, nbytes=n, p=6, link=LINK, algorithm=alg)
    b = breakdown(mode, **args)
    assert b["compute"] == c and b["update"] == u
    parts = b["compute"] + b["communication"] + b["compression"] + b["update"]
    assert parts == pytest.approx(b["total"], abs=1e-12)
    if mode != "nocomm":
        a = cost.allreduce_time(alg, n, 6, LINK)
        assert b["communication"] + b["compression"] + b["hidden"] == pytest.approx(a, abs=1e-12)
    assert min(b.values()) >= 0


@pytest.mark.parametrize("mode", ["sync", "layerwise", "pipe"])
@pytest.mark.parametrize("alg", ["ring", "lp", "be", "mst"])
def test_monotone_in_p_and_bandwidth(mode, alg):
    args = dict(compute_s=0.02, update_s=0.002, nbytes=50 * 2**20, algorithm=alg)
    # BE is not monotone across non-powers of two (p = 3 pays the fold, p = 4 does not)
    ps = (1, 2, 4, 8, 16, 64) if alg == "be" else (1, 2, 3, 4, 5, 8, 16, 64)
    times = [iteration_time(mode, p=p, link=LINK, **args) for p in ps]
    assert all(b >= a - 1e-12 for a, b in zip(times, times[1:]))
    bws = (1e8, 1e9, 1e10, 1e11)
    times = [
        iteration_time(mode, p=8, link=LinkModel.from_bandwidth(50e-6, bw, 1e-10), **args)
        for bw in bws
    ]
    assert all(b <= a + 1e-12 for a, b in zip(times, times[1:]))
    assert times[0] > times[-1]


def test_compression_ratio():
    assert compression_ratio(None) == 1.0
    assert compression_ratio("fp16") == 2.0
    assert compression_ratio("bf16") == 2.0
    assert compression_ratio("fp16", itemsize=8) == 4.0
    assert compression_ratio("fp16", itemsize=2) == 1.0
    assert compression_ratio("int8", chunk=None) == 4.0
    # compress.Int8Codec's default: 256 one-byte codes + one float32 scale replace 1024 bytes
    assert compression_ratio("int8") == pytest.approx(1024 / 260)
    # 1024 one-byte codes + one 4-byte scale replace 4096 bytes
    assert compression_ratio("int8", chunk=1024) == pytest.approx(4096 / 1028)
    assert compression_ratio("int8", chunk=1024, scale_bytes=8) == pytest.approx(4096 / 1032)
    assert compression_ratio(3.5) == 3.5
    with pytest.raises(ValueError, match="compression"):
        compression_ratio("int4")
    with pytest.raises(ValueError, match="chunk"):
        compression_ratio("int8", chunk=0)
    with pytest.raises(ValueError, match=">= 1"):
        compression_ratio(0.5)
    with pytest.raises(ValueError, match="itemsize"):
        compression_ratio("fp16", itemsize=1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        iteration_time("async", **kw())
    with pytest.raises(ValueError, match="compute_s"):
        iteration_time("sync", **kw(compute_s=-1.0))
    with pytest.raises(TypeError, match="update_s"):
        iteration_time("sync", **kw(update_s="fast"))
    with pytest.raises(ValueError, match="compute_s"):
        iteration_time("sync", **kw(compute_s=math.nan))
    with pytest.raises(ValueError, match="staleness"):
        iteration_time("sync", staleness=1, **kw())
    with pytest.raises(ValueError, match="staleness"):
        iteration_time("pipe", staleness=-1, **kw())
    with pytest.raises(TypeError, match="staleness"):
        iteration_time("pipe", staleness=1.5, **kw())
    with pytest.raises(ValueError, match="backward_fraction"):
        iteration_time("layerwise", backward_fraction=1.5, **kw())
    with pytest.raises(ValueError, match="buckets"):
        iteration_time("layerwise", buckets=0, **kw())
    with pytest.raises(ValueError, match="compression"):
        iteration_time("sync", algorithm="be", compression="fp16", **kw())
    with pytest.raises(ValueError, match="torch"):
        iteration_time("sync", algorithm="torch", **kw())
    with pytest.raises(TypeError, match="LinkModel"):
        iteration_time("sync", **kw(link=(1e-3, 1e-9)))
    with pytest.raises(ValueError, match="zero"):
        speedup("pipe", **kw(compute_s=0.0, nbytes=0))
