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
