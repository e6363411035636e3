"""Every notebook's defaults run every time (issue 29, item 10): the emulated network each
experiment's defaults ask netem.check_host to accept is slower than this kind of host's real
ring step with a margin, so that a quiet 2-core host passes the check in every run.

The host's real step is bounded by what a quiet 2-core host measured at its worst: 1.31 ms for
a 4 KiB ring step between 4 ranks (the refusal issue 29 reports), and at most about 0.5 ms
between 2 ranks, plus the bytes at 500 MB/s (a 1 MiB step took up to 1.6 ms between 4 ranks;
docs/network_model.md, "Quick defaults", has the 20-run measurements).
"""

from __future__ import annotations

import contextlib
import importlib

import pytest

from pipecomm.lab.networks import kinds as network
from pipecomm.lab.networks import netem

HOST_STEP_S = {2: 0.5e-3, 4: 1.31e-3}  # worst real ring step of a few KiB, quiet 2-core host
HOST_BANDWIDTH_BPS = 500e6
MARGIN = 1.5  # the emulated step must take at least this many times the host's worst step

CHECKED = ["e02_collectives_vs_size", "e03_collectives_vs_ranks", "e04_lp_block_size",
           "e06_pipesgd_timing_model", "e10_topology_comm_time", "e11_runtime_model",
           "e12_dadam_scaling"]


class _Stop(Exception):
    pass


def pools_of(module, params: dict) -> list[tuple]:
    """The (world_size, network, sizes, ranks_per_node) of every emulated pool the run opens
    first (its host check), without running anything."""
    seen = []

    @contextlib.contextmanager
    def record(world_size, network, smallest_bytes, *, ranks_per_node=None, timeout_s=120.0):
        seen.append((world_size, network, sorted({max(1, int(smallest_bytes)), 1 << 20}),
                     ranks_per_node))
        raise _Stop
        yield  # pragma: no cover

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(network, "emulated_pool", record)
        with contextlib.suppress(_Stop):
            module.run(**params)
    return seen


def host_step_s(world_size: int, nbytes: int) -> float:
    """The worst real ring step of ``nbytes`` between ``world_size`` (<= 4) ranks."""
    return HOST_STEP_S[2 if world_size <= 2 else 4] + nbytes / HOST_BANDWIDTH_BPS


def short_of_margin(world_size: int, net: netem.Network, sizes: list[int],
                    rpn: int | None) -> list[str]:
    out = []
    for _, _, inter in netem.host_check._levels(net, world_size, rpn):
        for n in sizes:
            emulated, real = net.transfer_time(n, inter_node=inter), host_step_s(world_size, n)
            if emulated < MARGIN * real:
                out.append(f"p={world_size} {n} B {'inter' if inter else 'intra'}: emulated "
                           f"{emulated * 1e3:.2f} ms < {MARGIN} x {real * 1e3:.2f} ms")
    return out


@pytest.mark.parametrize("name", CHECKED)
def test_notebook_defaults_leave_the_host_check_a_margin(name):
    module = importlib.import_module(f"pipecomm.lab.experiments.{name}")
    per_world = [{"world_sizes": [w]} for w in module.DEFAULTS.get("world_sizes", [])] or [{}]
    pools = [pool for extra in per_world for pool in pools_of(module, {**module.DEFAULTS,
                                                                        **extra})]
    assert pools, f"{name}'s defaults opened no checked pool"
    problems = [p for pool in pools for p in short_of_margin(*pool)]
    assert not problems, problems


def test_e0_emulated_defaults_leave_a_margin():
    from pipecomm.lab.experiments import e00_calibrate as e0

    d = e0.DEFAULTS
    net = netem.Network(d["emu_alpha_s"], d["emu_bandwidth_Bps"])
    for world in d["emu_world_sizes"]:
        assert not short_of_margin(world, net, [d["sizes_min"], 1 << 20], None)


def test_the_old_e2_default_is_refused():
    """E2's former 1 ms at p = 4 is what the host check refused (1.31 ms against 1.04 ms)."""
    assert short_of_margin(4, netem.Network(1e-3, 100e6), [4096], None)


def test_e14_default_host_check_takes_the_best_of_ten_chains():
    """The cluster check of notebook 14's defaults (every node link busy against one alone,
    best of ``link_iters`` repeats) kept 94-99% of a link at 5 repeats and 96-99% at 10 over
    20 runs each: the default takes 10 at 20 MB/s (a slower link did not help: 87-97% at
    10 MB/s)."""
    from pipecomm.lab.experiments import e14_emulator_vs_shaped as e14

    assert e14.DEFAULTS["link_iters"] >= 10 and e14.DEFAULTS["bandwidth_Bps"] <= 20e6
