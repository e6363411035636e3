"""The suite's two workers (tests/conftest.py): its groups name real test modules, and every
test that builds a shaped virtual cluster sits in the one group that runs them one at a time."""

from __future__ import annotations

import re
from pathlib import Path

import conftest

TESTS = Path(__file__).parent
BUILDS_A_CLUSTER = re.compile(r'VirtualCluster\(|network="shaped"|SlurmCluster\(')


def test_the_groups_name_test_modules():
    modules = {p.stem for p in TESTS.glob("test_*.py")}
    assert set(conftest.SHAPED_MODULES) <= modules
    assert set(conftest.LONGEST_FIRST) - {"shaped-network"} <= modules
    assert conftest.worker_group("test_cluster") == "shaped-network"
    assert conftest.worker_group("test_netem") == "test_netem"


def test_every_test_that_builds_a_cluster_is_in_the_shaped_group():
    builders = {p.stem for p in TESTS.glob("test_*.py")
                if p.name != Path(__file__).name and BUILDS_A_CLUSTER.search(p.read_text())}
    assert builders and builders <= set(conftest.SHAPED_MODULES), builders
