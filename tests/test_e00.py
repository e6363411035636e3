"""E0 calibration: message sizes, fits, and its claims' synthetic PASS / FAIL cases."""

import json

import numpy as np
import pandas as pd
import pytest
from claimdata import with_repeats

from pipecomm.lab import claims
from pipecomm.lab.experiments import e00_calibrate as e0

SIZES = e0.message_sizes(4, 64 << 20, 4)


def _real(alpha=150e-6, beta=1 / 2.5e9, bump=0.0):
    n = np.array(SIZES, dtype=float)
    t = alpha + n * beta
    t = t * (1 + bump * (n >= (1 << 20)))  # a regime change the model cannot follow
    red = pd.DataFrame({"section": ["reduction"], "nbytes": [16 << 20], "time_s": [0.01]})
    real = pd.DataFrame({"section": "real", "nbytes": n.astype(int), "time_s": t,
                         "world_size": 2})
    return pd.concat([real, red], ignore_index=True)


def _emulated(bw_error=0.0, spread=0.01):
    rows = []
    for world in (2, 8):
        for n in e0.message_sizes(4, 4 << 20, 4):
            rows.append({"section": "emulated", "world_size": world, "nbytes": n, "pair": "0-1",
                         "time_s": 0.002 + n / (50e6 * (1 + bw_error)),
                         "emu_alpha_s": 0.002, "emu_bandwidth_Bps": 50e6})
    return with_repeats(pd.DataFrame(rows), spread)


ARGS = {"min_bytes": 65536, "tolerance": 0.1, "abs_tolerance_s": 0.0005, "world_sizes": [2, 8],
        "may_miss": "none"}
CLAIM_CASES = {
    # slower than configured by 30%: FAIL; 10% slower with +-25% repeats: cannot decide
    "e0_emulated_within": (lambda: _emulated(), lambda: _emulated(bw_error=-0.23),
                           lambda: _emulated(bw_error=-0.09, spread=0.25)),
}


def test_calibration_record_keeps_every_size():
    rec = e0.fit(_real())["per_size"]
    assert rec["nbytes"] == SIZES
    assert rec["one_way_s"][-1] == pytest.approx(150e-6 + SIZES[-1] / 2.5e9)


def test_emulated_check_absolute_bound_covers_small_messages():
    df = _emulated()
    df.loc[df.nbytes == 65536, "time_s"] += 0.0004  # +12% at 64 KiB, but 0.4 ms < 0.5 ms
    df = with_repeats(df)
    assert e0.check_emulated_within(df, **ARGS).verdict == claims.PASS
    assert e0.check_emulated_within(df, **{**ARGS, "abs_tolerance_s": 0.0}).verdict == claims.FAIL


def test_message_sizes():
    assert e0.message_sizes(4, 64, 4) == [4, 16, 64]
    assert e0.message_sizes(4, 100, 4) == [4, 16, 64, 100]
    with pytest.raises(ValueError):
        e0.message_sizes(0, 64, 4)
    with pytest.raises(ValueError):
        e0.message_sizes(4, 64, 1)


def test_fit_recovers_alpha_beta():
    f = e0.fit(_real(alpha=100e-6, beta=1 / 3e9))
    assert f["alpha_s"] == pytest.approx(100e-6, rel=0.05)
    assert f["bandwidth_Bps"] == pytest.approx(3e9, rel=0.05)


def test_emulated_check_needs_both_world_sizes():
    df = _emulated()
    with pytest.raises(ValueError, match="world sizes"):
        e0.check_emulated_within(df[df.world_size == 2], **ARGS)


@pytest.mark.parametrize(
    "bad, match",
    [({"backend": "mpi"}, "backend"), ({"backend": "nccl", "emulated": True}, "emulated network")],
)
def test_bad_backend_is_refused_before_starting_ranks(bad, match):
    with pytest.raises(ValueError, match=match):
        e0.run(**bad)


def test_host_links_from_the_host_section(tmp_path, monkeypatch):
    host = pd.DataFrame({"section": "host", "flows": [1, 7], "nbytes": 1 << 24,
                         "bandwidth_Bps": [2.0e9, 0.5e9]})
    df = pd.concat([_real(), host], ignore_index=True).assign(backend="gloo")
    # one link's rate: the ping-pong table's at its largest size, 64 MiB (150 us + n / 2.5 GB/s),
    # the rate the host model multiplies by host_links (cost.HostLink.rate_Bps)
    lone = (1 << 26) / (150e-6 + (1 << 26) / 2.5e9)
    assert e0.host_links(df) == pytest.approx(7 * 0.5e9 / lone)
    no_table = df[df.section != "real"]
    assert e0.host_links(no_table) == pytest.approx(7 * 0.5 / 2.0)  # the host section's own
    assert e0.host_links(_real()) is None
    df = pd.concat([_real(), host.assign(bandwidth_Bps=[2.0e9, 0.5 * lone / 2.0])],
                   ignore_index=True).assign(backend="gloo")
    f = e0.fit(df)
    assert f["host_links"] == pytest.approx(1.75) and "host_links" not in e0.fit(_real())
    # the real backend's LP model reads it from calibration.json
    from pipecomm.lab import results
    from pipecomm.lab.networks import cost

    path = tmp_path / "calibration.json"
    results.write_json(path, f)
    monkeypatch.setenv("PIPECOMM_CALIBRATION", str(path))
    link = cost.host_link()
    assert link.host_links == pytest.approx(1.75)
    assert 7 * 0.5 * lone / 2.0 == pytest.approx(link.host_links * link.rate_Bps)  # the chain's
    assert link.table[-1] == (SIZES[-1], pytest.approx(150e-6 + SIZES[-1] / 2.5e9))
    assert "7 links at once (host_links 1.75)" in e0.summary(df).link.iloc[-1]


#: the tiny run: its notebook executes it once (tests/test_notebooks.py shares the run)
TINY = dict(sizes_max=1 << 20, iters=2, warmup=1, emu_sizes_max=1 << 17, emu_world_sizes=[2],
            host_world_size=3, host_bytes=1 << 20)


def test_e0_through_papermill(notebook_run):
    """E0 end to end as run_all.sh runs it: every result file, the calibration, the host
    section on a local pool, a claim verdict."""
    run = notebook_run(e0, TINY)
    names = {p.name for p in run.out.iterdir()}
    assert {"data.csv", "figure.png", "figure.pdf", "notebook.ipynb", "params.json", "env.json",
            "calibration.json"} <= names
    env = json.loads((run.out / "env.json").read_text())
    assert env["profile"] == "cpu" and env["emulated_network"] is True
    assert env["world_sizes"] == [2, 3] and env["torch"].startswith("2.")  # 3: host probe
    assert json.loads((run.out / "params.json").read_text())["sizes_max"] == 1 << 20
    cal = json.loads((run.out / "calibration.json").read_text())
    assert cal["alpha_s"] >= 0 and cal["beta_s_per_byte"] >= 0  # a load spike can flatten it
    assert cal["host_links"] > 0
    assert cal["per_size"]["nbytes"] and len(cal["per_size"]["one_way_s"]) == len(
        cal["per_size"]["nbytes"])  # the calibration record (C0.1 is no longer a claim)
    table = claims.evaluate(claims.load_claims(), run.out.parent)
    verdicts = dict(zip(table.claim, table.verdict))
    # only p=2 was measured here; the claim needs 2 and 8: not decidable, nothing failed
    assert verdicts["C0.2"] == claims.NOT_RUN
    assert "not decidable on this data: no emulated measurements for world sizes [8]" in \
        dict(zip(table.claim, table.why))["C0.2"]
    host = run.df[run.df.section == "host"]
    assert list(host.flows) == [1, 2] and (host.bandwidth_Bps > 0).all()
    assert list(host.messages) == [1, 4]  # the chain streams host_messages per link
    assert e0.host_links(run.df) > 0


def test_host_parameters_are_checked():
    with pytest.raises(ValueError, match="host_world_size"):
        e0.run(host_world_size=2)
    with pytest.raises(ValueError, match="host_messages"):
        e0.run(host_messages=0)


def test_a_flat_emulated_fit_is_an_infinite_bandwidth_not_a_crash():
    """A load spike on the smaller of few large sizes can flatten the fit (beta 0): a fresh clone's
    E0 notebook once died on 1 / 0 in its summary."""
    emu = _emulated()
    emu["time_s"] = 0.002  # no size dependence at all
    fit = e0.fit_emulated(emu)
    assert len(fit) == 2 and np.isinf(fit.bandwidth_Bps).all()
    table = e0.summary(pd.concat([_real().assign(backend="gloo", network="real"), emu], ignore_index=True))
    assert len(table) == 3
