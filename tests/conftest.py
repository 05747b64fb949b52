"""Test-suite wide settings: markers that skip cleanly when their hardware is missing, and a
check that no test leaves the process's torch thread count changed."""

from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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


# Tests in these folders start Ray workers (`rlinf-vla train`, `eval`, `math-grpo` runs, the
# runtime's own tests).
_RAY_TEST_DIRS = {"pipelines", "eval", "reasoning", "runtime"}


@pytest.fixture(scope="session")
def _session_clusters():
    started: list = []
    yield started
    for cluster in started:
        cluster.shutdown()


@pytest.fixture(autouse=True)
def _one_ray_instance(request: pytest.FixtureRequest, _session_clusters: list) -> None:
    """The tests that start Ray workers share one local Ray instance (a ``Cluster`` uses the
    instance it finds running): starting and stopping one costs about 6 s, and the suite starts
    dozens of runs. A test that shuts it down (the multi-node tests make their own) gets a
    new one for the tests after it.

    The instance has 2 CPUs on every machine, and GPUs only for the tests marked ``gpu``: on a
    CUDA machine the other tests still place their workers on CPU slots, as in CI. Between a
    GPU test and a CPU test the instance is started again with the other devices."""
    if request.node.path.parent.name not in _RAY_TEST_DIRS:
        return
    import ray

    gpus = "gpu" in request.node.keywords and _cuda_available()
    if ray.is_initialized() and (ray.cluster_resources().get("GPU", 0) > 0) != gpus:
        for cluster in _session_clusters:
            cluster.shutdown()
        _session_clusters.clear()
        ray.shutdown()
    if not ray.is_initialized():
        from rlinf_vla.runtime import Cluster

        _session_clusters.append(Cluster(num_cpus=2, num_gpus=None if gpus else 0))


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
