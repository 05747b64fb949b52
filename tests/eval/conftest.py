"""Fixtures of the evaluation tests: a ``Cluster`` per module (on the suite's shared Ray instance),
composed eval jobs."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
os.environ.setdefault("MS_SKIP_ASSET_DOWNLOAD_PROMPT", "1")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance the eval runs of a module share (``Cluster`` reuses it)."""
    from rlinf_vla.runtime import Cluster

    with Cluster(num_cpus=2) as c:
        yield c


def eval_job(*overrides: str):
    """``rlinf-vla eval <overrides>`` composed and validated (nothing started)."""
    from rlinf_vla.cli import compose
    from rlinf_vla.eval import validate

    return validate(compose("eval", [*overrides, "cluster.num_cpus=2", "eval.progress=false"]))
