"""Math reasoning with verifier rewards: ``rlinf-vla math-grpo`` (docs/reasoning.md).

The same runtime and algorithms as the embodied trainer; only the adapters differ:

- :mod:`~rlinf_vla.reasoning.data`: problems from JSONL / Parquet or ``reasoning-gym``;
- :mod:`~rlinf_vla.reasoning.generation`: sampling groups of responses with a KV cache;
- :mod:`~rlinf_vla.reasoning.reward`: answer extraction and ``math-verify`` verification;
- :mod:`~rlinf_vla.reasoning.model`: loading, LoRA, memory-lean token log-probs;
- :mod:`~rlinf_vla.reasoning.workers` and :mod:`~rlinf_vla.reasoning.trainer`: the loop.
"""

from rlinf_vla.reasoning.config import MathGrpoJob, validate
from rlinf_vla.reasoning.trainer import MathGrpoRunner, run

__all__ = ["MathGrpoJob", "MathGrpoRunner", "run", "validate"]
