"""Shared fixtures: rank pools kept alive for the whole session (starting ranks costs seconds)."""

from __future__ import annotations

import pytest

from pipecomm.lab import launch

_POOLS: dict[tuple, launch.Ranks] = {}


@pytest.fixture(scope="session")
def pool():
    """``pool(world_size, network=None, ranks_per_node=None)`` -> a live, reused ``Ranks``.

    Rank functions must live in an importable module (``tests/rankfns_*.py``).
    A pool whose run failed restarts by itself on its next run.
    """

    def get(world_size: int, network=None, ranks_per_node: int | None = None) -> launch.Ranks:
        key = (world_size, repr(network), ranks_per_node)
        if key not in _POOLS:
            _POOLS[key] = launch.Ranks(world_size, network=network, ranks_per_node=ranks_per_node)
        return _POOLS[key]

    yield get
    for ranks in _POOLS.values():
        ranks.close()
    _POOLS.clear()
