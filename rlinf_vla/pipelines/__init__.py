"""Embodied training: env, rollout and actor workers on the runtime, and the runner loop.

``rlinf-vla train`` composes the ``train`` config, :func:`validate` checks it (pure) and
:func:`run` trains.
"""

from rlinf_vla.pipelines.config import TrainJob, validate
from rlinf_vla.pipelines.runner import EmbodiedRunner, run

__all__ = ["EmbodiedRunner", "TrainJob", "run", "validate"]
