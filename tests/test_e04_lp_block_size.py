"""E4 (LP block size): the block grid, the best-block table, one tiny end-to-end run on an
emulated network, and the claims' synthetic PASS / FAIL cases."""

import numpy as np
import pandas as pd
import pytest
from claimdata import with_repeats

from pipecomm.lab import claims
from pipecomm.lab.experiments import e04_lp_block_size as e4
from pipecomm.lab.networks import cost

CLAIM_ARGS = {
    "e4_best_block_near_model": {"op": "broadcast", "factor": 2.0},
    "e4_off_optimum_penalty": {"op": "broadcast", "tolerance": 0.1},
}
PROFILE = {
    "world_size": 8,
    "nbytes": 4 << 20,
    "emu_alpha_s": 2e-3,
    "emu_bandwidth_Bps": 50e6,
    "ops": ["broadcast", "allreduce"],
    "iters": 3,
}


def _synthetic(best_at=None, flat=False, off_cost=1.05, spread=0.01) -> pd.DataFrame:
    """The cpu profile's plan with the overlapped model as 'measurement' (x 1.05)."""
    df = e4.plan(**PROFILE)
    df["time_s"] = df.model_s * 1.05
    if best_at is not None:  # a minimum far from the model's
        m = np.isclose(df.block_factor, best_at)
        df.loc[m, "time_s"] = df.time_s.min() * 0.5
    if flat:  # blocks 8x off cost only 5% more
        for f in (0.125, 8.0):
            for op in set(df.op):
                at1 = df[(df.op == op) & np.isclose(df.block_factor, 1.0)].time_s.iloc[0]
                df.loc[(df.op == op) & np.isclose(df.block_factor, f), "time_s"] = at1 * off_cost
    df = with_repeats(df, spread)
    return df.assign(
        algorithm="lp",
        nbytes=4 << 20,
        world_size=8,
        ports="single",
        backend="gloo",
        network="emulated, single-port, 2.0 ms / 50 MB/s",
        emu_alpha_s=2e-3,
        emu_bandwidth_Bps=50e6,
        model_gamma_s_per_byte=1e-9,
        model_host_block_s=e4.host_block_s(),
    )


CLAIM_CASES = {
    "e4_best_block_near_model": (_synthetic, lambda: _synthetic(best_at=4.0),
                                 lambda: _synthetic(spread=0.5)),
    # the model's 8x penalties are about 1.47x (bound x 0.9 / 1.1 = 1.2x)
    "e4_off_optimum_penalty": (_synthetic, lambda: _synthetic(flat=True),
                               lambda: _synthetic(flat=True, off_cost=1.2, spread=0.2)),
}


def test_claim_cases():
    want = (claims.PASS, claims.FAIL, claims.INCONCLUSIVE)
    for name, makers in CLAIM_CASES.items():
        for make, verdict in zip(makers, want):
            v = claims.CHECKS[name](make(), **CLAIM_ARGS[name])
            assert v.verdict == verdict, (name, verdict, v)
    v = e4.check_penalty(_synthetic(), **CLAIM_ARGS["e4_off_optimum_penalty"])
    h = e4.host_block_s()
    link = cost.LinkModel.from_bandwidth(2e-3, 50e6, gamma=1e-9)
    b = e4.optimum("broadcast", 4 << 20, 8, link, h)
    model = (cost.lp_overlapped_time("broadcast", 4 << 20, 8, link, round(b / 64) * 8, h)
             / cost.lp_overlapped_time("broadcast", 4 << 20, 8, link, b, h))
    assert f"8x smaller x{model:.3g}" in v.measured
    assert f"(model x{model:.2f}, bound x{model * 0.9 / 1.1:.2f})" in v.measured


def test_block_grid():
    assert e4.block_grid(1024, 1 << 20, 2.0, 1) == [(0.5, 512), (1.0, 1024), (2.0, 2048)]
    g = e4.block_grid(262144, 4 << 20, 8.0, 2)
    assert len(g) == 13
    blocks = dict(g)
    assert blocks[0.125] == 32768 and blocks[1.0] == 262144 and blocks[8.0] == 2097152
    assert all(b % 8 == 0 for _, b in g)
    # capped at the message, duplicates dropped
    assert e4.block_grid(1024, 2048, 8.0, 1)[-1] == (2.0, 2048)
    assert e4.block_grid(4, 1 << 20, 2.0, 1)[0] == (0.5, 8)


def test_optimum_is_the_cost_models():
    link = cost.LinkModel.from_bandwidth(2e-3, 50e6)
    assert e4.optimum("broadcast", 4 << 20, 8, link, 124e-6) == 65536  # overlapped, k* = 64
    pl = e4.plan(**PROFILE)
    assert (pl.lockstep_block_bytes[pl.op == "broadcast"] == 262144).all()  # the paper's k* = 16
    for _op, g in pl.groupby("op"):
        assert g.loc[g.model_s.idxmin(), "block_factor"] == 1.0


def test_best_blocks_table():
    b = e4.best_blocks(_synthetic())
    assert b.loc["broadcast", "best_over_optimum"] == 1.0
    assert b.loc["allreduce", "cost_8x_smaller"] > 0.15
    b = e4.best_blocks(_synthetic(best_at=4.0))
    assert b.loc["broadcast", "best_over_optimum"] == pytest.approx(4.0, rel=0.01)


def test_expected_runtime_of_the_profile():
    # broadcast and allreduce, 3 calls a point; the cpu profile's broadcast alone: about 20 s
    assert 10 < e4.expected_runtime_s(**PROFILE)["emulated_s"] < 30


@pytest.mark.parametrize(
    "bad",
    [
        {"world_size": 2},
        {"ops": ["gather"]},
        {"ops": []},
        {"block_range": 0.5},
        {"steps_per_octave": 0},
        {"ports": "x"},
        {"nbytes": 8},
        {"nope": 1},
    ],
)
def test_bad_parameters(bad):
    with pytest.raises(ValueError):
        e4.run(**bad)


#: the tiny run: its notebook executes it once (tests/test_notebooks.py shares the run)
TINY = dict(
    world_size=3,
    nbytes=262144,
    emu_alpha_s=1e-4,
    emu_bandwidth_Bps=1e8,
    block_range=2.0,
    steps_per_octave=1,
    iters=1,
    warmup=0,
    timeout_s=120.0,
)
TINY_ENV = {"PIPECOMM_SKIP_HOST_CHECK": "1"}  # fast links: plumbing, not timing


def test_run_tiny_end_to_end(notebook_run):
    df = notebook_run(e4, TINY, TINY_ENV).df
    assert list(df.block_factor) == [0.5, 1.0, 2.0]
    for col in ("backend", "world_size", "network", "time_s", "model_s", "block_bytes"):
        assert col in df.columns
    assert (df.time_s > 0).all()
    with pytest.raises(ValueError, match="block_range >= 8"):
        e4.check_penalty(df, "broadcast", 0.25)
    s = e4.summary(df)
    assert len(s) == 3
    fig = e4.plot(df)
    import matplotlib.pyplot as plt

    plt.close(fig)
