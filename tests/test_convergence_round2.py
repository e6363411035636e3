"""E7 round two (issue 45; C7.2b, C7.3b): the selection rules on synthetic loss tables, the
signed-rank test's wiring, the checks' PASS / FAIL / INCONCLUSIVE on synthetic data, and a tiny
run of every arm on the generated teacher task."""

import math

import numpy as np
import pandas as pd
import pytest

from pipecomm.lab import claims
from pipecomm.lab.experiments import e07_pipesgd_convergence as e7
from pipecomm.lab.measure import stats
from pipecomm.lab.training import tuning

METHODS = ("sync", "pipe", "pipe+fp16", "pipe+int8")
CURVE = [0.3, 0.8, 0.999, 0.9992, 0.9995, 1.0]  # levelled off: the last 3 evaluations add 0.1%
LIMIT = math.log(10)


# --------------------------------------------------------------------------- selection rules


def _table(table):
    calls = []

    def run(lr, m):
        calls.append((m, lr))
        return table[(m, lr)]

    return run, calls


def test_median_rule_ignores_one_diverged_seed_in_three_the_mean_does_not():
    nan = float("nan")
    table = {(0.0, 0.01): [1.2, 1.2, 1.2], (0.0, 0.02): [1.0, 1.0, nan],
             (0.0, 0.04): [1.1, 1.1, 1.1], (0.0, 0.08): [1.3, 1.3, 1.3]}
    run, _ = _table(table)
    med = tuning.select_rate_momentum(run, [0.01, 0.02, 0.04], [0.0], "median", 1, LIMIT)
    assert (med.rate, med.gap) == (0.02, None)
    mean = tuning.select_rate_momentum(run, [0.01, 0.02, 0.04], [0.0], "mean", 1, LIMIT)
    assert mean.rate == 0.04  # the NaN makes 0.02 worse than any number
    # two of three diverged (a loss at chance counts as diverged): the median is inf
    assert tuning.rule_score([1.0, 2.31, nan], "median", LIMIT) == math.inf


def test_stable_rule_takes_the_largest_rate_no_seed_diverged_on():
    table = {(0.5, 0.01): [1.3, 1.3], (0.5, 0.02): [1.2, 1.1], (0.5, 0.04): [0.9, 2.4],
             (0.5, 0.08): [9.0, 9.0], (0.5, 0.005): [1.5, 1.5]}
    run, calls = _table(table)
    sel = tuning.select_rate_momentum(run, [0.01, 0.02, 0.04], [0.5], "stable", 2, LIMIT)
    assert (sel.rate, sel.momentum, sel.gap) == (0.02, 0.5, None)
    assert (0.5, 0.08) not in calls  # 0.04 diverged on a seed: the choice is inside the grid
    # every rate diverges somewhere: the smallest, with the reason
    bad = {(0.0, r): [1.0, 3.0] for r in (0.0025, 0.005, 0.01, 0.02)}
    run, _ = _table(bad)
    sel = tuning.select_rate_momentum(run, [0.01, 0.02], [0.0], "stable", 2, LIMIT)
    assert sel.rate == 0.0025 and "every rate tried diverged" in sel.gap


def test_ties_go_to_the_smaller_momentum_then_the_smaller_rate_and_edges_extend():
    table = {(m, r): [1.0, 1.0] for m in (0.0, 0.9) for r in (0.01, 0.02, 0.04, 0.005)}
    run, _ = _table(table)
    sel = tuning.select_rate_momentum(run, [0.01, 0.02, 0.04], [0.9, 0.0], "median", 1, LIMIT)
    assert (sel.momentum, sel.rate) == (0.0, 0.005)  # tie: smallest rate, extended down once
    assert sel.gap and "edge" in sel.gap
    # the momentum whose rate scores lower wins
    table = {(m, r): [1.0 + abs(r - 0.02) * 10 + (0.2 if m == 0.0 else 0.0)] * 2
             for m in (0.0, 0.5) for r in (0.01, 0.02, 0.04)}
    run, _ = _table(table)
    sel = tuning.select_rate_momentum(run, [0.01, 0.02, 0.04], [0.0, 0.5], "median", 0, LIMIT)
    assert (sel.momentum, sel.rate, sel.gap) == (0.5, 0.02, None)
    assert len(sel.losses) == 6
    for bad in ("best", "MEDIAN"):
        with pytest.raises(ValueError, match="rule"):
            tuning.select_rate_momentum(run, [0.01, 0.02], [0.0], bad)
    with pytest.raises(ValueError, match="momenta"):
        tuning.select_rate_momentum(run, [0.01, 0.02], [], "median")


# --------------------------------------------------------------------------- the rank test


def test_signed_rank_wiring():
    d = np.array([0.1, -0.2, 0.15, -0.05, 0.3, -0.1, 0.2, 0.05, -0.15, 0.25])
    assert stats.signed_rank_p(d, -1.0, "greater") == pytest.approx(1 / 1024)
    assert stats.signed_rank_p(d, 1.0, "less") == pytest.approx(1 / 1024)
    assert stats.signed_rank_p(d, 1.0, "greater") > 0.9
    assert stats.signed_rank_p([1.0, 1.0], 1.0) == 1.0  # no difference from the shift
    assert e7._rank_within(d, 1.0)[0] == claims.PASS
    assert e7._rank_within(d - 3.0, 1.0)[0] == claims.FAIL
    assert e7._rank_within(np.array([0.1, -0.2, 0.3]), 1.0)[0] == claims.INCONCLUSIVE  # p >= 1/8
    assert e7._agree(claims.FAIL, claims.INCONCLUSIVE, "pipe") == claims.INCONCLUSIVE
    with pytest.raises(ValueError, match="alternative"):
        stats.signed_rank_p(d, 0.0, "two-sided")


# --------------------------------------------------------------------------- the checks


SPREAD = np.array([0.1, -0.2, 0.15, -0.05, 0.3, -0.1, 0.2, 0.05, -0.15, 0.25])


def _evals(method, seed, acc, lr, mom, selection):
    return [{"kind": "eval", "method": method, "seed": seed, "iteration": (i + 1) * 100,
             "accuracy": acc * f, "final": i == len(CURVE) - 1, "lr_peak": lr, "momentum": mom,
             "selection": selection, "wall_s": float(i)} for i, f in enumerate(CURVE)]


def r2(diffs=None, n_seeds=10, n_sets=3, stale=None, swept=True, control_lr=0.2):
    """Synthetic round-two data: per selection, every method's final accuracy sync + ``diffs[m]``
    (a per-seed array, or per selection a list of them); sweeps over 3 momenta x 3 rates, the
    choice (0.05, 0.5) inside; the controls at ``control_lr`` with pipe@1x - sync@1x =
    ``stale``."""
    diffs = diffs or {}
    rows = []
    sync = 70.0 + np.arange(n_seeds) * 0.7
    for k in range(n_sets):
        for m in METHODS:
            d = diffs.get(m, SPREAD[:n_seeds] * 0.5 if m != "sync" else np.zeros(n_seeds))
            d = d[k] if isinstance(d, list) else d
            for s in range(n_seeds):
                rows += _evals(m, s, sync[s] + (0 if m == "sync" else d[s]), 0.05, 0.5, k)
            if swept:
                rows += [{"kind": "sweep", "method": m, "selection": k, "seed": 100 + 2 * k + j,
                          "lr_peak": lr, "momentum": mom,
                          "val_loss": 1 + abs(lr - 0.05) + abs(mom - 0.5),
                          "selected": lr == 0.05 and mom == 0.5}
                         for j in range(2) for lr in (0.025, 0.05, 0.1) for mom in (0, 0.5, 0.9)]
    st = np.full(n_seeds, -12.0) + SPREAD[:n_seeds] if stale is None else stale
    for s in range(n_seeds):
        rows += _evals("sync@1x", s, sync[s], control_lr, 0.9, np.nan)
        rows += _evals("pipe@1x", s, sync[s] + st[s], control_lr, 0.9, np.nan)
    return pd.DataFrame(rows)


ARGS = {"max_points": 1.0, "methods": ["pipe", "pipe+fp16", "pipe+int8"], "tail": 0.1,
        "min_lrs": 3, "min_momenta": 3, "min_selections": 3, "min_seeds": 10}

CLAIM_CASES = {
    # within +-0.15 point on every selection: PASS; about -3: FAIL; about -1 +- 0.5: straddles
    "e7_accuracy_within_ranked": (lambda: r2(), lambda: r2({"pipe+int8": SPREAD - 3.0}),
                                  lambda: r2({"pipe": SPREAD * 2 - 1.0})),
    # pipe@1x - sync@1x about -12: PASS; about +0.1 (staleness did not hurt): FAIL; about -1
    "e7_stale_hurts_ranked": (lambda: r2(), lambda: r2(stale=SPREAD * 0.5),
                              lambda: r2(stale=SPREAD * 2 - 1.0)),
}


def test_accuracy_claim_reports_every_selection_and_needs_them_to_agree():
    v = e7.accuracy_within_ranked(r2(), **ARGS)
    assert v.verdict == claims.PASS
    assert all(f"selection {k}" in v.measured for k in range(3)) and "signed-rank p" in v.measured
    # selection 2's choice of pipe+int8 lost 3 points, the others did not: undecided
    mixed = r2({"pipe+int8": [SPREAD * 0.5, SPREAD * 0.5, SPREAD - 3.0]})
    v = e7.accuracy_within_ranked(mixed, **ARGS)
    assert v.verdict == claims.INCONCLUSIVE and "selections disagree" in v.reason
    assert "-> FAIL" in v.measured and "-> PASS" in v.measured


def test_accuracy_claim_gates_close_in_the_quick_profile():
    """The cpu profile: one selection, 3 seeds, no sweep: INCONCLUSIVE with each reason."""
    quick = r2(n_seeds=3, n_sets=1, swept=False)
    v = e7.accuracy_within_ranked(quick, **ARGS)
    assert v.verdict == claims.INCONCLUSIVE
    for why in ("1 selection(s)", "3 paired evaluation seed(s), need >= 10",
                "0 momentum value(s) tried", "0 learning rate(s) swept"):
        assert why in v.measured or why in v.reason, why
    # an edge choice and a rising sync each close the gate too
    edge = r2()
    edge.loc[(edge["kind"] == "eval") & (edge["method"] == "pipe"), "lr_peak"] = 0.1
    assert "at the edge" in e7.accuracy_within_ranked(edge, **ARGS).measured
    rising = r2()
    ev = (rising["kind"] == "eval") & (rising["method"] == "sync") & (rising["iteration"] == 300)
    rising.loc[ev, "accuracy"] -= 5.0
    v = e7.accuracy_within_ranked(rising, **ARGS)
    assert v.verdict == claims.INCONCLUSIVE and "not converged" in v.measured


def test_control_is_gated_on_its_stated_rate_and_on_its_arms():
    args = {"method": "pipe@1x", "reference": "sync@1x", "min_points": 1.0, "tail": 0.1,
            "stress_lr": 0.2, "momentum": 0.9, "min_seeds": 10}
    assert e7.stale_hurts_ranked(r2(), **args).verdict == claims.PASS
    v = e7.stale_hurts_ranked(r2(control_lr=0.4), **args)
    assert v.verdict == claims.INCONCLUSIVE and "the claim states 0.2" in v.measured
    quick = r2()
    quick = quick[~quick["method"].str.contains("@")]  # the cpu profile trains @4x controls
    v = e7.stale_hurts_ranked(quick, **args)
    assert v.verdict == claims.INCONCLUSIVE and "pipe@1x: not trained" in v.measured


# --------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("bad", [{"momenta": [0.0, 1.0]}, {"momenta": [0.5, 0.5]},
                                 {"selection_sets": 3}, {"selection_sets": 0},
                                 {"selection_rule": "best"}, {"control_lr": -0.1},
                                 {"control_lr": float("nan")}])
def test_bad_round_two_parameters_name_the_parameter(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        e7.Params.make(**bad)


def test_defaults_keep_round_one():
    p = e7.Params.make()
    assert (p.momenta, p.selection_sets, p.selection_rule, p.control_lr) == ([], 1, "mean", 0.0)
    assert e7.arms(p, {(m, 0): (0.01, 0.0) for m in METHODS}) == {
        m: (m, 0.01, 0.0, [0]) for m in METHODS}


# --------------------------------------------------------------------------- a tiny run


TINY_R2 = dict(
    dataset="teacher",
    seeds=[0],
    methods=["sync", "pipe", "pipe@1x"],
    timing_methods=["sync", "pipe"],
    timing_runs=0,
    iterations=4,
    eval_every=2,
    skip=1,
    model="mlp",
    model_kw={"hidden": [16]},
    batch_size=8,
    lrs=[0.05, 0.1],
    max_extend=0,
    momenta=[0.0, 0.9],
    selection_seeds=[100, 101],
    selection_sets=2,
    selection_rule="median",
    control_lr=0.2,
    momentum=0.9,
    bandwidth_Bps=1e9,
    alpha_s=1e-4,
    calib_iters=2,
    timeout_s=120.0,
)


def test_tiny_round_two_run_trains_every_arm():
    df = e7.run(**TINY_R2)
    sweep = df[df["kind"] == "sweep"]
    # 2 methods x 2 sets x 2 momenta x 2 rates, one seed per set
    assert len(sweep) == 16 and set(sweep["selection"]) == {0, 1}
    assert set(sweep["momentum"]) == {0.0, 0.9} and sweep["diverged"].isin([True, False]).all()
    ev = df[df["kind"] == "eval"]
    assert set(ev["method"]) == {"sync", "pipe", "pipe@1x"}
    ctrl = ev[ev["method"] == "pipe@1x"]
    assert ctrl["selection"].isna().all() and np.allclose(ctrl["lr_peak"], 0.2)
    assert (ctrl["momentum"] == 0.9).all()
    for k in (0, 1):  # each selection's arms, at what it chose
        sub = e7.under_selection(df, k)
        fin = e7.final_accuracy(sub).drop_duplicates(["method", "seed"])
        assert set(fin["method"]) == {"sync", "pipe", "pipe@1x"}
    assert len(e7.choice_table(df)) >= 4 and not e7.sweep_table(df).empty
    v = e7.accuracy_within_ranked(df, 1.0, ["pipe"], 0.1, 3, 3, 3, 10)
    assert v.verdict == claims.INCONCLUSIVE and "selection(s)" in v.measured
    assert e7.summary(df)["method"].tolist()
