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

from pipecomm.experiments import _decentralized as D
from pipecomm.experiments import e13_dadam_convergence as e13

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
    ar = D.AllReduceTrainer(
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


def _finals(ar=(1.0, 1.1, 0.9), accum=(1.05, 1.12, 0.95), tasks=("digits", "lm")):
    rows = []
    for task in tasks:
        for method, losses in (
            ("allreduce-adam", ar),
            ("accumadam-complete", accum),
            ("accumadam-aer", accum),
            ("dadam-aer", tuple(x + 0.1 for x in ar)),
        ):
            for seed, loss in enumerate(losses):
                rows.append(
                    {
                        "task": task,
                        "method": method,
                        "seed": seed,
                        "record": "final",
                        "iteration": 10,
                        "wall_s": 1.0,
                        "loss": loss,
                        "accuracy": 0.9 if task == "digits" else np.nan,
                        "world_size": 4,
                        "backend": "gloo",
                        "network": "real",
                    }
                )
    return pd.DataFrame(rows)


ARGS = {"max_rel_gap": 0.02, "min_seeds": 3}
CLAIM_CASES = {
    # AllReduce mean 1.0: margin 0.02. Paired differences 0.005 +- 0.002 pass, 0.05 +- 0.002
    # fail, 0.01 +- 0.02 straddle the margin
    "e13_accumadam_within": (lambda: _finals(accum=(1.003, 1.105, 0.907)),
                             lambda: _finals(accum=(1.048, 1.15, 0.952)),
                             lambda: _finals(accum=(0.99, 1.13, 0.91))),
}


def test_claim_is_a_paired_interval_against_a_margin():
    assert e13.check_accumadam_within(_finals(accum=(0.5, 0.6, 0.4)), **ARGS).passed  # better
    v = e13.check_accumadam_within(_finals(accum=(1.003, 1.105, 0.907)), **ARGS)
    assert "paired diff +0.0050" in v.measured and "margin 0.0200" in v.measured


def test_claim_needs_paired_seeds_and_enough_of_them():
    df = _finals()
    with pytest.raises(ValueError, match="seeds"):
        e13.check_accumadam_within(df[df.seed < 2], **ARGS)
    assert e13.check_accumadam_within(df[df.seed < 2], max_rel_gap=0.2, min_seeds=2).verdict in (
        "PASS", "INCONCLUSIVE")
    unpaired = df[~((df.method == "accumadam-aer") & (df.seed == 0))]
    with pytest.raises(ValueError, match="pairs"):
        e13.check_accumadam_within(unpaired, **ARGS)
    with pytest.raises(ValueError, match="AccumAdam"):
        e13.check_accumadam_within(df[~df.method.str.startswith("accum")], **ARGS)


def test_summary_mean_two_sigma_and_paired_difference():
    s = e13.summary(_finals()).set_index(["task", "method"])
    assert s.loc[("digits", "AllReduce Adam"), "final loss (mean +- 2 sigma)"] == "1.0000 +- 0.2000"
    assert s.loc[("digits", "DAdam (AER)"), "loss - AllReduce (paired)"] == "0.1000 +- 0.0000"
    assert s.loc[("lm", "AllReduce Adam"), "accuracy (mean +- 2 sigma)"] == ""


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
        ({"lm_lr": 0.0}, "lm_lr"),
        ({"accum_iter": 0}, "accum_iter"),
        ({"lm_accum_lr_scale": -1.0}, "lm_accum_lr_scale"),
        ({"emulated": "yes"}, "emulated"),
        ({"backend": "mpi"}, "backend"),
        ({"backend": "nccl", "emulated": True}, "emulated network"),
    ],
)
def test_bad_parameters_name_the_parameter(bad, match):
    with pytest.raises(ValueError, match=match):
        e13.run(**bad)


@pytest.mark.timeout(240)
def test_tiny_end_to_end_run():
    df = e13.run(
        world_size=2,
        ranks_per_node=1,
        tasks=["digits", "lm"],
        methods=["allreduce-adam", "accumadam-aer"],
        seeds=[0],
        digits_iterations=3,
        lm_iterations=2,
        eval_every=2,
    )
    assert {"backend", "world_size", "network"} <= set(df.columns)
    assert (df.network == "real").all() and (df.backend == "gloo").all()
    f = e13.finals(df)
    assert len(f) == 4 and f.loss.notna().all()
    assert f[f.task == "digits"].accuracy.between(0, 1).all()
    train = df[df.record == "train"]
    assert train.groupby(["task", "method"]).iteration.max().to_dict() == {
        ("digits", "accumadam-aer"): 3,
        ("digits", "allreduce-adam"): 3,
        ("lm", "accumadam-aer"): 2,
        ("lm", "allreduce-adam"): 2,
    }
    assert (train.groupby(["task", "method"]).wall_s.diff().dropna() > 0).all()
    assert len(e13.summary(df)) == 4
    e13.plot(df)


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
