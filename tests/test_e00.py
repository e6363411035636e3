"""E0 calibration: message sizes, fits, and its claims' synthetic PASS / FAIL cases."""

import numpy as np
import pandas as pd
import pytest

from pipecomm.experiments import e00_calibrate as e0

SIZES = e0.message_sizes(4, 64 << 20, 4)


def _real(alpha=150e-6, beta=1 / 2.5e9, bump=0.0):
    n = np.array(SIZES, dtype=float)
    t = alpha + n * beta
    t = t * (1 + bump * (n >= (1 << 20)))  # a regime change the model cannot follow
    red = pd.DataFrame({"section": ["reduction"], "nbytes": [16 << 20], "time_s": [0.01]})
    real = pd.DataFrame({"section": "real", "nbytes": n.astype(int), "time_s": t,
                         "world_size": 2})
    return pd.concat([real, red], ignore_index=True)


def _emulated(bw_error=0.0):
    rows = []
    for world in (2, 8):
        for n in e0.message_sizes(4, 4 << 20, 4):
            rows.append({"section": "emulated", "world_size": world, "nbytes": n,
                         "time_s": 0.002 + n / (50e6 * (1 + bw_error)),
                         "emu_alpha_s": 0.002, "emu_bandwidth_Bps": 50e6})
    return pd.DataFrame(rows)


CLAIM_CASES = {
    "e0_fit_within": (lambda: _real(), lambda: _real(bump=1.0)),
    "e0_emulated_within": (lambda: _emulated(), lambda: _emulated(bw_error=-0.3)),
}


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
        e0.check_emulated_within(df[df.world_size == 2])


@pytest.mark.parametrize(
    "bad, match",
    [({"backend": "mpi"}, "backend"), ({"backend": "nccl", "emulated": True}, "emulated network")],
)
def test_bad_backend_is_refused_before_starting_ranks(bad, match):
    with pytest.raises(ValueError, match=match):
        e0.run(**bad)
