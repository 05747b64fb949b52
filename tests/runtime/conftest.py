"""Fixtures for runtime tests: a ``Cluster`` per test, on the suite's shared Ray instance
(tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _pickle_test_module_by_value(request: pytest.FixtureRequest) -> None:
    # Worker classes defined in a test module must reach the Ray worker processes, which
    # cannot import the test module by name.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(request.module)


@pytest.fixture
def cluster():
    # Per test (cheap: it joins the suite's running Ray instance), so that a GPU test gets the
    # instance that sees the GPUs (tests/conftest.py) and the tests around it the one that does not.
    from rlinf_vla.runtime import Cluster

    with Cluster(num_cpus=2) as c:
        yield c
