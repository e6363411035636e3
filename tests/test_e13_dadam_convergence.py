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
from pipecomm.lab.trainers import AllReduceTrainer
from pipecomm.lab.workloads import corpus

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


def _e13(ar=(1.0, 1.1, 0.9), accum=(1.05, 1.12, 0.95), tasks=("digits", "lm"), lrs=LRS,
         curve=FLAT, accum_best=2):
    """Synthetic E13 data: seed 0 sweeps ``lrs`` (the middle one, or ``accum_best`` for
    AccumAdam, is best on validation), seeds 1-2 run the best; eval rows every 20 of 120 steps
    whose validation loss follows ``curve``; final test losses ``ar`` / ``accum`` per seed."""
    rows = []
    for task in tasks:
        for method, k, losses in (
            ("allreduce-adam", 1, ar),
            ("accumadam-complete", 2, accum),
            ("accumadam-aer", 2, accum),
            ("dadam-aer", 1, tuple(x + 0.1 for x in ar)),
        ):
            best = lrs[min(accum_best, len(lrs) - 1)] if method.startswith("accum") else lrs[
                len(lrs) // 2]
            runs = [(0, lr, "sweep") for lr in lrs] + [(s, best, "final") for s in (1, 2)]
            for seed, lr, phase in runs:
                loss = losses[seed] + (0.0 if lr == best else 0.3)
                common = {"task": task, "method": method, "accum_iter": k,
                          "config": e13.config_label(method, k), "seed": seed, "lr": lr,
                          "phase": phase, "selected": lr == best, "samples_seen": 6400,
                          "epochs": 4.45, "world_size": 4, "backend": "gloo",
                          "network": "real", "algorithm": "torch",
                          "schedule": "warmup-cosine(warmup=5,min=0.1)"}
                for n, f in enumerate(curve, start=1):
                    rows.append({**common, "record": "eval", "iteration": 20 * n,
                                 "wall_s": 0.5 * n, "train_loss": loss * f + 0.1,
                                 "val_loss": loss * f, "lr_now": lr})
                rows.append({**common, "record": "final", "iteration": 120, "wall_s": 2.0,
                             "val_loss": loss, "val_accuracy": 0.9, "loss": loss,
                             "accuracy": 0.9 if task == "digits" else 0.5})
    return pd.DataFrame(rows)


ARGS = {"max_rel_gap": 0.02, "min_seeds": 3, "accum_iter": 2, "min_lrs": 3, "tail": 0.1}
CLAIM_CASES = {
    # AllReduce mean 1.0: margin 0.02. Paired differences 0.005 +- 0.002 pass, 0.05 +- 0.002
    # fail, 0.01 +- 0.02 straddle the margin
    "e13_accumadam_within": (lambda: _e13(accum=(1.003, 1.105, 0.907)),
                             lambda: _e13(accum=(1.048, 1.15, 0.952)),
                             lambda: _e13(accum=(0.99, 1.13, 0.91))),
}


def test_claim_is_a_paired_interval_against_a_margin():
    assert e13.check_accumadam_within(_e13(accum=(0.5, 0.6, 0.4)), **ARGS).passed  # better
    v = e13.check_accumadam_within(_e13(accum=(1.003, 1.105, 0.907)), **ARGS)
    assert "paired diff +0.0050" in v.measured and "margin 0.0200" in v.measured
    assert "AccumAdam K=2 (AER)" in v.measured and "cannot decide" not in v.measured


def test_claim_is_inconclusive_without_a_sweep_or_before_convergence():
    """The same finals that PASS (or FAIL) become INCONCLUSIVE, with the reason, when only one
    rate was tried or AllReduce Adam's validation loss still falls (6% over its last 3 evaluations)."""
    for bad in ({"accum": (0.5, 0.6, 0.4)}, {"accum": (1.048, 1.15, 0.952)}):
        one_rate = e13.check_accumadam_within(_e13(lrs=(2e-3,), **bad), **ARGS)
        assert one_rate.verdict == "INCONCLUSIVE"
        assert "1 learning rate(s) swept, need >= 3" in one_rate.measured
        falling = e13.check_accumadam_within(_e13(curve=(1.5, 1.2, 1.1, 1.06, 1.04, 1.0), **bad),
                                             **ARGS)
        assert falling.verdict == "INCONCLUSIVE" and "not converged" in falling.measured


def test_claim_needs_paired_seeds_and_enough_of_them():
    df = _e13()
    with pytest.raises(ValueError, match="seeds"):
        e13.check_accumadam_within(df[df.seed < 2], **ARGS)
    unpaired = df[~((df.method == "accumadam-aer") & (df.seed == 1))]
    with pytest.raises(ValueError, match="pairs"):
        e13.check_accumadam_within(unpaired, **ARGS)
    with pytest.raises(ValueError, match="AccumAdam"):
        e13.check_accumadam_within(df[~df.method.str.startswith("accum")], **ARGS)
    with pytest.raises(ValueError, match="K=4"):
        e13.check_accumadam_within(df, **{**ARGS, "accum_iter": 4})


def test_summary_and_sweep_table():
    df = _e13(accum_best=2)
    s = e13.summary(df).set_index(["task", "configuration"])
    row = s.loc[("digits", "AccumAdam K=2 (AER)")]
    assert row["seeds"] == 3 and row["lr"] == 4e-3 and row["lr / AllReduce's"] == 2.0
    assert row["loss - AllReduce, paired [95% CI]"].startswith("0.0400 [")
    assert s.loc[("digits", "AllReduce Adam"), "test loss [95% CI]"].startswith("1.0000 [")
    assert s.loc[("lm", "AllReduce Adam"), "samples seen (epochs)"] == "6,400 (4.45)"
    sw = e13.sweep_table(df)
    assert sw.loc[("digits", "AllReduce Adam"), 2e-3].endswith("*")
    assert not sw.loc[("digits", "AllReduce Adam"), 1e-3].endswith("*")
    assert sw.loc[("lm", "AccumAdam K=2 (complete)"), 4e-3].endswith("*")


def test_configurations_and_eval_splits_are_disjoint():
    assert e13.configurations({"methods": ["allreduce-adam", "accumadam-aer"],
                               "accum_iters": [2, 4]}) == [
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
        ({"seeds": []}, "seeds"),
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


@pytest.mark.timeout(240)
def test_tiny_end_to_end_run(tmp_path, monkeypatch):
    """Sweep on seed 0, selected rate on seed 1; curves at fixed intervals; a second run with
    the same run directory resumes from the finished runs instead of training again."""
    from pipecomm.lab import results

    monkeypatch.setenv(results.RUNS_ENV, str(tmp_path))
    params = dict(world_size=2, ranks_per_node=1, tasks=["digits", "lm"],
                  methods=["allreduce-adam", "accumadam-aer"], accum_iters=[2, 3], seeds=[0, 1],
                  digits_iterations=4, lm_iterations=3, eval_every=2, digits_lrs=[1e-3, 1e-2],
                  lm_lrs=[3e-3])
    df = e13.run(**params)
    assert {"backend", "world_size", "network", "seed", "lr", "schedule"} <= set(df.columns)
    assert (df.network == "real").all() and (df.backend == "gloo").all()
    f = e13.finals(df)
    assert len(f) == 2 * 3 * 2 and f.loss.notna().all() and f.val_loss.notna().all()
    assert f[f.task == "digits"].accuracy.between(0, 1).all()
    sweep = df[(df.record == "final") & (df.phase == "sweep")]
    assert len(sweep) == 3 * 2 + 3 * 1  # digits: 3 configurations x 2 rates; lm: x 1
    for (task, method, k), g in f.groupby(["task", "method", "accum_iter"]):
        assert sorted(g.seed) == [0, 1] and g.lr.nunique() == 1  # the selected rate, both seeds
        s0 = sweep[(sweep.task == task) & (sweep.method == method) & (sweep.accum_iter == k)]
        assert g.lr.iloc[0] == s0.loc[s0.val_loss.idxmin(), "lr"]
    ev = df[df.record == "eval"]
    assert ev.groupby(["task", "method", "accum_iter", "seed", "lr"]).iteration.apply(list).map(
        tuple).isin([(2, 4), (2, 3)]).all()
    assert (ev.groupby(["task", "method", "accum_iter", "seed", "lr"]).wall_s.diff().dropna()
            > 0).all()
    assert ev.lr_now.le(ev.lr).all()
    assert len(e13.summary(df)) == 6
    e13.plot(df)
    assert len(list(tmp_path.glob("*.pkl"))) == len(sweep) + 6
    again = e13.run(**params)  # every run from the run directory: same numbers
    pd.testing.assert_frame_equal(again, df)


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="needs fewer than 4 visible GPUs")
def test_nccl_without_enough_gpus_is_refused_before_starting_ranks():
    with pytest.raises(ValueError, match="needs 4 visible GPUs"):
        e13.run(backend="nccl")


@pytest.mark.timeout(240)
def test_under_torchrun_matches_a_local_pool(tmp_path):
    """The multi-node path (torchrun, launch.pool -> TorchrunJob) gives the local pool's numbers."""
    params = dict(world_size=2, ranks_per_node=1, tasks=["digits"],
                  methods=["allreduce-adam", "dadam-complete"], seeds=[0],
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
