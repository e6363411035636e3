"""E13 (AllReduce Adam vs DAdam vs AccumAdam): the AllReduce baseline against a single-process
oracle, summary statistics, claims, validation, one tiny run."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist

from pipecomm.lab.experiments import e13_dadam_convergence as e13
from pipecomm.lab.networks import cluster
from pipecomm.lab.training.trainers import AllReduceTrainer
from pipecomm.lab.workloads.tasks import corpus

# ----------------------------------------------------------------------------- rank functions


def _data(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(
        6, 2, generator=g, dtype=torch.float64
    )


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)
    ).double()


def _forward(model, x, skip_bias):
    if not skip_bias:
        return model(x)
    # the last bias takes no part: its gradient stays None (counted as zero)
    return torch.nn.functional.linear(model[1](model[0](x)), model[2].weight)


def rank_allreduce_dp(algorithm, bucket_mb, steps, skip_bias_at):
    """Train with AllReduceTrainer + SGD; at step ``skip_bias_at`` the last bias is unused."""
    model = _model()
    if dist.get_rank() == 1:  # different init: the construction broadcast must fix it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    ar = AllReduceTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), bucket_mb=bucket_mb, algorithm=algorithm
    )
    for step in range(steps):
        x, y = _data(dist.get_rank(), step)
        ar.zero_grad()
        torch.nn.functional.mse_loss(_forward(model, x, step == skip_bias_at), y).backward()
        ar.step()
    ar.close()
    return [p.detach().clone() for p in model.parameters()]


def _oracle(world, steps, skip_bias_at):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        grads = []
        for r in range(world):
            model.zero_grad()
            x, y = _data(r, step)
            torch.nn.functional.mse_loss(_forward(model, x, step == skip_bias_at), y).backward()
            grads.append(
                [
                    torch.zeros_like(p) if p.grad is None else p.grad.clone()
                    for p in model.parameters()
                ]
            )
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / world
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm, bucket_mb", [("ring", 1e-5), ("lp", 25.0), ("torch", 1e-4)])
def test_allreduce_baseline_equals_averaged_gradient_sgd(pool, algorithm, bucket_mb):
    ranks = pool(2)
    got = ranks.run(rank_allreduce_dp, algorithm, bucket_mb, 3, 1, timeout_s=60)
    want = _oracle(2, 3, 1)
    for per_rank in got:
        for a, b in zip(per_rank, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- synthetic data

LRS = (1e-3, 2e-3, 4e-3)
FLAT = (1.5, 1.05, 1.001, 1.0008, 1.0004, 1.0)  # validation loss / the final one
CONFS = (("allreduce-adam", 1), ("dadam-complete", 1), ("dadam-aer", 1),
         ("accumadam-complete", 2), ("accumadam-aer", 2))
LM_SCALE = 0.05  # an LM difference in nats = LM_SCALE x the digits difference in points


def _e13(accum=(-0.2, -0.1, -0.3, -0.2), dadam=(1.0, 1.1, 0.9, 1.0), tasks=("digits", "lm"),
         lrs=LRS, curve=FLAT, best=None, sweep_gap=""):
    """Synthetic E13 data. Per evaluation seed 0..n-1, how much worse (positive) AccumAdam
    (``accum``) and DAdam (``dadam``) end than AllReduce Adam: digits test accuracy in points,
    LM test loss in LM_SCALE x that many nats (AllReduce: accuracy 95%, loss 1.0, +0.001 per
    seed). Selection seed 100 sweeps ``lrs`` (the middle one best, or index ``best[method]``);
    eval rows every 20 of 120 steps follow ``curve`` x the final loss."""
    rows = []
    best = best or {}
    for task in tasks:
        for method, k in CONFS:
            worse = (accum if method.startswith("accum") else dadam if method.startswith("dadam")
                     else (0.0,) * len(accum))
            chosen = lrs[best.get(method, len(lrs) // 2)]
            runs = [(100, lr, "sweep") for lr in (lrs if len(lrs) > 1 else ())]
            runs += [(s, chosen, "final") for s in range(len(accum))]
            for seed, lr, phase in runs:
                w = worse[seed] if phase == "final" else 0.0
                acc = 0.95 + 0.001 * seed - w / 100
                loss = 1.0 + 0.001 * seed + (w * LM_SCALE if task == "lm" else w / 100)
                loss += 0.0 if lr == chosen else 0.3
                common = {"task": task, "method": method, "accum_iter": k,
                          "config": e13.config_label(method, k), "seed": seed, "lr": lr,
                          "phase": phase, "selected": lr == chosen,
                          "sweep_gap": sweep_gap if phase == "final" else "",
                          "samples_seen": 6400, "epochs": 4.45, "world_size": 4,
                          "backend": "gloo", "network": "real", "algorithm": "torch",
                          "schedule": "warmup-cosine(warmup=5,min=0.1)"}
                for n, f in enumerate(curve, start=1):
                    rows.append({**common, "record": "eval", "iteration": 20 * n,
                                 "wall_s": 0.5 * n, "train_loss": loss * f + 0.1,
                                 "val_loss": loss * f, "lr_now": lr})
                rows.append({**common, "record": "final", "iteration": 120, "wall_s": 2.0,
                             "val_loss": loss, "val_accuracy": acc, "loss": loss,
                             "accuracy": acc})
    return pd.DataFrame(rows)


GATES = {"min_lrs": 3, "tail": 0.1, "level_frac": 0.05, "may_miss": "none", "accum_iter": 2}
C13_1 = {"pairs": [["accumadam-complete", "allreduce-adam"], ["accumadam-aer", "allreduce-adam"]],
         "digits_points": 0.5, "lm_rel": 0.01, **GATES}
C13_2 = {"pairs": [["accumadam-complete", "dadam-complete"], ["accumadam-aer", "dadam-aer"]],
         "digits_points": 0.0, "lm_rel": 0.0, **GATES}
PASSING = {"accum": (-0.2, -0.1, -0.3, -0.2), "dadam": (1.0, 1.1, 0.9, 1.0)}
FAILING = {"accum": (1.0, 1.1, 0.9, 1.0), "dadam": (0.1, 0.2, 0.0, 0.1)}
# AccumAdam - AllReduce straddles C13.1's margin (mean 0.5 points / 0.025 nats vs 0.01);
# AccumAdam - DAdam straddles 0
UNSURE = {"accum": (0.0, 1.0, 0.2, 0.8), "dadam": (0.5, 0.5, 0.5, 0.5)}
CLAIM_CASES = {
    # one set of cases decides both C13.1 (against AllReduce, margins 0.5 points / 1%) and
    # C13.2 (against DAdam, margin 0)
    "e13_paired": (lambda: _e13(**PASSING), lambda: _e13(**FAILING), lambda: _e13(**UNSURE)),
}


@pytest.mark.parametrize("args", [C13_1, C13_2], ids=["C13.1", "C13.2"])
@pytest.mark.parametrize("case, want", [(PASSING, "PASS"), (FAILING, "FAIL"),
                                        (UNSURE, "INCONCLUSIVE")])
def test_paired_claims_pass_fail_and_straddle(args, case, want):
    v = e13.check_paired(_e13(**case), **args)
    assert v.verdict == want, v
    assert "cannot decide" not in v.measured
    if want == "PASS":
        assert "0 of 4 points missed (0 may miss)" in v.measured


def test_paired_claim_reports_metrics_sizes_and_margins():
    v = e13.check_paired(_e13(**FAILING), **C13_1)
    # digits: AllReduce 95.15% on average, AccumAdam 1.0 point worse; LM: 0.05 nats worse
    assert "digits AccumAdam K=2 (AER) vs AllReduce Adam (4 seeds, rates 0.002 / 0.002)" in v.measured
    assert "worse by +1.00 [" in v.measured and "margin 0.50)" in v.measured
    assert "worse by +0.0500 [" in v.measured and "margin 0.0100)" in v.measured
    assert "of the reference" in v.measured and "4 of 4 points missed (0 may miss)" in v.measured
    w = e13.check_paired(_e13(**PASSING), **C13_2)
    assert "lm AccumAdam K=2 (complete) vs DAdam (complete)" in w.measured
    assert "worse by -0.0600 [" in w.measured  # 0.05 x (-0.2 - 1.0) on average


@pytest.mark.parametrize("args", [C13_1, C13_2], ids=["C13.1", "C13.2"])
def test_paired_claims_are_gated_on_the_sweep_and_the_levelled_reference(args):
    """PASS and FAIL data become INCONCLUSIVE, with the reason, when a configuration tried one
    rate, when its chosen rate is at the edge of those swept, or when the reference still
    improved over its last 10% of steps by more than 5% of its total improvement."""
    for case in (PASSING, FAILING):
        one_rate = e13.check_paired(_e13(lrs=(2e-3,), **case), **args)
        assert one_rate.verdict == "INCONCLUSIVE"
        assert "0 learning rate(s) swept, need >= 3" in one_rate.measured
        edge = e13.check_paired(_e13(best={"accumadam-aer": 2}, **case), **args)
        assert edge.verdict == "INCONCLUSIVE"
        assert "AccumAdam K=2 (AER): best rate 0.004 at the edge" in edge.measured
        # 1.1 -> 1.0 over the last 3 evaluations: 0.1 of a 0.5 improvement (20% > 5%)
        falling = e13.check_paired(_e13(curve=(1.5, 1.2, 1.1, 1.06, 1.04, 1.0), **case), **args)
        assert falling.verdict == "INCONCLUSIVE" and "not converged" in falling.measured
        assert "5% of its total improvement" in falling.measured
    # the reference is AllReduce for C13.1 and DAdam for C13.2
    ref = "AllReduce Adam" if args is C13_1 else "DAdam (AER)"
    assert f"{ref} not converged" in falling.measured


def test_a_reference_that_did_not_improve_is_not_levelled():
    v = e13.check_paired(_e13(curve=(1.0, 1.0, 1.0, 1.0, 1.0, 1.2), **PASSING), **C13_1)
    assert v.verdict == "INCONCLUSIVE" and "did not improve" in v.measured


def test_paired_claim_needs_pairs():
    df = _e13()
    unpaired = df[~((df.method == "accumadam-aer") & (df.seed == 1))]
    with pytest.raises(ValueError, match="pairs needed"):
        e13.check_paired(unpaired, **C13_1)
    with pytest.raises(ValueError, match="pairs must hold"):
        e13.check_paired(df, **{**C13_1, "pairs": [["accumadam-aer"]]})
    with pytest.raises(ValueError, match="pairs must hold"):
        e13.check_paired(df, **{**C13_1, "pairs": [["sgd", "allreduce-adam"]]})
    with pytest.raises(ValueError, match="none of the pairs"):
        e13.check_paired(df[~df.method.str.startswith("accum")], **C13_1)
    with pytest.raises(ValueError, match="K=4"):
        e13.check_paired(df, **{**C13_1, "accum_iter": 4})
    one_seed = e13.check_paired(df[df.seed.isin([0, 100])], **C13_1)  # unbounded interval
    assert one_seed.verdict == "INCONCLUSIVE"


def test_summary_sweep_and_paired_tables():
    df = _e13(best={"accumadam-aer": 1, "accumadam-complete": 2}, sweep_gap="")
    s = e13.summary(df).set_index(["task", "configuration"])
    row = s.loc[("digits", "AccumAdam K=2 (complete)")]
    assert row["seeds"] == 4 and row["lr"] == 4e-3 and row["lr / AllReduce's"] == 2.0
    assert row["sweep gap"] == ""
    # FLAT: within 0.5% of the final value from step 60 of 120
    assert s.loc[("lm", "AllReduce Adam"), "budget used"] == pytest.approx(0.5)
    assert s.loc[("lm", "AllReduce Adam"), "samples seen (epochs)"] == "6,400 (4.45)"
    sw = e13.sweep_table(df)
    assert sw.loc[("digits", "AllReduce Adam"), 2e-3].endswith("*")
    assert sw.loc[("digits", "AllReduce Adam"), 1e-3] == "1.4000"  # seed 100: 1.1 + 0.3
    assert sw.loc[("lm", "AccumAdam K=2 (complete)"), 4e-3].endswith("*")
    assert e13.sweep_table(_e13(lrs=(2e-3,))).empty
    pt = e13.paired_table(_e13(**FAILING))
    assert list(pt.loc["digits"].index) == [0, 1, 2, 3]
    d = pt.loc[("digits", 1)]
    assert d["AllReduce Adam: test accuracy %"] == pytest.approx(95.1)
    assert d["AccumAdam K=2 (AER) - AllReduce Adam (worse +)"] == pytest.approx(1.1)
    assert d["AccumAdam K=2 (AER) - DAdam (AER) (worse +)"] == pytest.approx(0.9)
    lm = pt.loc[("lm", 1)]
    assert lm["DAdam (complete) - AllReduce Adam (worse +)"] == pytest.approx(0.01)
    assert lm["AccumAdam K=2 (complete) - DAdam (complete) (worse +)"] == pytest.approx(0.045)


def test_configurations_and_eval_splits_are_disjoint():
    assert e13.configurations(e13.Params.make(methods=["allreduce-adam", "accumadam-aer"],
                                              accum_iters=[2, 4])) == [
        ("allreduce-adam", 1), ("accumadam-aer", 2), ("accumadam-aer", 4)]
    (xv, yv), (xt, _) = e13.eval_split("lm", "val"), e13.eval_split("lm", "test")
    ids = corpus().val
    half = len(ids) // 2
    torch.testing.assert_close(xv.flatten(), ids[: xv.numel()])  # first half of the text
    torch.testing.assert_close(xt.flatten(), ids[half : half + xt.numel()])  # second half
    torch.testing.assert_close(xv[:, 1:], yv[:, :-1])  # y is x shifted by one
    assert xv.numel() <= half and len(xv) > 300
    dv, dt = e13.eval_split("digits", "val")[0], e13.eval_split("digits", "test")[0]
    x_all, _ = e13._digits("test")
    assert len(dv) + len(dt) == len(x_all) and len(dv) >= 150
    with pytest.raises(ValueError, match="part"):
        e13.eval_split("lm", "train")


def test_method_names_split_into_optimizer_and_topology():
    assert e13._split("allreduce-adam") == ("adam", None)
    assert e13._split("dadam-aer") == ("adam", "alternating-exp-ring")
    assert e13._split("accumadam-complete") == ("accumadam", "complete")


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"world_size": 6}, "world_size"),
        ({"tasks": ["imagenet"]}, "tasks"),
        ({"methods": []}, "methods"),
        ({"digits_seeds": []}, "digits_seeds"),
        ({"lm_seeds": [1, 1]}, "lm_seeds"),
        ({"selection_seeds": [-1]}, "selection_seeds"),
        ({"selection_seeds": [1], "lm_seeds": [0, 1]}, "selection_seeds must be disjoint"),
        ({"selection_seeds": [0]}, "selection_seeds must be disjoint"),
        ({"max_extend": -1}, "max_extend"),
        ({"digits_lrs": [1e-3, 2e-3, 5e-3]}, "digits_lrs must be a geometric grid"),
        ({"lm_lrs": [0.0]}, "lm_lrs"),
        ({"lm_lrs": []}, "lm_lrs"),
        ({"digits_lrs": [1e-3, 1e-3]}, "digits_lrs"),
        ({"accum_iters": [1]}, "accum_iters"),
        ({"methods": ["dadam-aer"]}, "allreduce-adam"),
        ({"schedule": "step"}, "schedule"),
        ({"warmup_fraction": 1.5}, "warmup_fraction"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio|min_ratio"),
        ({"emulated": "yes"}, "emulated"),
        ({"backend": "mpi"}, "backend"),
        ({"backend": "nccl", "emulated": True}, "emulated network"),
    ],
)
def test_bad_parameters_name_the_parameter(bad, match):
    with pytest.raises(ValueError, match=match):
        e13.run(**bad)


#: the tiny run: its notebook executes it once (tests/test_notebooks.py shares the run)
TINY = dict(world_size=2, ranks_per_node=1, tasks=["digits", "lm"],
            methods=["allreduce-adam", "dadam-aer", "accumadam-aer"], accum_iters=[2],
            digits_seeds=[0, 1], lm_seeds=[0], selection_seeds=[5], max_extend=1,
            digits_iterations=4, lm_iterations=3, eval_every=2, digits_lrs=[1e-3, 1e-2],
            lm_lrs=[3e-3])


@pytest.mark.timeout(240)
def test_tiny_end_to_end_run(notebook_run, monkeypatch):
    """Digits: each configuration's rate chosen on selection seed 5 over a 2-rate grid
    extended once, then evaluation seeds 0 and 1 at the chosen rate; the LM's single rate: no
    selection runs. Curves at fixed intervals; the claims evaluate (INCONCLUSIVE: too few
    rates); a second run with the same run directory resumes from the finished runs."""
    from pipecomm.lab import claims, results

    run = notebook_run(e13, TINY)
    df = run.df
    assert {"backend", "world_size", "network", "seed", "lr", "schedule", "phase",
            "sweep_gap"} <= set(df.columns)
    assert (df.network == "real").all() and (df.backend == "gloo").all()
    f = e13.finals(df)
    assert len(f) == 3 * 2 + 3 * 1 and f.loss.notna().all() and f.val_loss.notna().all()
    assert (f.phase == "final").all() and f.selected.all()
    assert f[f.task == "digits"].accuracy.between(0, 1).all()
    sweep = df[(df.record == "final") & (df.phase == "sweep")]
    assert set(sweep.seed) == {5} and set(sweep.task) == {"digits"}  # LM: one rate, no sweep
    assert set(f.seed) == {0, 1}  # selection seeds are never evaluated
    for (method, k), s0 in sweep.groupby(["method", "accum_iter"]):
        # 2 rates: the best is at an edge, so the grid grows once by its ratio 10
        assert len(s0) == 3 and s0.lr.nunique() == 3
        chosen = s0.loc[s0.val_loss.idxmin(), "lr"]
        assert s0.selected.sum() == 1 and s0[s0.selected].lr.iloc[0] == chosen
        g = f[(f.task == "digits") & (f.method == method) & (f.accum_iter == k)]
        assert sorted(g.seed) == [0, 1] and (g.lr == chosen).all()
        inside = s0.lr.min() < chosen < s0.lr.max()
        assert (g.sweep_gap == "").all() == inside
    assert (f[f.task == "lm"].sweep_gap == "1 rate: no sweep").all()
    ev = df[df.record == "eval"]
    assert ev.groupby(["task", "method", "accum_iter", "seed", "lr"]).iteration.apply(list).map(
        tuple).isin([(2, 4), (2, 3)]).all()
    assert (ev.groupby(["task", "method", "accum_iter", "seed", "lr"]).wall_s.diff().dropna()
            > 0).all()
    assert ev.lr_now.le(ev.lr).all()
    assert len(e13.summary(df)) == 6 and len(e13.sweep_table(df)) == 3
    assert len(e13.paired_table(df)) == 3
    verdicts = claims.experiment_verdicts(e13.ID, df).set_index("claim")
    assert set(verdicts.verdict) == {"INCONCLUSIVE"}, verdicts.measured.to_dict()
    assert "learning rate(s) swept, need >= 3" in verdicts.loc["C13.2", "measured"]
    e13.plot(df)
    (runs_dir,) = run.out.parent.glob(".runs/E13-*")
    assert len(list(runs_dir.glob("*.pkl"))) == len(sweep) + 9
    monkeypatch.setenv(results.RUNS_ENV, str(runs_dir))
    results.write_csv(run.out.parent / "again.csv", e13.run(**TINY))  # every run from the
    pd.testing.assert_frame_equal(results.load_csv(run.out.parent / "again.csv"), df)  # dir


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="needs fewer than 4 visible GPUs")
def test_nccl_without_enough_gpus_is_refused_before_starting_ranks():
    with pytest.raises(ValueError, match="needs 4 visible GPUs"):
        e13.run(backend="nccl")


@pytest.mark.skipif(cluster.available()[0], reason="tests/test_cluster.py runs E13 under "
                    "torchrun on two nodes of the virtual cluster against a local pool")
@pytest.mark.timeout(240)
def test_under_torchrun_matches_a_local_pool(tmp_path):
    """The multi-node path (torchrun, launch.pool -> TorchrunJob) gives the local pool's numbers."""
    params = dict(world_size=2, ranks_per_node=1, tasks=["digits"],
                  methods=["allreduce-adam", "dadam-complete"], digits_seeds=[0],
                  digits_iterations=3, eval_every=2)
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", e13.__name__,
           "--out", str(tmp_path / "E13"), "--no-plot"]
    for k, v in params.items():
        cmd += ["-p", f"{k}={v!r}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = pd.read_csv(tmp_path / "E13" / "data.csv")
    local = e13.run(**params)
    a, b = e13.finals(job).sort_values("method"), e13.finals(local).sort_values("method")
    assert list(a.method) == list(b.method) == ["allreduce-adam", "dadam-complete"]
    np.testing.assert_allclose(a.loss.to_numpy(), b.loss.to_numpy(), rtol=1e-5)
