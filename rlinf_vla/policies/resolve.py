"""A policy section as it will be built, before anything is built: with ``policy.checkpoint``
the checkpoint's own config files decide the architecture (read here, no weights), else the
preset. The commands check the result against the env with :mod:`rlinf_vla.fit`.
"""

from __future__ import annotations

from typing import Any

from rlinf_vla.config import ConfigError


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
