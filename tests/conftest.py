"""Test-suite wide settings: markers that skip cleanly when their hardware is missing, the
``ray`` mark (the tests that start Ray workers share one Ray instance; the others start none),
a check that no test leaves the process's torch thread count changed, and the time per test
file at the end of a full run."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The files that take longest (measured on the 2-core CI machine, longest first). With
# pytest-xdist (`-n 2 --dist loadfile --no-loadscope-reorder`, as `RLINF_TEST_WORKERS=2 bash
# scripts/test.sh` runs the suite) each process takes the next file when it is done with one: these start first, so that the run
# does not end with one process alone on a long file while the other has nothing left.
_LONG_FILES_FIRST = (
    "tests/envs/test_libero.py",
    "tests/pipelines/test_learning.py",
    "tests/pipelines/test_train.py",
    "tests/faults/test_train_faults.py",
    "tests/eval/test_run.py",
    "tests/faults/test_eval_faults.py",
    "tests/pipelines/test_checkpoints.py",
    "tests/reasoning/test_algorithms.py",
    "tests/envs/test_maniskill.py",
    "tests/envs/test_contract.py",
    "tests/envs/test_experts.py",
    "tests/pipelines/test_collect.py",
    "tests/runtime/test_channel.py",
)


def _long_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: the tests of ``_LONG_FILES_FIRST`` first, in that order, then
    the others as collected (a stable sort: the order inside a file is kept)."""
    rank = {path: i for i, path in enumerate(_LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_ray_tests(items)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a process of `pytest -n N`
        _long_files_first(items)
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _torch_threads_unchanged(request: pytest.FixtureRequest):
    """A test (or the library code it calls) that changes ``torch.set_num_threads`` for good
    changes the speed and the floating-point results of every later test in the process: the
    learning tests then train a different policy than they do alone."""
    import torch

    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    if after != before:
        torch.set_num_threads(before)
        pytest.fail(
            f"{request.node.nodeid} left torch's thread count at {after} (it was {before})",
            pytrace=False,
        )


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if it starts Ray or makes a ``Cluster`` (even on a Ray instance that is
    already running): for bad input that must be rejected before anything starts."""
    import ray

    from rlinf_vla.runtime import Cluster

    def refuse(*args, **kwargs):
        raise AssertionError("a cluster was started for an invalid config")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(Cluster, "__init__", refuse)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "ray: starts Ray workers (a Cluster, a WorkerGroup, an in-process `rlinf-vla` run); "
        "gets the suite's shared Ray instance",
    )


# Fixtures that hand a test a ``Cluster``: a test that takes one is marked ``ray`` here.
_CLUSTER_FIXTURES = {"cluster", "ray_cluster"}


def _mark_ray_tests(items: list[pytest.Item]) -> None:
    for item in items:
        if _CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)


def _uses_ray(item: pytest.Item) -> bool:
    return item.get_closest_marker("ray") is not None


@pytest.fixture(scope="session")
def _session_clusters():
    started: list = []
    yield started
    for cluster in started:
        cluster.shutdown()


def _start_shared_ray(clusters: list, gpus: bool) -> None:
    """Make the running Ray instance the one for a test with (``gpus``) or without GPUs:
    start it, or stop and start it again when it has the other devices."""
    import ray

    if ray.is_initialized() and (ray.cluster_resources().get("GPU", 0) > 0) != gpus:
        for cluster in clusters:
            cluster.shutdown()
        clusters.clear()
        ray.shutdown()
    if not ray.is_initialized():
        from rlinf_vla.runtime import Cluster

        clusters.append(Cluster(num_cpus=2, num_gpus=None if gpus else 0))


def _wants_gpus(item: pytest.Item) -> bool:
    return "gpu" in item.keywords and _cuda_available()


@pytest.fixture(scope="module", autouse=True)
def _ray_for_module_fixtures(request: pytest.FixtureRequest, _session_clusters: list) -> None:
    """Start the shared Ray instance before the module-scoped fixtures of a module with a
    ``ray`` test (a trained run, a module's ``Cluster``), so that they use it too."""
    first = next(
        (
            i
            for i in request.session.items
            if getattr(i, "module", None) is request.module and _uses_ray(i)
        ),
        None,
    )
    if first is not None:
        _start_shared_ray(_session_clusters, _wants_gpus(first))


@pytest.fixture(autouse=True)
def _one_ray_instance(request: pytest.FixtureRequest, _session_clusters: list) -> None:
    """The tests marked ``ray`` share one local Ray instance (a ``Cluster`` uses the instance
    it finds running): starting and stopping one costs about 6 s, and the suite starts dozens
    of runs. A test that shuts it down (the multi-node tests make their own) gets a new one
    for the tests after it. Tests without the mark start no Ray at all.

    The instance has 2 CPUs on every machine, and GPUs only for the tests marked ``gpu``: on a
    CUDA machine the other tests still place their workers on CPU slots, as in CI. Between a
    GPU test and a CPU test the instance is started again with the other devices."""
    if _uses_ray(request.node):
        _start_shared_ray(_session_clusters, _wants_gpus(request.node))


class UnmarkedRayWarning(pytest.PytestWarning):
    """A test started Ray workers without the ``ray`` mark."""


@pytest.fixture(autouse=True)
def _no_ray_without_the_mark(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Warn about a test that makes a ``Cluster`` or calls ``ray.init`` without the ``ray``
    mark: it starts (and stops) a Ray instance of its own, or passes only when an earlier test
    left the shared one running."""
    if _uses_ray(request.node):
        yield
        return
    import ray

    from rlinf_vla.runtime import Cluster

    started: list[str] = []
    init, cluster_init = ray.init, Cluster.__init__

    def spy_init(*args, **kwargs):
        started.append("ray.init")
        return init(*args, **kwargs)

    def spy_cluster_init(self, *args, **kwargs):
        out = cluster_init(self, *args, **kwargs)
        started.append("Cluster")  # made: a Cluster refused before Ray starts is no start
        return out

    monkeypatch.setattr(ray, "init", spy_init)
    monkeypatch.setattr(Cluster, "__init__", spy_cluster_init)
    yield
    if started:
        request.node.warn(
            UnmarkedRayWarning(
                f"started Ray ({', '.join(sorted(set(started)))}) without the `ray` mark: "
                "mark it `@pytest.mark.ray` so that it gets the suite's shared instance"
            )
        )


@pytest.fixture
def no_ffmpeg(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine where imageio's FFmpeg backend (``imageio-ffmpeg``) is not installed."""
    import importlib.util

    find_spec = importlib.util.find_spec

    def without_ffmpeg(name: str, *args, **kwargs):
        return None if name == "imageio_ffmpeg" else find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without_ffmpeg)


@pytest.fixture
def offline_without_physx_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A machine without network on which SAPIEN's PhysX GPU library (ManiSkill's GPU
    simulation) was never downloaded."""
    requests = pytest.importorskip("requests")
    physx = pytest.importorskip("sapien.physx")

    def offline(*args, **kwargs):
        raise requests.ConnectionError("Failed to resolve 'github.com'")

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(physx.requests, "get", offline)


#: A run of at least this many tests ends with its time per test file (CI shows the end of the
#: output; the per-test list, ``--durations``, does not add up a file's many short tests).
_FILE_TIMES_MIN_TESTS = 200


def pytest_terminal_summary(terminalreporter: Any) -> None:
    seconds: dict[str, float] = defaultdict(float)
    tests = 0
    for reports in terminalreporter.stats.values():
        for report in reports:
            duration = getattr(report, "duration", None)
            nodeid = getattr(report, "nodeid", "")
            if duration is None or not nodeid:
                continue
            seconds[nodeid.split("::", 1)[0]] += duration
            tests += getattr(report, "when", None) == "call"
    if tests < _FILE_TIMES_MIN_TESTS:
        return
    total = sum(seconds.values())
    terminalreporter.write_sep("=", f"time per test file ({total / 60:.1f} min in tests)")
    for path, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{s:8.1f} s {100 * s / total:5.1f} %  {path}")
