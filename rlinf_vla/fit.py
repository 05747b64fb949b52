"""Whether a policy fits an env: the one check ``train``, ``sft`` and ``eval`` make before
anything starts, where policies and envs meet (neither package imports the other).

A policy declares what it needs (:meth:`PolicyConfig.needs`: cameras, action size, the state
it reads), an env what it provides (:meth:`EnvConfig.spec`). :func:`fit_problems` names every
mismatch with the keys that fix it; :func:`sized_for_env` gives a fresh policy the env's sizes
where the command line leaves them; :func:`for_policy` keeps the env from rendering cameras
nothing reads.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from rlinf_vla.policies.resolve import policy_config_for

if TYPE_CHECKING:
    from rlinf_vla.envs.base import EnvConfig
    from rlinf_vla.policies.base import PolicyConfig


def sized_for_env(policy_name: str, policy: dict[str, Any], env: EnvConfig) -> dict[str, Any]:
    """The policy section with the env's sizes for a policy without a checkpoint.

    A fresh policy (its preset's random weights) takes what the env provides
    (:meth:`EnvConfig.spec`) for every size the section leaves unset: ``action_dim``, the state
    size (``proprio_dim`` of a policy that reads exactly that many values; ``max_state_dim``
    grows to the env's state for a policy that zero-pads shorter states), and ``image_keys``
    restricted to the env's cameras in the family's order (unchanged when none would remain:
    the fit check names the cameras then). A checkpoint keeps its own sizes and a key the
    section sets is never changed: a mismatch is left to :func:`fit_problems`.

    Raises:
        ConfigError: unknown policy or key (as :func:`policy_config_for`).
    """
    if policy.get("checkpoint"):
        return policy
    spec = env.spec()
    needs = policy_config_for(policy_name, policy).needs()
    sizes: dict[str, Any] = {}
    if spec.action_dim is not None and needs.action_dim != spec.action_dim:
        sizes["action_dim"] = spec.action_dim
    kept = [k for k in needs.cameras if k in spec.cameras]
    if kept and tuple(kept) != needs.cameras:
        sizes["image_keys"] = kept
    state = spec.state_dim
    if state is not None and needs.state_dim is not None and needs.state_dim != state:
        sizes["proprio_dim"] = state
    if state is not None and needs.max_state_dim is not None and needs.max_state_dim < state:
        sizes["max_state_dim"] = state
    return {**policy, **{k: v for k, v in sizes.items() if k not in policy}}


def fit_problems(env_name: str, env: EnvConfig, pol: PolicyConfig) -> list[str]:
    """What keeps the built policy config ``pol`` from running in ``env``: cameras it asks
    for that the env lacks, an action size that differs, a state size that does not fit
    (:func:`state_problems`). One message per problem, each naming the keys; empty when the
    policy fits."""
    spec, needs = env.spec(), pol.needs()
    origin = " (from the checkpoint)" if pol.checkpoint else ""
    problems = []
    missing = [k for k in needs.cameras if k not in spec.cameras]
    if missing:
        hint = env.camera_hint()  # how the env adds a camera, when it can
        hint = f" ({hint})" if hint else ""
        problems.append(
            f"policy.image_keys={list(needs.cameras)}{origin} asks for camera(s) {missing} that "
            f"env {env_name!r} does not provide (its cameras: {list(spec.cameras)}){hint}"
        )
    if spec.action_dim is not None and needs.action_dim != spec.action_dim:
        settable = "action_dim" in {f.name for f in dataclasses.fields(env)}
        key = " (env.action_dim)" if settable else ""
        problems.append(
            f"policy.action_dim={needs.action_dim}{origin} does not match the action size of "
            f"env {env_name!r}: {spec.action_dim}{key}"
        )
    return problems + state_problems(env_name, env, pol)


def for_policy(env: EnvConfig, pol: PolicyConfig) -> EnvConfig:
    """``env`` rendering only the cameras that are read: the policy's and the videos'
    (``video_camera``); :meth:`EnvConfig.keep_cameras` (an env whose cameras are fixed is
    returned as it is). Call it after :func:`fit_problems` found nothing."""
    return env.keep_cameras({*pol.needs().cameras, env.video_camera})


def state_problems(env_name: str, env: EnvConfig, pol: PolicyConfig) -> list[str]:
    """The state-size part of :func:`fit_problems`: a policy that reads exactly
    ``proprio_dim`` values (OpenVLA-OFT with ``use_proprio``) needs that size; one that
    zero-pads to ``max_state_dim`` (π0 / π0.5) refuses only a longer state. Empty when the
    env's state size is known only to its simulator."""
    state = env.spec().state_dim
    if state is None:
        return []
    needs = pol.needs()
    origin = " (from the checkpoint)" if pol.checkpoint else ""
    mode = getattr(env, "state_mode", None)
    of_env = f"the state size of env {env_name!r}: {state}" + (
        f" (env.state_mode={mode})" if mode else ""
    )
    problems = []
    if needs.state_dim is not None and needs.state_dim != state:
        problems.append(f"policy.proprio_dim={needs.state_dim}{origin} does not match {of_env}")
    if needs.max_state_dim is not None and needs.max_state_dim < state:
        problems.append(
            f"policy.max_state_dim={needs.max_state_dim}{origin} is smaller than {of_env}"
        )
    return problems
