"""E1 (analytic LP cost model): table contents against hand-computed formulas and parameter
checks (E1 decides no claim: C1.* are model illustrations)."""

import functools
import math

import pandas as pd
import pytest

from pipecomm.lab.experiments import e01_lp_cost_model as e1

SMALL = {"sizes_min": 1024, "sizes_max": 1 << 20, "world_sizes": [2, 64]}
TINY = SMALL  # what its notebook runs (tests/test_notebooks.py): an analytic table, in ms


@functools.lru_cache(maxsize=1)
def _table() -> pd.DataFrame:
    return e1.run(**SMALL)


@pytest.fixture(scope="module")
def table():
    return _table()


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


def test_notebook_writes_the_same_table(notebook_run, tmp_path):
    from pipecomm.lab import results

    run = notebook_run(e1, TINY)
    results.write_csv(tmp_path / "direct.csv", _table())
    pd.testing.assert_frame_equal(run.df, results.load_csv(tmp_path / "direct.csv"))
