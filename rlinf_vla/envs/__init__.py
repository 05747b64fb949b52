"""Vectorised envs behind one contract: ``toy``, ``maniskill`` (ManiSkill3), ``libero`` and
``metaworld``.

``make_env(name, **config)`` builds a registered env from keyword arguments checked against the
env's typed config; simulators are imported only when an env that needs them is built, so
``import rlinf_vla.envs`` works without any simulator installed.

>>> env = make_env("toy", num_envs=4, group_size=2)
>>> obs = env.reset()
>>> result = env.chunk_step(env.oracle_actions(chunk=5))
"""

from __future__ import annotations

from typing import Any

# The env modules register their classes (``@register_env``) when imported; they import their
# simulators lazily.
import rlinf_vla.envs.libero.env
import rlinf_vla.envs.maniskill.env
import rlinf_vla.envs.metaworld.env
import rlinf_vla.envs.toy.env  # noqa: F401
from rlinf_vla.envs.base import (
    ENVS,
    EnvConfig,
    StepOutput,
    VectorEnv,
    group_reset_ids,
    register_env,
    replace_config,
    split_sizes,
)

__all__ = [
    "ENVS",
    "EnvConfig",
    "StepOutput",
    "VectorEnv",
    "env_config",
    "env_section_config",
    "for_device",
    "group_reset_ids",
    "make_env",
    "make_gym_env",
    "make_stage_envs",
    "register_env",
    "replace_config",
]


def _env_class(name: str) -> type[VectorEnv]:
    if name not in ENVS:
        raise KeyError(f"unknown env {name!r}; known envs: {sorted(ENVS)}")
    return ENVS[name]


def env_config(name: str, config: EnvConfig | None = None, **overrides: Any) -> EnvConfig:
    """The validated config of env ``name`` from ``config`` and/or keyword ``overrides``."""
    cls = _env_class(name)
    if config is None:
        return cls.config_cls.from_kwargs(name, **overrides)
    if not isinstance(config, cls.config_cls):
        raise TypeError(
            f"env {name!r} takes a {cls.config_cls.__name__}, got {type(config).__name__}"
        )
    return replace_config(config, **overrides) if overrides else config


def env_section_config(
    name: str, section: dict[str, Any], config: EnvConfig | None = None, **overrides: Any
) -> EnvConfig:
    """:func:`env_config` of a command's ``env`` section: an unknown env or key, or a bad
    value, is a :class:`~rlinf_vla.config.ConfigError` naming the key as the command line
    sets it (``LiberoEnvConfig.task_ids ...`` -> ``env.task_ids ...``)."""
    import re

    from rlinf_vla.config import ConfigError

    try:
        return env_config(name, config, **{**section, **overrides})
    except (KeyError, TypeError, ValueError) as e:
        message = re.sub(r"^\w+EnvConfig\.", "env.", str(e.args[0] if e.args else e))
        raise ConfigError(message if message.startswith("env.") else f"env: {message}") from None


def for_device(config: EnvConfig, device: Any) -> EnvConfig:
    """``config`` with ``sim_backend="auto"`` (ManiSkill) decided by the torch ``device`` of
    the worker that builds the env: the GPU simulator on a GPU, CPU processes on a CPU slot,
    also on a machine whose GPUs a run leaves out (``cluster.num_gpus=0``). Without a worker,
    ``auto`` picks the GPU when CUDA is there."""
    if getattr(config, "sim_backend", None) != "auto":
        return config
    return replace_config(config, sim_backend="gpu" if device.type == "cuda" else "cpu")


def make_env(name: str, config: EnvConfig | None = None, **overrides: Any) -> VectorEnv:
    """Build the registered env ``name``.

    Args:
        name: a key of :data:`ENVS` (``"toy"``, ``"maniskill"``, ``"libero"``,
            ``"metaworld"``).
        config: an instance of the env's config class; keyword ``overrides`` replace its fields.
            Without it the config is built from the keywords (unknown keys fail, naming them).
    """
    cls = _env_class(name)
    return cls(env_config(name, config, **overrides))


def make_gym_env(name: str, config: EnvConfig | None = None, **overrides: Any) -> Any:
    """:func:`make_env` behind gymnasium's vector API (``gymnasium.vector.VectorEnv``; one
    action per env per step, numpy arrays; see :mod:`rlinf_vla.envs.gym`), for gymnasium's
    wrappers and tools."""
    from rlinf_vla.envs.gym import GymVectorEnv

    return GymVectorEnv(make_env(name, config, **overrides))


def make_stage_envs(
    name: str, num_stages: int, config: EnvConfig | None = None, **overrides: Any
) -> list[VectorEnv]:
    """Split a batch of ``num_envs`` envs into ``num_stages`` pipeline stages.

    Each stage is its own env of ``num_envs // num_stages`` envs (whole GRPO groups), with
    ``env_offset`` set so that its reset-id cursor and videos continue the global env numbering:
    stage ``s`` holds the global envs ``[s * n, (s + 1) * n)``.
    """
    cfg = env_config(name, config, **overrides)
    if num_stages > 1:
        cfg = cfg.for_whole_batch()
    sizes = split_sizes(cfg.num_envs, num_stages, cfg.group_size)
    envs: list[VectorEnv] = []
    offset = cfg.env_offset
    try:
        for size in sizes:
            video_ids = tuple(i - offset for i in cfg.video_env_ids if 0 <= i - offset < size)
            stage_cfg = replace_config(
                cfg,
                num_envs=size,
                env_offset=offset,
                video_env_ids=video_ids,
                video_dir=cfg.video_dir if video_ids else None,
            )
            envs.append(_env_class(name)(stage_cfg))
            offset += size
    except BaseException:
        for env in envs:
            env.close()
        raise
    return envs
