"""E1 (analytic LP cost model): table contents against hand-computed formulas, the claims at the
defaults, parameter checks, and the claims' synthetic PASS / FAIL cases."""

import functools
import math

import pandas as pd
import pytest

from pipecomm import claims
from pipecomm.experiments import e01_lp_cost_model as e1

SMALL = {"sizes_min": 1024, "sizes_max": 1 << 20, "world_sizes": [2, 64]}
CLAIM_ARGS = {
    "e1_lp_invariant_mst_log": {
        "nbytes": 1 << 28,
        "p_lo": 2,
        "p_hi": 64,
        "lp_max_growth": 1.5,
        "mst_min_growth": 5.0,
        "alpha_s": 1e-5,
        "bandwidth_Bps": 1e10,
        "ports": "single",
    },
    "e1_be_over_lp": {
        "nbytes": 1 << 28,
        "p": 64,
        "min_ratio": 1.4,
        "alpha_s": 1e-5,
        "bandwidth_Bps": 1e10,
        "ports": "single",
    },
}


@functools.lru_cache(maxsize=1)
def _table() -> pd.DataFrame:
    return e1.run(**SMALL)


def _passing() -> pd.DataFrame:
    return _table().copy()


def _failing() -> pd.DataFrame:
    """LP twice as slow at p = 64: it grows 2.65x and BE/LP drops to 0.74."""
    df = _passing()
    slow = (df.algorithm == "lp") & (df.world_size == 64)
    df.loc[slow, "time_s"] *= 2
    return df


CLAIM_CASES = {
    "e1_lp_invariant_mst_log": (_passing, _failing),
    "e1_be_over_lp": (_passing, _failing),
}


@pytest.fixture(scope="module")
def table():
    return _passing()


def test_columns_and_sweeps(table):
    for col in (
        "backend",
        "world_size",
        "network",
        "sweep",
        "op",
        "algorithm",
        "nbytes",
        "ports",
        "time_s",
        "block_bytes",
        "analytic_block_bytes",
    ):
        assert col in table.columns
    assert set(table.sweep) == {"size", "ranks"}
    assert set(table.op) == {"broadcast", "reduce", "allreduce"}
    assert set(table.ports) == {"single", "per-neighbor"}
    assert (table.backend == "model").all()
    assert table.network.str.startswith("analytic model").all()
    assert table.block_bytes[table.algorithm != "lp"].isna().all()
    assert table.block_bytes[table.algorithm == "lp"].notna().all()


def test_times_match_hand_computed_formulas(table):
    a, beta = 10e-6, 1e-10
    n, p = 1 << 28, 64
    r = table[
        (table.sweep == "ranks")
        & (table.op == "broadcast")
        & (table.world_size == p)
        & (table.ports == "single")
    ].set_index("algorithm")
    assert r.loc["mst", "time_s"] == pytest.approx(6 * (a + n * beta))
    assert r.loc["be", "time_s"] == pytest.approx(2 * 6 * a + 2 * 63 / 64 * n * beta)
    b = int(r.loc["lp", "block_bytes"])
    k = math.ceil(n / b)
    assert r.loc["lp", "time_s"] == pytest.approx((k + p - 2) * a + (n + (p - 2) * b) * beta)
    # the paper's continuous optimum k* = sqrt((p - 2) n beta / alpha)
    k_star = math.sqrt((p - 2) * n * beta / a)
    assert n / r.loc["lp", "analytic_block_bytes"] == pytest.approx(k_star)
    assert abs(k - k_star) / k_star < 0.05


def test_port_model_changes_only_lp_allreduce(table):
    piv = table.pivot_table(
        index=["sweep", "op", "algorithm", "nbytes", "world_size"], columns="ports", values="time_s"
    )
    differs = piv[~(piv["single"] - piv["per-neighbor"]).abs().le(1e-15)]
    assert set(differs.index.get_level_values("op")) == {"allreduce"}
    assert set(differs.index.get_level_values("algorithm")) == {"lp"}


def test_claims_pass_at_the_defaults():
    df = e1.run(sizes_max=1 << 20)  # the ranks sweep is the defaults'
    for name, args in CLAIM_ARGS.items():
        v = claims.CHECKS[name](df, **args)
        assert v.passed, v
    v = e1.check_lp_invariant(df, **CLAIM_ARGS["e1_lp_invariant_mst_log"])
    assert "x1.327" in v.measured and "x6.00" in v.measured
    assert "1.487" in e1.check_be_over_lp(df, **CLAIM_ARGS["e1_be_over_lp"]).measured


def test_claim_cases_pass_and_fail():
    for name, (good, bad) in CLAIM_CASES.items():
        assert claims.CHECKS[name](good(), **CLAIM_ARGS[name]).passed
        assert not claims.CHECKS[name](bad(), **CLAIM_ARGS[name]).passed


def test_checks_refuse_other_links(table):
    with pytest.raises(ValueError, match="no modelled broadcast"):
        e1.check_be_over_lp(table, alpha_s=1e-3)


@pytest.mark.parametrize(
    "bad",
    [
        {"ops": ["gather"]},
        {"algorithms": ["torch"]},
        {"ports": "single"},
        {"world_sizes": [0, 2]},
        {"bandwidth_Bps": 0.0},
        {"alpha_s": -1.0},
        {"ranks_sweep_bytes": 0},
        {"size_factor": 1},
        {"no_such_parameter": 1},
    ],
)
def test_bad_parameters(bad):
    with pytest.raises(ValueError):
        e1.run(**{**SMALL, **bad})


def test_summary_and_plot(table):
    s = e1.summary(table)
    assert {"lp ms", "mst/lp", "be/lp", "lp block KiB"} <= set(s.columns)
    fig = e1.plot(table)
    assert "analytic model" in fig._suptitle.get_text()
    import matplotlib.pyplot as plt

    plt.close(fig)
