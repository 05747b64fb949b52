"""A policy section as it will be built, before anything is built.

``train`` and ``eval`` check the policy against the env (cameras, action size, state size:
:func:`fit_problems`) before any worker starts. With ``policy.checkpoint`` the checkpoint's own
config files decide the architecture; these functions read them (no weights). Without one,
``train`` gives the policy the env's sizes where the command line leaves them
(:func:`sized_for_env`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from rlinf_vla.config import ConfigError

if TYPE_CHECKING:
    from rlinf_vla.envs.base import EnvConfig


def policy_config_for(policy_name: str, policy: dict[str, Any]) -> Any:
    """The policy's config as it will be built: from ``policy.checkpoint``'s config files
    (architecture, action size, cameras) updated with the section's other keys, else from its
    preset. Reads files only; loads no weights.

    Raises:
        ConfigError: unknown policy or key, or a missing / unreadable checkpoint.
    """
    from rlinf_vla.policies import POLICIES, policy_config

    values = dict(policy)
    checkpoint = values.pop("checkpoint", None)
    if policy_name not in POLICIES:
        raise ConfigError(f"policy: unknown policy {policy_name!r}; known: {sorted(POLICIES)}")
    if not checkpoint:
        try:
            return policy_config(policy_name, **values)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"policy: {e.args[0] if e.args else e}") from None
    from rlinf_vla.policies.base import find_checkpoint

    try:
        path = find_checkpoint(checkpoint)
    except FileNotFoundError as e:
        raise ConfigError(f"policy.{e.args[0]}") from None
    values.pop("preset", None)  # the architecture comes from the checkpoint
    cls = POLICIES[policy_name].cls
    defaults = {k: v for k, v in POLICIES[policy_name].defaults.items() if k != "preset"}
    try:
        return cls.config_from_dir(path, **{**defaults, **values})
    except (OSError, KeyError, TypeError, ValueError, NotImplementedError) as e:
        raise ConfigError(
            f"policy.checkpoint={checkpoint!r} cannot be read as a {policy_name} checkpoint: "
            f"{e.args[0] if e.args else e}"
        ) from None


def sized_for_env(policy_name: str, policy: dict[str, Any], env: EnvConfig) -> dict[str, Any]:
    """The policy section with the env's sizes for a policy without a checkpoint.

    A fresh policy (its preset's random weights) takes what the env provides
    (:meth:`EnvConfig.spec`) for every size the section leaves unset: ``action_dim``, the state
    size (``proprio_dim`` of a policy that reads proprio; ``max_state_dim`` grows to the env's
    state for a policy that zero-pads shorter states), and ``image_keys`` restricted to the
    env's cameras in the family's order (unchanged when none would remain: the fit check names
    the cameras then). A checkpoint keeps its own sizes and a key the section sets is never
    changed: a mismatch is left to :func:`fit_problems`.

    Raises:
        ConfigError: unknown policy or key (as :func:`policy_config_for`).
    """
    if policy.get("checkpoint"):
        return policy
    spec = env.spec()
    pol = policy_config_for(policy_name, policy)
    sizes: dict[str, Any] = {}
    if spec.action_dim is not None and pol.action_dim != spec.action_dim:
        sizes["action_dim"] = spec.action_dim
    keys = tuple(getattr(pol, "image_keys", ()) or ())
    kept = [k for k in keys if k in spec.cameras]
    if kept and tuple(kept) != keys:
        sizes["image_keys"] = kept
    state = spec.state_dim
    if state is not None and getattr(pol, "use_proprio", False) and pol.proprio_dim != state:
        sizes["proprio_dim"] = state
    if state is not None and getattr(pol, "max_state_dim", state) < state:
        sizes["max_state_dim"] = state
    return {**policy, **{k: v for k, v in sizes.items() if k not in policy}}


def fit_problems(env_name: str, env: EnvConfig, pol: Any) -> list[str]:
    """What keeps the built policy config ``pol`` from running in ``env``: cameras it asks
    for that the env lacks, an action size that differs, a state size that does not fit
    (:func:`state_problems`). One message per problem, each naming the keys; empty when the
    policy fits."""
    spec = env.spec()
    origin = " (from the checkpoint)" if getattr(pol, "checkpoint", None) else ""
    problems = []
    keys = tuple(getattr(pol, "image_keys", ()) or ())
    missing = [k for k in keys if k not in spec.cameras]
    if missing:
        hint = env.camera_hint()  # how the env adds a camera, when it can
        hint = f" ({hint})" if hint else ""
        problems.append(
            f"policy.image_keys={list(keys)}{origin} asks for camera(s) {missing} that env "
            f"{env_name!r} does not provide (its cameras: {list(spec.cameras)}){hint}"
        )
    if spec.action_dim is not None and pol.action_dim != spec.action_dim:
        settable = "action_dim" in {f.name for f in dataclasses.fields(env)}
        key = " (env.action_dim)" if settable else ""
        problems.append(
            f"policy.action_dim={pol.action_dim}{origin} does not match the action size of env "
            f"{env_name!r}: {spec.action_dim}{key}"
        )
    return problems + state_problems(env_name, env, pol)


def for_policy(env: EnvConfig, pol: Any) -> EnvConfig:
    """``env`` rendering only the cameras that are read: the policy's (``image_keys``) and the
    videos' (``video_camera``); :meth:`EnvConfig.keep_cameras` (an env whose cameras are fixed
    is returned as it is). Call it after :func:`fit_problems` found nothing."""
    return env.keep_cameras({*(getattr(pol, "image_keys", ()) or ()), env.video_camera})


def state_problems(env_name: str, env: EnvConfig, pol: Any) -> list[str]:
    """The state-size part of :func:`fit_problems`: OpenVLA-OFT reads exactly ``proprio_dim``
    values (when ``use_proprio``); π0 / π0.5 zero-pad the state to ``max_state_dim``, so only a
    longer state is refused. Empty when the env's state size is known only to its simulator."""
    state = env.spec().state_dim
    if state is None:
        return []
    origin = " (from the checkpoint)" if getattr(pol, "checkpoint", None) else ""
    mode = getattr(env, "state_mode", None)
    of_env = f"the state size of env {env_name!r}: {state}" + (
        f" (env.state_mode={mode})" if mode else ""
    )
    problems = []
    if getattr(pol, "use_proprio", False) and pol.proprio_dim != state:
        problems.append(f"policy.proprio_dim={pol.proprio_dim}{origin} does not match {of_env}")
    max_state = getattr(pol, "max_state_dim", None)
    if max_state is not None and max_state < state:
        problems.append(f"policy.max_state_dim={max_state}{origin} is smaller than {of_env}")
    return problems
