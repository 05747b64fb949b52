"""Advantage estimators, registered by name in :data:`ADVANTAGES`.

Every estimator takes keyword tensors and returns ``(advantages, returns)``:

- ``advantages``: what the policy loss multiplies the ratio by;
- ``returns``: the return estimate before any baseline is subtracted (the value target for
  ``gae``, the scores themselves for ``grpo`` / ``rloo``, the discounted return for
  ``reinforce_pp``).

Both are computed without gradient. Time-series estimators (``gae``, ``reinforce_pp``) are
time-major, ``[T, B]``: step ``t`` of env (or sequence) ``b``; text callers pass ``x.T``.
Group estimators (``grpo``, ``rloo``) take one score per episode or sequence, ``[N]``, where
consecutive blocks of ``group_size`` share a prompt or a reset state.

Each estimator declares at registration its *kind*, which fixes the keywords both trainers
call it with (:data:`KIND_INPUTS`), and the preset settings it takes besides
(:data:`SETTINGS`)::

    @ADVANTAGES.register("grpo", kind="group", settings=("normalize_std",))
    def grpo(*, scores, group_size, normalize_std=True): ...

    ADVANTAGES["grpo"].kind        # "group"
    ADVANTAGES["grpo"](scores=s, group_size=4)   # calls the function
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor

from rlinf_vla.algos.masked import whiten
from rlinf_vla.algos.registry import Registry

EstimatorKind = Literal["critic", "group", "return"]

#: The keywords a trainer passes to an estimator of each kind, every one of them each time
#: (``None`` where it has none, e.g. ``final_values`` in ``math-grpo``):
#:
#: - ``critic``: per-step ``rewards``, ``terminated``, ``truncated`` ``[T, B]``, a critic's
#:   ``values`` ``[T+1, B]``, ``final_values`` ``[T, B] | None`` of truncated episodes and the
#:   discount ``gamma`` (as :func:`gae`);
#: - ``group``: one score per episode or response, ``scores [N]``, and ``group_size``
#:   (as :func:`grpo`);
#: - ``return``: per-step ``rewards`` ``[T, B]``, the valid ``mask`` and episode ends ``dones``
#:   ``[T, B] | None``, ``gamma``, and a per-step ``kl`` ``[T, B] | None`` to fold into the
#:   reward with ``kl_coef`` (as :func:`reinforce_pp`).
KIND_INPUTS: dict[str, frozenset[str]] = {
    "critic": frozenset({"rewards", "values", "terminated", "truncated", "final_values", "gamma"}),
    "group": frozenset({"scores", "group_size"}),
    "return": frozenset({"rewards", "mask", "dones", "gamma", "kl", "kl_coef"}),
}

#: The preset settings (``AlgorithmPreset`` keys) an estimator may declare that it takes: the
#: trainers pass it those it declares, and refuse the others in a config as having no effect.
SETTINGS = ("lam", "normalize_std")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator: its function and what it declared.

    Attributes:
        fn: the function, ``fn(**inputs) -> (advantages, returns)``.
        kind: ``critic``, ``group`` or ``return``: the keywords the trainers pass
            (:data:`KIND_INPUTS`).
        settings: the preset settings (:data:`SETTINGS`) it takes besides.
    """

    fn: Callable[..., tuple[Tensor, Tensor]]
    kind: EstimatorKind
    settings: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.kind not in KIND_INPUTS:
            raise ValueError(
                f"estimator kind {self.kind!r} is not one of {', '.join(sorted(KIND_INPUTS))}"
            )
        unknown = sorted(set(self.settings) - set(SETTINGS))
        if unknown:
            raise ValueError(
                f"unknown estimator setting(s) {unknown}; known: {', '.join(SETTINGS)}"
            )

    def __call__(self, **kwargs: Any) -> tuple[Tensor, Tensor]:
        return self.fn(**kwargs)


class Estimators(Registry[Estimator]):
    """The registry of advantage estimators, each registered with its declared kind."""

    def register(
        self, name: str, *, kind: EstimatorKind, settings: tuple[str, ...] = ()
    ) -> Callable[[F], F]:
        """Decorator: ``@ADVANTAGES.register("name", kind=..., settings=(...))`` registers the
        function as an :class:`Estimator` and leaves it unchanged."""

        def decorator(fn: F) -> F:
            self.add(name, Estimator(fn, kind, frozenset(settings)))
            return fn

        return decorator


ADVANTAGES = Estimators("advantage estimator")


def _require_shape(name: str, x: Tensor, shape: tuple[int, ...] | torch.Size) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


@ADVANTAGES.register("gae", kind="critic", settings=("lam",))
@torch.no_grad()
def gae(
    *,
    rewards: Tensor,
    values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float,
    lam: float,
    final_values: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016), with partial resets.

    Args:
        rewards: ``[T, B]`` reward r_t received after the action at step t.
        values: ``[T+1, B]`` V(s_t); ``values[T]`` is V of the observation after the last step.
        terminated: ``[T, B]`` bool, the episode reached a terminal state at step t.
        truncated: ``[T, B]`` bool, the episode hit its time limit at step t.
        gamma: discount γ.
        lam: GAE λ.
        final_values: ``[T, B]`` V of the final observation of an episode that ended at step t
            (before the env's auto-reset); read only where ``truncated & ~terminated``. Without
            it a truncated episode bootstraps from 0, which treats the time limit as terminal.

    Returns:
        ``advantages [T, B]`` and ``returns = advantages + values[:T]`` ``[T, B]``.

    Derivation. With auto-reset, ``values[t+1]`` of an env that ended at step t is the value of
    the first observation of the *next* episode, so it must not be used:

        V_next(t) = 0                  if terminated[t]       (no future reward)
                  = final_values[t]    if truncated[t]        (the episode would have gone on)
                  = values[t+1]        otherwise
        δ_t = r_t + γ V_next(t) - V(s_t)
        A_t = δ_t + γ λ c_t A_{t+1},   c_t = 0 if the episode ended at t else 1,   A_T = 0

    ``c_t`` stops the recursion at every episode boundary, terminated or truncated, so each
    env's episodes are estimated independently even when envs reset at different steps.
    """
    T, B = rewards.shape
    _require_shape("values", values, (T + 1, B))
    _require_shape("terminated", terminated, (T, B))
    _require_shape("truncated", truncated, (T, B))
    terminated = terminated.bool()
    truncated = truncated.bool() & ~terminated
    if final_values is None:
        final_values = torch.zeros_like(rewards)
    _require_shape("final_values", final_values, (T, B))

    zero = torch.zeros_like(rewards)
    next_values = torch.where(terminated, zero, torch.where(truncated, final_values, values[1:]))
    episode_continues = (~(terminated | truncated)).to(rewards.dtype)
    deltas = rewards + gamma * next_values - values[:-1]

    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(rewards[0])
    for t in reversed(range(T)):
        lastgaelam = deltas[t] + gamma * lam * episode_continues[t] * lastgaelam
        advantages[t] = lastgaelam
    returns = advantages + values[:-1]
    return advantages, returns


def _groups(scores: Tensor, group_size: int) -> Tensor:
    """``scores [N] -> [N // group_size, group_size]``, checking that the groups are whole."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [N], got shape {tuple(scores.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2, got {group_size}")
    if scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}")
    return scores.view(-1, group_size)


@ADVANTAGES.register("grpo", kind="group", settings=("normalize_std",))
@torch.no_grad()
def grpo(
    *,
    scores: Tensor,
    group_size: int,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Group-relative advantages (GRPO, Shao et al., 2024).

    For score s_i in group g (consecutive blocks of ``group_size``):

        A_i = (s_i - mean_g(s)) / (std_g(s) + eps)      (normalize_std=True)
        A_i =  s_i - mean_g(s)                          (normalize_std=False, "Dr. GRPO")

    ``std_g`` is the unbiased std (``torch.std``). A group whose scores are all equal gets
    advantages 0 (``0 / eps``); DAPO's dynamic sampling drops such groups.

    Args:
        scores: ``[N]`` one score per episode (embodied: e.g. success, see
            ``granularity.episode_scores``) or per sequence (math: verifier reward).
        group_size: G, N must be a multiple of it, G >= 2.

    Returns:
        ``advantages [N]`` and ``returns = scores`` ``[N]``.
    """
    s = _groups(scores, group_size)
    advantages = s - s.mean(dim=1, keepdim=True)
    if normalize_std:
        advantages = advantages / (s.std(dim=1, keepdim=True) + eps)
    return advantages.reshape(-1), scores.clone()


@ADVANTAGES.register("rloo", kind="group")
@torch.no_grad()
def rloo(*, scores: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Kool et al., 2019; Ahmadian et al., 2024).

    The baseline of sample i is the mean score of the other G-1 samples in its group:

        A_i = s_i - 1/(G-1) Σ_{j≠i} s_j

    Args:
        scores: ``[N]`` one score per episode or sequence, groups as in :func:`grpo`.
        group_size: G >= 2.

    Returns:
        ``advantages [N]`` and ``returns = scores`` ``[N]``.
    """
    s = _groups(scores, group_size)
    others_mean = (s.sum(dim=1, keepdim=True) - s) / (group_size - 1)
    return (s - others_mean).reshape(-1), scores.clone()


@ADVANTAGES.register("reinforce_pp", kind="return")
@torch.no_grad()
def reinforce_pp(
    *,
    rewards: Tensor,
    mask: Tensor | None = None,
    dones: Tensor | None = None,
    gamma: float = 1.0,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu, 2025): discounted returns, whitened over the whole batch.

        r'_t = r_t - β kl_t
        G_t  = r'_t + γ (1 - done_t) G_{t+1},   G_T = 0
        A_t  = (G_t - mean(G)) / (std(G) + eps)       over the valid (mask) entries

    Args:
        rewards: ``[T, B]`` per-step rewards (text: ``[L, B]``, the score on the last token).
        mask: ``[T, B]`` bool, valid steps / tokens; masked rewards are ignored and masked
            advantages are 0. Default: all valid.
        dones: ``[T, B]`` bool, an episode ended at step t (terminated or truncated), the return
            does not carry across it. Default: no episode boundary (one sequence per column).
        gamma: discount γ.
        kl: ``[T, B]`` optional per-token KL to a reference policy (see ``losses.kl_divergence``),
            folded into the reward with coefficient ``kl_coef`` (β).

    Returns:
        ``advantages [T, B]`` and the discounted ``returns`` G ``[T, B]``.
    """
    T, B = rewards.shape
    valid = torch.ones_like(rewards, dtype=torch.bool) if mask is None else mask.bool()
    _require_shape("mask", valid, (T, B))
    r = rewards if kl is None else rewards - kl_coef * kl
    r = r * valid.to(r.dtype)
    carry = torch.ones_like(r)
    if dones is not None:
        _require_shape("dones", dones, (T, B))
        carry = (~dones.bool()).to(r.dtype)

    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[0])
    for t in reversed(range(T)):
        running = r[t] + gamma * carry[t] * running
        returns[t] = running
    return whiten(returns, valid, eps=eps), returns
