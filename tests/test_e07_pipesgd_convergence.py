"""E7 Pipe-SGD convergence (and the shared training helpers of E5-E9): claims' synthetic PASS /
FAIL cases, helpers against hand-computed values, a tiny run."""

import dataclasses
import pickle

import numpy as np
import pandas as pd
import pytest
import torch
from test_convergence_round2 import CLAIM_CASES as ROUND_TWO_CASES

from pipecomm.lab.experiments import e07_pipesgd_convergence as e7
from pipecomm.lab.networks import cost
from pipecomm.lab.networks.kinds import choose_bandwidth
from pipecomm.lab.training.pipesgd_analysis import first_reach, per_iteration, steady
from pipecomm.lab.training.pipesgd_config import TrainConfig, config, lr_scale, parse_method
from pipecomm.lab.training.pipesgd_training import eval_rows, iteration_rows
from pipecomm.lab.workloads import schedules

METHODS = ("sync", "pipe", "pipe+fp16", "pipe+int8")


def _timings(t_ms, iterations, noise, comm, rng, level):
    timings = []
    for t in range(iterations):
        it = t_ms / 1e3 * level * (1 + noise * rng.standard_normal())
        c = it * comm
        timings.append({"iteration": t, "updates": 1, "compute_s": it - c - 0.001,
                        "launch_s": 0.0002, "comm_s": c, "compress_s": 0.0,
                        "update_s": 0.0008, "iter_s": it})
    return timings


def fake_training(
    ms, final_acc, seeds=(0, 1, 2), iterations=12, ranks=2, comm_frac=None, acc_curve=None,
    noise=0.02, repeats=1, timing_runs=0, calibration=None,
):
    """Synthetic E7-E9 data: per method ``ms[method]`` ms per iteration (``comm_frac`` of it
    blocked on communication), final accuracy ``final_acc[method][seed]``; every (seed, method)
    trained ``repeats`` times (``run`` = seed index * repeats + round), and ``timing_runs``
    separate timing runs per method (rows ``kind="timing"``). Each run draws its own level
    (relative spread ``noise``), each iteration its own noise around it."""
    comm_frac = comm_frac or {}
    rng = np.random.default_rng(1)
    rows = [
        {
            "kind": "calibration",
            "compute_s": 0.016,
            "update_s": 0.0005,
            "nbytes": 830_000,
            "comm_ratio_model": 1.0,
            "model_comm_s": 0.0165,
            "model_nocomm_s": 0.0165,
            "model_sync_s": 0.033,
            "model_layerwise_s": 0.03,
            "model_pipe_s": 0.0165,
            "model_pipe_fp16_s": 0.0165,
            "model_pipe_int8_s": 0.0165,
            **(calibration or {}),
        }
    ]

    def runs_of(m, t_ms, evaluate, seed):
        level = 1 + noise * rng.standard_normal()  # the run's own level, shared by its ranks
        per_rank = []
        for r in range(ranks):
            evals = []
            if r == 0 and evaluate:
                acc = final_acc.get(m, {}).get(seed, 80.0)
                curve = acc_curve or [0.3, 0.8, 0.95, 1.0]
                for k, f in enumerate(curve):
                    evals.append(
                        {
                            "iteration": (k + 1) * iterations // len(curve),
                            "wall_s": (k + 1) * iterations * t_ms / 1e3 / len(curve),
                            "accuracy": acc * f,
                            "test_loss": 1.0,
                            "final": k == len(curve) - 1,
                        }
                    )
            per_rank.append({"timings": _timings(t_ms, iterations, noise, comm_frac.get(m, 0.0),
                                                 rng, level),
                             "losses": [1.0] * iterations, "evals": evals})
        return per_rank

    for run in range(timing_runs):
        for m, t_ms in ms.items():
            per_rank = runs_of(m, t_ms, False, seeds[0])
            rows += iteration_rows(per_rank, kind="timing", method=m, seed=seeds[0], run=run)
    for i, seed in enumerate(seeds):
        for rep in range(repeats):
            for m, t_ms in ms.items():
                per_rank = runs_of(m, t_ms, rep == 0, seed)
                run = i * repeats + rep
                rows += iteration_rows(per_rank, method=m, seed=seed, run=run)
                if rep == 0:
                    rows += eval_rows(per_rank, method=m, seed=seed, run=run)
    return pd.DataFrame(rows).assign(
        backend="gloo",
        world_size=ranks,
        network="emulated",
        bandwidth_Bps=60e6,
        skip=2,
        algorithm="ring",
        target_fraction=0.95,
        target_acc=70.0,
    )


CONVERGED = [0.3, 0.8, 0.999, 0.9992, 0.9995, 1.0]  # the last 3 evaluations add 0.1%


RATES = (0.01, 0.02, 0.04)  # the synthetic selection: every method chose 0.02


def _swept(df, rates=RATES, chosen=0.02):
    """``df`` with a rate selection: rows ``kind="sweep"`` per method and rate, and the eval rows'
    peak rate the chosen one (4x it for the ``@4x`` controls)."""
    df = df.copy()
    ev = df["kind"] == "eval"
    df.loc[ev, "lr_peak"] = [chosen * 4 if "@" in m else chosen for m in df.loc[ev, "method"]]
    sweep = [{"kind": "sweep", "method": m, "seed": s, "lr_peak": lr, "val_loss": 1 + abs(lr - chosen),
              "val_accuracy": 90.0, "selected": lr == chosen, "sweep_gap": ""}
             for m in METHODS for s in (100, 101) for lr in rates]
    return pd.concat([df, pd.DataFrame(sweep)], ignore_index=True)


def _e7(pipe_ms=18.0, int8_acc=None, noise=0.02, stale_acc=None, acc_curve=CONVERGED,
        timing_runs=5):
    acc = {m: {0: 80.0, 1: 75.0, 2: 82.0} for m in METHODS}
    acc["pipe"] = {0: 80.1, 1: 74.9, 2: 82.1}
    acc["sync@4x"] = {0: 82.0, 1: 80.0, 2: 83.0}
    acc["pipe@4x"] = stale_acc or {0: 60.0, 1: 50.0, 2: 40.0}
    if int8_acc is not None:
        acc["pipe+int8"] = int8_acc
    ms = {"sync": 33.0, "pipe": pipe_ms, "pipe+fp16": 18.5, "pipe+int8": 19.0, "sync@4x": 33.0,
          "pipe@4x": 18.0}
    if pipe_ms != 18.0:  # every pipelined method at pipe's time (C7.1, C7.4, C7.5 alike)
        ms.update({"pipe+fp16": pipe_ms, "pipe+int8": pipe_ms})
    return _swept(fake_training(ms, acc, comm_frac={"sync": 0.5}, acc_curve=acc_curve,
                                noise=noise, timing_runs=timing_runs))


CLAIM_CASES = {
    # model speedup 2.0, bound 2.0 x 0.75 / 1.25 = 1.2: 33 / 18 = 1.83 passes, 33 / 33 fails,
    # 33 / 27.5 = 1.2 with runs 30% apart cannot be told
    "e7_pipe_speedup": (lambda: _e7(), lambda: _e7(pipe_ms=33.0),
                        lambda: _e7(pipe_ms=27.5, noise=0.3)),
    # paired differences of -5, -5, -4 points fail; -2, -2, -1 cannot be told from +-1 point
    "e7_accuracy_within": (lambda: _e7(), lambda: _e7(int8_acc={0: 75.0, 1: 70.0, 2: 78.0}),
                           lambda: _e7(int8_acc={0: 78.0, 1: 73.0, 2: 81.0})),
    # pipe@4x - sync@4x: -22, -30, -43 pass (< -1); +0.2, +0.1, +0.3 fail (staleness did not
    # hurt); -1.5, -0.2, -2.5 straddle -1
    "e7_stale_hurts": (lambda: _e7(), lambda: _e7(stale_acc={0: 82.2, 1: 80.1, 2: 83.3}),
                       lambda: _e7(stale_acc={0: 80.5, 1: 79.8, 2: 80.5})),
}
CLAIM_CASES.update(ROUND_TWO_CASES)  # round two's checks (C7.2b, C7.3b): tests/test_convergence_round2.py


def test_accuracy_claims_wait_for_convergence():
    """The same final accuracies, but sync still rising by 8 points over the last steps: neither
    a PASS nor a FAIL can be trusted, the gate makes both INCONCLUSIVE and says why."""
    rising = [0.3, 0.8, 0.9, 0.95, 0.97, 1.0]
    v = e7.check_accuracy_within(_e7(acc_curve=rising), 1.0, ["pipe"], 0.1, 3)
    assert v.verdict == "INCONCLUSIVE" and "not converged" in v.measured
    assert e7.check_accuracy_within(_e7(), 1.0, ["pipe"], 0.1, 3).verdict == "PASS"
    bad = _e7(int8_acc={0: 75.0, 1: 70.0, 2: 78.0}, acc_curve=rising)
    assert e7.check_accuracy_within(bad, 1.0, ["pipe+int8"], 0.1, 3).verdict == "INCONCLUSIVE"
    v = e7.check_stale_hurts(_e7(acc_curve=rising), "pipe@4x", "sync@4x", 1.0, 0.1)
    assert v.verdict == "INCONCLUSIVE" and "sync@4x" in v.measured


def test_lr_scale_in_method_names():
    assert lr_scale("pipe@4x") == 4.0 and lr_scale("sync") == 1.0
    assert lr_scale("pipe+int8@0.5x") == 0.5
    assert parse_method("pipe+int8@4x") == ("pipe", 1, "int8")
    for bad in ("pipe@x", "pipe@-2x", "pipe@4", "pipe@nanx", "sync@0x"):
        with pytest.raises(ValueError, match="after '@'"):
            parse_method(bad)


# --------------------------------------------------------------------------- shared helpers


def test_parse_method():
    assert parse_method("sync") == ("sync", None, None)
    assert parse_method("pipe") == ("pipe", 1, None)
    assert parse_method("pipe+int8") == ("pipe", 1, "int8")
    assert parse_method("delayed-2") == ("pipe", 2, None)
    assert parse_method("layerwise+fp16") == ("layerwise", None, "fp16")
    assert parse_method("nocomm") == ("nocomm", None, None)
    for bad in ("async", "pipe+zip", "nocomm+fp16", 3):
        with pytest.raises(ValueError, match="method"):
            parse_method(bad)


def test_train_config_rejects_bad_settings():
    with pytest.raises(ValueError, match=r"unknown training setting\(s\) \['speed'\]"):
        config(e7.Params.make(), speed=1)
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="model"):
        TrainConfig(model="vgg")
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=float("nan"))
    with pytest.raises(ValueError, match="warmup_steps"):  # a variant is checked too
        dataclasses.replace(TrainConfig(schedule="warmup-cosine", warmup_steps=5), iterations=3)
    assert TrainConfig(method="delayed-1").method == "delayed-1"


def test_train_config_takes_the_parameters_and_keeps_its_own_model_kw():
    params = e7.Params.make(**TINY)
    cfg = config(params, seed=3, method="pipe")
    assert (cfg.model, cfg.batch_size, cfg.schedule, cfg.seed, cfg.method) == (
        "mlp", 8, "warmup-cosine", 3, "pipe")
    cfg.model_kw["hidden"].append(99)  # the parameters' dict is not the configuration's
    assert params.model_kw == {"hidden": [16]}
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # what a rank receives


@pytest.mark.parametrize(
    "alg,p,ports", [("ring", 2, "single"), ("lp", 4, "single"), ("ring", 3, "per-neighbor")]
)
def test_choose_bandwidth_inverts_the_cost_model(alg, p, ports):
    n, alpha, gamma = 830_000, 1e-3, 1e-9
    bw = choose_bandwidth(0.02, n, p, alpha, algorithm=alg, ports=ports, gamma=gamma)
    link = cost.LinkModel.from_bandwidth(alpha, bw, gamma=gamma, ports=ports)
    assert cost.allreduce_time(alg, n, p, link) == pytest.approx(0.02, rel=1e-6)
    with pytest.raises(ValueError, match="comm_ratio"):
        choose_bandwidth(1e-4, n, p, alpha, algorithm=alg, ports=ports, gamma=gamma)


def test_per_iteration_takes_the_slowest_rank():
    rows = [
        {
            "kind": "iteration",
            "m": "a",
            "rank": 0,
            "iteration": 0,
            "iter_s": 0.05,
            "comm_s": 0.03,
            "compute_s": 0.02,
            "launch_s": 0.0,
            "compress_s": 0.0,
            "update_s": 0.0,
            "loss": 1.0,
        },
        {
            "kind": "iteration",
            "m": "a",
            "rank": 1,
            "iteration": 0,
            "iter_s": 0.051,
            "comm_s": 0.021,
            "compute_s": 0.03,
            "launch_s": 0.0,
            "compress_s": 0.0,
            "update_s": 0.0,
            "loss": 3.0,
        },
        {
            "kind": "iteration",
            "m": "a",
            "rank": 0,
            "iteration": -1,
            "iter_s": 9.0,
            "comm_s": 0.0,
            "compute_s": 0.0,
            "launch_s": 0.0,
            "compress_s": 0.0,
            "update_s": 0.0,
            "loss": np.nan,
        },
    ]
    df = pd.DataFrame(rows)
    st = steady(df, 0)
    assert len(st) == 2  # the finish() record (iteration -1) is not a step
    agg = per_iteration(st, ["m"]).iloc[0]
    assert agg["T"] == pytest.approx(0.051)
    assert agg["C"] == pytest.approx(0.030)  # the slower computer
    assert agg["M"] == pytest.approx(0.021)
    assert agg["loss"] == pytest.approx(2.0)


def test_first_reach():
    ev = pd.DataFrame(
        {"iteration": [10, 20, 30], "wall_s": [1.0, 2.0, 3.0], "accuracy": [50.0, 71.0, 69.0]}
    )
    assert first_reach(ev, 70.0) == (20.0, 2.0)
    it, wall = first_reach(ev, 90.0)
    assert np.isnan(it) and np.isnan(wall)


# --------------------------------------------------------------------------- E7


def test_summary_time_to_accuracy_and_speedups():
    df = _e7()
    s = e7.summary(df).set_index("method")
    assert list(s.index) == [*METHODS, "sync@4x", "pipe@4x"]
    assert s.loc["pipe", "iter_speedup"] == pytest.approx(33 / 18, rel=0.05)
    assert s.loc["sync", "iter_speedup"] == pytest.approx(1.0)
    # the target (95% of sync's final) is first reached at the last snapshot of every method
    assert s.loc["pipe", "time_to_acc_speedup"] == pytest.approx(33 / 18, rel=0.02)
    assert s.loc["pipe", "vs_sync_points"] == pytest.approx(0.0333, abs=1e-3)
    assert e7.comm_ratio_measured(df) == pytest.approx(1.0, rel=0.1)


def test_a_diverged_reference_decides_nothing():
    """The first cpu-full run with per-method rates: sync@4x (4x sync's own best rate) diverged
    to chance, a flat curve that passed the convergence gate and made the control read FAIL;
    a reference that did not learn makes the comparison INCONCLUSIVE, with the reason."""
    df = _e7(stale_acc={0: 12.0, 1: 12.0, 2: 50.0})
    ref = (df["kind"] == "eval") & (df["method"] == "sync@4x")
    df.loc[ref, "accuracy"] = 10.0
    df.loc[ref & (df["iteration"] == df.loc[ref, "iteration"].min()), "accuracy"] = 16.0
    v = e7.check_stale_hurts(df, "pipe@4x", "sync@4x", 1.0, 0.1)
    assert v.verdict == "INCONCLUSIVE" and "sync@4x did not learn" in v.measured


def test_accuracy_claim_needs_each_methods_own_rate():
    """C7.2 is undecided unless every method's rate was selected from >= 3 rates on the selection
    seeds with the chosen one inside the grid; the tables show the selection and the pairs."""
    args = {"max_points": 1.0, "methods": ["pipe", "pipe+int8"], "tail": 0.1, "min_lrs": 3}
    assert e7.check_accuracy_within(_e7(), **args).verdict == "PASS"
    unswept = _e7()
    unswept = unswept[unswept["kind"] != "sweep"]
    v = e7.check_accuracy_within(unswept, **args)
    assert v.verdict == "INCONCLUSIVE" and "0 learning rate(s) swept" in v.measured
    edge = _e7()
    edge.loc[(edge["kind"] == "eval") & (edge["method"] == "pipe"), "lr_peak"] = 0.04
    v = e7.check_accuracy_within(edge, **args)
    assert v.verdict == "INCONCLUSIVE" and "pipe: best rate 0.04 at the edge" in v.measured
    assert e7.check_accuracy_within(unswept, **{**args, "min_lrs": 0}).verdict == "PASS"
    table = e7.sweep_table(_e7())
    assert table.loc["sync", 0.02].endswith("*") and list(table.columns) == list(RATES)
    pairs = e7.paired_table(_e7())
    assert pairs.loc[0, "pipe - sync"] == pytest.approx(0.1, abs=0.01)
    assert e7.summary(_e7()).set_index("method").loc["pipe", "lr"] == 0.02


def test_accuracy_claim_is_symmetric():
    better = _e7(int8_acc={0: 85.0, 1: 80.0, 2: 87.0})  # +5 points: not "within 1 point"
    args = {"methods": ["pipe", "pipe+fp16", "pipe+int8"], "tail": 0.1, "min_lrs": 3}
    assert e7.check_accuracy_within(better, max_points=1.0, **args).verdict == "FAIL"
    assert e7.check_accuracy_within(better, max_points=6.0, **args).passed


@pytest.mark.parametrize(
    "bad",
    [
        {"world_size": 1},
        {"methods": ["pipe", "sync"]},
        {"methods": ["sync", "nocomm"]},
        {"methods": ["sync", "pipe+gzip"]},
        {"seeds": []},
        {"seeds": [0, 0]},
        {"eval_every": 1000},
        {"comm_ratio": 0.0},
        {"bandwidth_Bps": -5.0},
        {"target_fraction": 1.5},
        {"algorithm": "mst"},
        {"batch_size": 10_000},
        {"dataset": "imagenet"},
        {"dataset": "cifar10"},  # needs data_root
        {"backend": "mpi"},
        {"timing_runs": -1},
        {"timing_iterations": 3},  # not above skip
        {"timing_methods": ["pipe"]},  # no baseline
        {"lrs": [0.01, 0.02, 0.08]},  # not geometric
        {"lrs": [0.01, -0.02]},
        {"selection_seeds": [0]},  # an evaluation seed
        {"selection_seeds": []},
        {"max_extend": -1},
        {"control_seeds": -2},
    ],
)
def test_bad_parameters_name_the_parameter(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        e7.run(**bad)


#: the tiny run: its notebook executes it once (tests/test_notebooks.py shares the run)
TINY = dict(
    seeds=[0],
    methods=["sync", "pipe", "pipe+int8@4x"],
    iterations=4,
    eval_every=2,
    skip=1,
    model="mlp",
    model_kw={"hidden": [16]},
    batch_size=8,
    lr=0.1,
    schedule="warmup-cosine",
    warmup_steps=3,  # longer than a timing run: timing runs train at a constant rate
    bandwidth_Bps=1e9,
    alpha_s=1e-4,
    calib_iters=2,
    timing_methods=["sync", "pipe"],
    timing_runs=2,
    timing_iterations=2,
    timeout_s=120.0,
)


def test_tiny_run_fixed_bandwidth(notebook_run, monkeypatch):
    from pipecomm.lab import results

    run = notebook_run(e7, TINY)
    df = run.df
    # calibration, 2 x 2 timing runs and 3 training runs kept
    (runs_dir,) = run.out.parent.glob(".runs/E7-*")
    assert len(list(runs_dir.glob("*.pkl"))) == 1 + 4 + 3
    # re-running resumes from them: the same rows, nothing trained again
    monkeypatch.setenv(results.RUNS_ENV, str(runs_dir))
    results.write_csv(run.out.parent / "again.csv", e7.run(**TINY))
    pd.testing.assert_frame_equal(results.load_csv(run.out.parent / "again.csv"), df)
    assert {"backend", "world_size", "network"} <= set(df.columns)
    ev = df[df["kind"] == "eval"]
    assert sorted(set(ev["method"])) == ["pipe", "pipe+int8@4x", "sync"]
    assert sorted(ev[ev["method"] == "sync"]["iteration"]) == [2, 4]
    # the curve carries seed, rate in force and schedule: warm-up 1 step, cosine to 0 at step 4
    assert (ev["schedule"] == "warmup-cosine(warmup=3,min=0)").all() and (ev["seed"] == 0).all()
    stress = ev[ev["method"] == "pipe+int8@4x"].sort_values("iteration")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.4)
    sched = schedules.build(opt, "warmup-cosine", total_steps=4, warmup_steps=3, min_ratio=0.0)
    rates = []
    for _ in range(4):
        rates.append(opt.param_groups[0]["lr"])
        schedules.step(sched)
    assert stress["lr"].tolist() == pytest.approx([rates[1], rates[3]], abs=1e-12)
    assert stress["lr_peak"].tolist() == pytest.approx([0.4, 0.4]) and ev["train_loss"].notna().all()
    assert ev["accuracy"].between(0, 100).all()
    fin = e7.final_accuracy(df)
    assert len(fin) == 3
    # pipe's last snapshot is taken after finish(): all 4 gradients applied, as in sync
    it = df[(df["kind"] == "iteration") & (df["method"] == "pipe")]
    assert it.loc[it["rank"] == 0, "updates"].sum() == 4
    assert len(e7.summary(df)) == 3
    assert e7.check_pipe_speedup(df, method="pipe", tolerance=0.25).measured
    # the timing runs: 2 rounds of sync and pipe, separate from the training runs, no evaluation
    timing = df[df["kind"] == "timing"]
    assert timing.groupby("method")["run"].nunique().to_dict() == {"pipe": 2, "sync": 2}
    assert (timing["iteration"].max() == 1) and "timing" not in set(ev["kind"])


def test_checks_work_on_data_read_back_from_csv(tmp_path):
    """Claims are evaluated from data.csv: booleans and seeds come back as objects / floats."""
    from pipecomm.lab import results

    for make in (_e7, lambda: _e7(int8_acc={0: 70.0, 1: 70.0, 2: 70.0})):
        df = make()
        results.write_csv(tmp_path / "data.csv", df)
        back = results.load_csv(tmp_path / "data.csv")
        speed = {"method": "pipe", "tolerance": 0.25}
        acc = {"max_points": 1.0, "methods": ["pipe", "pipe+fp16", "pipe+int8"], "tail": 0.1,
               "min_lrs": 3}
        for check, args in ((e7.check_pipe_speedup, speed), (e7.check_accuracy_within, acc)):
            assert check(back, **args) == check(df, **args)
        assert e7.summary(back)["final_acc_%"].tolist() == pytest.approx(
            e7.summary(df)["final_acc_%"].tolist()
        )


# --------------------------------------------------------------------------- independent repeats


def test_rounds_interleave_and_rotate():
    from pipecomm.lab.training.pipesgd_training import rounds

    out = rounds(["a", "b", "c"], 5)
    assert [r for r, _ in out] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    assert [x for _, x in out[:6]] == ["a", "b", "c", "b", "c", "a"]
    firsts = [out[3 * r][1] for r in range(3)]
    assert sorted(firsts) == ["a", "b", "c"]  # each item leads one round in three
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="runs"):
            rounds(["a"], bad)


def test_speed_claims_take_one_repeat_per_run():
    """The timing runs are the repeats (5 per method), never the iterations of one run; without
    timing runs the seeds are, and 3 seeds cannot decide."""
    from pipecomm.lab.training.pipesgd_analysis import run_samples, timing_kind

    df = _e7()
    assert timing_kind(df) == "timing"
    timing = df[df["kind"] == "timing"]
    assert (timing.groupby("method")["run"].nunique() >= 5).all()
    assert len(run_samples(df, "pipe")) == 5
    no_timing = _e7(timing_runs=0)
    assert timing_kind(no_timing) == "iteration" and len(run_samples(no_timing, "pipe")) == 3
    v = e7.check_pipe_speedup(no_timing, "pipe", 0.25)
    assert v.verdict == "INCONCLUSIVE" and "3 training runs (seeds)" in v.measured
    # the speed of each compressed pipeline against its own model column
    cal = {"model_pipe_int8_s": 0.033}  # model speedup 1.0: bound 0.6
    df = _e7()
    df.loc[df["kind"] == "calibration", list(cal)] = list(cal.values())
    v = e7.check_pipe_speedup(df, "pipe+int8", 0.25)
    assert "model 1.00x, bound 0.60x" in v.measured and v.passed
    assert "2.00x" in e7.predict_pipe_speedup(df, "pipe+fp16")
    with pytest.raises(ValueError, match="method"):
        e7.check_pipe_speedup(df, "sync@4x", 0.25)
