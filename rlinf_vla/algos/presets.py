"""Named algorithms: a choice of registered advantage estimator and loss plus their settings.

Each algorithm is one YAML file in ``rlinf_vla/configs/algo/`` (``ppo``, ``grpo``, ``dapo``,
``reinforce_pp``, ``rloo``, ``dagger``), which is also the ``algo`` config group of
``rlinf-vla train`` and ``rlinf-vla math-grpo``: ``algo=rloo`` picks it in either.
``ALGORITHMS[name]`` gives its :class:`AlgorithmPreset`. Both trainers read the preset instead
of branching on the name: the estimator's declared kind says how they call it
(:func:`estimate`), and ``training.objective`` calls ``LOSSES.policy(preset.policy_loss)``.

Adding an algorithm: register its function with what it declares (an estimator in
``ADVANTAGES`` with its kind, a loss in ``LOSSES`` with its term), write its YAML and its test
(docs/algorithms.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rlinf_vla.algos.advantages import ADVANTAGES, KIND_INPUTS, SETTINGS
from rlinf_vla.algos.losses import AGGREGATIONS, LOSSES
from rlinf_vla.algos.registry import Registry

#: The folder of the algorithms' YAML files.
PRESET_DIR = Path(__file__).resolve().parent.parent / "configs" / "algo"


def estimator_kind(name: str | None) -> str:
    """The kind the advantage estimator ``name`` declared at registration, which says how both
    trainers call it (:data:`~rlinf_vla.algos.advantages.KIND_INPUTS`):

    - ``group``: one score per episode or response and ``group_size`` (``grpo``, ``rloo``);
    - ``critic``: rewards and a critic's ``values`` (``gae``);
    - ``return``: per-step rewards alone (``reinforce_pp``);
    - ``none``: no estimator (``None``: an imitation algorithm, ``dagger``).
    """
    return "none" if name is None else ADVANTAGES[name].kind


@dataclass(frozen=True)
class AlgorithmPreset:
    """A named combination of registered pieces, validated on construction.

    Attributes:
        advantage: name in ``ADVANTAGES`` (``gae``, ``grpo``, ``rloo``, ``reinforce_pp``); its
            declared kind says how the trainers call it (:func:`estimator_kind`). ``None`` for
            an imitation algorithm.
        policy_loss: name of a ``policy`` loss in ``LOSSES`` (``ppo``), called by both
            trainers with the keyword interface of ``ppo_policy_loss``.
        clip_low: ε_low of the PPO clip.
        clip_high: ε_high; > ``clip_low`` is DAPO's clip-higher.
        dual_clip: c > 1 of the dual clip, or ``None``.
        agg: aggregation mode of the policy, entropy and KL terms, a name in ``AGGREGATIONS``.
        use_critic: train a value head and add ``value_loss`` (needed by ``gae``).
        normalize_std: ``grpo`` divides group advantages by the group std (``False``: Dr. GRPO);
            for estimators that declare it.
        dynamic_sampling: drop groups whose scores are all equal (``dapo.dynamic_sampling``).
        overlong_buffer: DAPO's soft overlong punishment for text, as the fraction of the
            maximum generation length that forms the buffer, or ``None``. Embodied episodes
            have no lengths to punish: ``train`` leaves it out.
        gamma: discount per step (embodied: per chunk; text: per token).
        lam: GAE λ, for estimators that declare it (``gae``).
        kl_in_reward: with a KL coefficient, fold the per-token KL to the reference into the
            reward (REINFORCE++) instead of adding a loss term.
        imitation: the policy learns the env's scripted expert's actions on the states it
            visits, with its own supervised loss, instead of a policy gradient (``dagger``,
            ``train`` only); no advantage, critic or policy loss.
    """

    advantage: str | None = None
    policy_loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg: str = "token-mean"
    use_critic: bool = False
    normalize_std: bool = True
    dynamic_sampling: bool = False
    overlong_buffer: float | None = None
    gamma: float = 1.0
    lam: float = 1.0
    kl_in_reward: bool = False
    imitation: bool = False

    def __post_init__(self) -> None:
        if self.imitation:
            self._check_imitation()
            return
        if self.advantage is None:
            raise ValueError(
                f"advantage must name an estimator (one of {ADVANTAGES.names()}), got null"
            )
        ADVANTAGES[self.advantage]  # raises with the known names
        LOSSES.policy(self.policy_loss)  # raises with the policy losses
        AGGREGATIONS[self.agg]
        bad = [
            f"{key} {rule}, got {getattr(self, key)}"
            for key, ok, rule in [
                ("clip_low", 0.0 <= self.clip_low < 1.0, "must lie in [0, 1)"),
                ("clip_high", self.clip_high >= 0.0, "must be >= 0"),
                (
                    "dual_clip",
                    self.dual_clip is None or self.dual_clip > 1.0,
                    "must be > 1 or null",
                ),
                (
                    "overlong_buffer",
                    self.overlong_buffer is None or 0.0 <= self.overlong_buffer <= 1.0,
                    "must lie in [0, 1] or be null",
                ),
                ("gamma", 0.0 <= self.gamma <= 1.0, "must lie in [0, 1]"),
                ("lam", 0.0 <= self.lam <= 1.0, "must lie in [0, 1]"),
                (
                    "use_critic",
                    self.use_critic or estimator_kind(self.advantage) != "critic",
                    f"must be true with advantage={self.advantage} (it needs values)",
                ),
                (
                    "dynamic_sampling",
                    not self.dynamic_sampling or self.uses_groups,
                    "needs a group advantage (e.g. grpo, rloo)",
                ),
            ]
            if not ok
        ]
        if bad:
            raise ValueError("; ".join(bad))

    def _check_imitation(self) -> None:
        bad = [
            f"{key} {rule}, got {getattr(self, key)}"
            for key, ok, rule in [
                ("advantage", self.advantage is None, "must be null with imitation"),
                ("use_critic", not self.use_critic, "must be false with imitation"),
                ("dynamic_sampling", not self.dynamic_sampling, "must be false with imitation"),
            ]
            if not ok
        ]
        if bad:
            raise ValueError("; ".join(bad))

    @property
    def uses_groups(self) -> bool:
        """The advantage compares the members of a group (``algo.group_size`` >= 2)."""
        return estimator_kind(self.advantage) == "group"

    def effective_keys(self) -> set[str]:
        """The preset keys that change something for this algorithm (``lam`` and
        ``normalize_std`` only for estimators that declare them, ``dynamic_sampling`` only for
        groups; only ``imitation`` itself for an imitation algorithm)."""
        if self.imitation:
            return {"imitation"}
        keys = set(PRESET_KEYS) - {*SETTINGS, "dynamic_sampling"}
        keys |= ADVANTAGES[self.advantage].settings
        if self.uses_groups:
            keys.add("dynamic_sampling")
        return keys


#: The keys of a preset, as they appear in its YAML and in the ``algo`` section.
PRESET_KEYS = tuple(f.name for f in dataclasses.fields(AlgorithmPreset))


def load_preset(path: Path) -> AlgorithmPreset:
    """The preset of one algorithm's YAML file (``name`` must be the file's stem)."""
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    name = data.pop("name", None)
    if name != path.stem:
        raise ValueError(f"{path}: name must be {path.stem!r}, got {name!r}")
    unknown = sorted(set(data) - set(PRESET_KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown} (known: {', '.join(PRESET_KEYS)})")
    try:
        return AlgorithmPreset(**data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


ALGORITHMS: Registry[AlgorithmPreset] = Registry("algorithm")
for _path in sorted(PRESET_DIR.glob("*.yaml")):
    ALGORITHMS.add(_path.stem, load_preset(_path))


class _FromPreset:
    """The default of a preset key in an ``algo`` section: the named algorithm's value."""

    def __repr__(self) -> str:
        return "<the algorithm's preset>"


FROM_PRESET: Any = _FromPreset()


@dataclass
class AlgorithmSection:
    """The keys an ``algo`` config section shares in both trainers (``AlgoConfig`` of ``train``
    and ``MathAlgoConfig`` of ``math-grpo`` extend it with their own settings).

    ``name`` picks the algorithm, ``rlinf_vla/configs/algo/<name>.yaml`` (docs/algorithms.md).
    The preset keys (``advantage``, ``policy_loss``, ``clip_low``, ``clip_high``,
    ``dual_clip``, ``agg``, ``use_critic``, ``normalize_std``, ``dynamic_sampling``,
    ``overlong_buffer``, ``gamma``, ``lam``, ``kl_in_reward``, ``imitation``:
    :class:`AlgorithmPreset`)
    default to that file's values and can be overridden one by one.
    """

    name: str = "ppo"
    advantage: str | None = FROM_PRESET
    policy_loss: str = FROM_PRESET
    clip_low: float = FROM_PRESET
    clip_high: float = FROM_PRESET
    dual_clip: float | None = FROM_PRESET
    agg: str = FROM_PRESET
    use_critic: bool = FROM_PRESET
    normalize_std: bool = FROM_PRESET
    dynamic_sampling: bool = FROM_PRESET
    overlong_buffer: float | None = FROM_PRESET
    gamma: float = FROM_PRESET
    lam: float = FROM_PRESET
    kl_in_reward: bool = FROM_PRESET
    imitation: bool = FROM_PRESET

    #: trainer keys of a critic, which change nothing without one: key -> (test, why)
    CRITIC_KEYS: ClassVar[dict[str, tuple[Callable[[AlgorithmPreset], bool], str]]] = {
        "value_coef": (lambda p: p.use_critic, "needs a critic (use_critic)"),
        "value_clip": (lambda p: p.use_critic, "needs a critic (use_critic)"),
        "value_lr": (lambda p: p.use_critic, "needs a critic (use_critic)"),
        "normalize_advantages": (
            lambda p: estimator_kind(p.advantage) == "critic",
            "whitens a critic's advantages",
        ),
    }

    def fill_preset(self, path: str = "algo") -> str | None:
        """Fill the preset keys left at their default from the named algorithm; returns the
        message naming every bad preset value (``None``: all good), for the caller to report
        with its other checks."""
        try:
            fill_from_preset(self)
        except ValueError as e:
            return preset_error(path, e)
        return None

    @property
    def uses_groups(self) -> bool:
        """The advantage compares the members of a group (``False`` for an unknown one)."""
        return self.advantage in ADVANTAGES and estimator_kind(self.advantage) == "group"

    @property
    def preset(self) -> AlgorithmPreset:
        """The algorithm as configured (its preset with this section's overrides)."""
        return AlgorithmPreset(**{key: getattr(self, key) for key in PRESET_KEYS})


def fill_from_preset(section: Any) -> AlgorithmPreset:
    """Set every preset key of the ``algo`` dataclass ``section`` still at
    :data:`FROM_PRESET` to the value of ``ALGORITHMS[section.name]``, and return the resolved
    preset (validated: a bad value raises ``ValueError`` naming the key)."""
    base = ALGORITHMS[section.name]
    for key in PRESET_KEYS:
        if getattr(section, key) is FROM_PRESET:
            setattr(section, key, getattr(base, key))
    return AlgorithmPreset(**{key: getattr(section, key) for key in PRESET_KEYS})


def preset_error(section: str, error: Exception) -> str:
    """A preset's ``ValueError`` with each offending key named as ``<section>.<key>``."""
    parts = str(error.args[0] if error.args else error).split("; ")
    return "; ".join(
        f"{section}.{p}" if p.split(" ", 1)[0] in PRESET_KEYS else f"{section}: {p}" for p in parts
    )


def ineffective_keys(
    section: Any,
    preset: AlgorithmPreset,
    conditional: dict[str, tuple[Any, str]],
    name: str,
    path: str = "algo",
) -> list[str]:
    """Messages for the keys ``section`` (the ``algo`` mapping as given) sets that change nothing
    for the configured algorithm: preset keys outside :meth:`AlgorithmPreset.effective_keys`
    and the trainer's ``conditional`` keys (``key -> (test(preset), why)``) whose test fails."""
    given = set(section or ())
    messages = [
        f"{path}.{key} has no effect with {path}.advantage={preset.advantage} ({name})"
        for key in sorted((given & set(PRESET_KEYS)) - preset.effective_keys())
    ]
    messages += [
        f"{path}.{key} has no effect for {name}: {why}"
        for key, (test, why) in conditional.items()
        if key in given and not test(preset)
    ]
    return messages


def estimate(algo: Any, **inputs: Any) -> tuple[Any, Any]:
    """``ADVANTAGES[algo.advantage]`` called with ``inputs``, which must be the keywords of its
    declared kind (:data:`~rlinf_vla.algos.advantages.KIND_INPUTS`, ``None`` for those the
    trainer has none of), and the preset settings it declares, read from the ``algo`` section
    (or preset) ``algo``. Returns its ``(advantages, returns)``."""
    estimator = ADVANTAGES[algo.advantage]
    expected = KIND_INPUTS[estimator.kind]
    if set(inputs) != expected:
        raise TypeError(
            f"a {estimator.kind} estimator ({algo.advantage}) takes {sorted(expected)}, "
            f"got {sorted(inputs)}"
        )
    return estimator(**inputs, **{key: getattr(algo, key) for key in sorted(estimator.settings)})
