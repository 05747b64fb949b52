"""Named algorithms: a choice of registered advantage estimator and loss plus their settings.

``ALGORITHMS["ppo"]``, ``["grpo"]``, ``["dapo"]`` (defined in ``dapo.py``), ``["reinforce_pp"]``
give an :class:`AlgorithmPreset`. A trainer reads it instead of hard-coding an algorithm:

    preset = ALGORITHMS[cfg.algorithm]
    advantages, returns = compute_advantages(preset.advantage, ...)
    loss, metrics = policy_loss(preset.policy_loss, ..., **preset.policy_loss_kwargs())
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlinf_vla.algos.advantages import ADVANTAGES
from rlinf_vla.algos.losses import AGGREGATIONS, LOSSES
from rlinf_vla.algos.registry import Registry


@dataclass(frozen=True)
class AlgorithmPreset:
    """A named combination of registered pieces, validated on construction.

    Attributes:
        advantage: name in ``ADVANTAGES``.
        policy_loss: name in ``LOSSES``.
        clip_low: ε_low of the PPO clip.
        clip_high: ε_high; > ``clip_low`` is DAPO's clip-higher.
        dual_clip: c > 1 of the dual clip, or ``None``.
        agg: aggregation mode, a name in ``AGGREGATIONS``.
        use_critic: train a value head and add ``value_loss`` (PPO).
        normalize_std: divide group advantages by the group std (``grpo``).
        dynamic_sampling: drop groups whose scores are all equal (``dapo.dynamic_sampling``).
        overlong_buffer: DAPO's soft overlong punishment for text, as the fraction of the
            maximum generation length that forms the buffer (``dapo.overlong_penalty``), or
            ``None`` for none. Embodied trainers have no lengths and ignore it.
    """

    advantage: str
    policy_loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg: str = "token-mean"
    use_critic: bool = False
    normalize_std: bool = True
    dynamic_sampling: bool = False
    overlong_buffer: float | None = None

    def __post_init__(self) -> None:
        ADVANTAGES[self.advantage]  # raises with the known names
        LOSSES[self.policy_loss]
        AGGREGATIONS[self.agg]
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0.0:
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.overlong_buffer is not None and not 0.0 < self.overlong_buffer <= 1.0:
            raise ValueError(f"overlong_buffer must be in (0, 1], got {self.overlong_buffer}")

    def policy_loss_kwargs(self) -> dict[str, Any]:
        """The keyword settings of the policy loss: clip range, dual clip, aggregation."""
        return {
            "clip_low": self.clip_low,
            "clip_high": self.clip_high,
            "dual_clip": self.dual_clip,
            "agg": self.agg,
        }


ALGORITHMS: Registry[AlgorithmPreset] = Registry("algorithm")

# PPO: GAE with a critic; per-token mean.
ALGORITHMS.add("ppo", AlgorithmPreset(advantage="gae", use_critic=True))
# GRPO (Shao et al., 2024): group-normalised scores, no critic; each sequence weighs the same.
ALGORITHMS.add("grpo", AlgorithmPreset(advantage="grpo", agg="seq-mean-token-mean"))
# REINFORCE++ (Hu, 2025): globally whitened discounted returns with the PPO clip, no critic.
ALGORITHMS.add("reinforce_pp", AlgorithmPreset(advantage="reinforce_pp"))
