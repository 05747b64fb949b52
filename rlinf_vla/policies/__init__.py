"""VLA policies behind one ``act`` / ``evaluate`` contract: ``openvla``, ``openvla_oft``, ``pi0``,
``pi05`` and ``smolvla``.

``make_policy(name, **overrides)`` builds a registered policy from its typed config: ``preset``
(``tiny`` for tests, ``full`` for the published sizes), ``checkpoint=PATH`` to load weights in
the family's official format, and any config field (``action_dim``, ``chunk_size``, ...). Model
libraries (timm, transformers, peft) are imported only when a policy is built.

>>> policy = make_policy("openvla", preset="tiny", action_dim=7)
>>> out = policy.act(obs)                  # actions [B, K, A], logprob, value, replay
>>> ev = policy.evaluate(obs, out.replay)  # same logprob with unchanged weights
"""

from __future__ import annotations

import difflib
from typing import Any

# The family modules register their classes (``@register_policy``) when imported; they import
# timm/transformers lazily, inside the constructors.
import rlinf_vla.policies.openvla.model
import rlinf_vla.policies.openvla_oft.model
import rlinf_vla.policies.pi0.model
import rlinf_vla.policies.smolvla.model  # noqa: F401
from rlinf_vla.policies.base import (
    POLICIES,
    CheckpointMismatchError,
    Policy,
    PolicyConfig,
    find_checkpoint,
    register_policy,
)

__all__ = [
    "POLICIES",
    "CheckpointMismatchError",
    "Policy",
    "PolicyConfig",
    "make_policy",
    "policy_config",
    "register_policy",
]


def _spec(name: str) -> Any:
    if name not in POLICIES:
        close = difflib.get_close_matches(name, POLICIES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise KeyError(f"unknown policy {name!r}{hint}; known policies: {sorted(POLICIES)}")
    return POLICIES[name]


def policy_config(name: str, **overrides: Any) -> PolicyConfig:
    """The validated config of policy ``name`` (its preset updated with ``overrides``)."""
    spec = _spec(name)
    return spec.cls.config_cls.from_kwargs(name, **{**spec.defaults, **overrides})


def make_policy(name: str, config: PolicyConfig | None = None, **overrides: Any) -> Policy:
    """Build policy ``name``.

    Args:
        name: a registered name (``openvla``, ``openvla_oft``, ``pi0``, ``pi05``, ``smolvla``).
        config: the policy's typed config as the job's validation built it
            (:func:`~rlinf_vla.policies.resolve.policy_config_for`: with a ``checkpoint``, the
            checkpoint's own config with the command line's keys on top); its ``checkpoint``
            weights are loaded as they are, the config is not read again. Keyword ``overrides``
            replace fields (a worker's ``device`` and ``seed``).
        **overrides: without ``config``: config fields of the family (see its ``config.py``);
            ``checkpoint=PATH`` loads a checkpoint directory (or a Hugging Face model id from
            the local cache, :func:`~rlinf_vla.policies.base.find_checkpoint`), whose
            architecture replaces the preset (``preset`` is ignored then; other keys override
            the checkpoint's settings).

    The same keys work from the CLI: ``policy=openvla policy.preset=tiny policy.checkpoint=PATH``.
    """
    spec = _spec(name)
    if config is not None:
        if not isinstance(config, spec.cls.config_cls):
            raise TypeError(
                f"policy {name!r} takes a {spec.cls.config_cls.__name__}, "
                f"got {type(config).__name__}"
            )
        return spec.cls.from_config(config.replace(**overrides) if overrides else config)
    overrides = {**spec.defaults, **overrides}
    checkpoint = overrides.pop("checkpoint", None)
    if checkpoint:
        # The architecture comes from the checkpoint, not from a preset.
        overrides.pop("preset", None)
        return spec.cls.from_pretrained(find_checkpoint(checkpoint), **overrides)
    return spec.cls(spec.cls.config_cls.from_kwargs(name, **overrides))
