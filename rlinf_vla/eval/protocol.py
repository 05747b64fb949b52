"""Evaluation protocols: what ``eval.protocol`` fixes, checks and records.

- ``official``: the episodes and env settings of a benchmark's official evaluation loop,
  checked before anything starts (LIBERO's, the default there:
  :mod:`rlinf_vla.envs.libero.evaluation`).
- ``package``: the env settings as given, unchecked.

Each env declares the protocols it has, its default first
(:meth:`~rlinf_vla.envs.base.EnvConfig.eval_protocols`: ``package`` only unless it has an
official loop to reproduce), checks a config against one
(:meth:`~rlinf_vla.envs.base.EnvConfig.check_protocol`) and says what ``results.json`` records
about it (:meth:`~rlinf_vla.envs.base.EnvConfig.protocol_record`).
"""

from __future__ import annotations

from rlinf_vla.config import ConfigError

#: Known values of ``eval.protocol``.
PROTOCOLS: tuple[str, ...] = ("official", "package")


def resolve(env_name: str, requested: str | None) -> str:
    """The protocol of an evaluation: ``requested``, or the env's default (the first of its
    :meth:`~rlinf_vla.envs.base.EnvConfig.eval_protocols`).

    Raises:
        ConfigError: an unknown protocol, or one the env does not have (``official`` for an
            env without an official loop), naming the envs that have it.
    """
    from rlinf_vla.envs import ENVS

    have = ENVS[env_name].config_cls.eval_protocols()
    if requested is None:
        return have[0]
    if requested not in PROTOCOLS:
        raise ConfigError(f"eval.protocol={requested!r}: known protocols: {', '.join(PROTOCOLS)}")
    if requested not in have:
        with_it = sorted(n for n, c in ENVS.items() if requested in c.config_cls.eval_protocols())
        raise ConfigError(
            f"eval.protocol={requested}: env {env_name!r} has no {requested} evaluation loop to "
            f"reproduce (only {', '.join(with_it)} has); use "
            f"{' or '.join(f'eval.protocol={p}' for p in have)} or leave it null"
        )
    return requested
