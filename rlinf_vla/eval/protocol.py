"""Evaluation protocols: what ``eval.protocol`` fixes, checks and records.

- ``official`` (LIBERO's default): the episode the official LIBERO evaluation loops run for
  (task, init state), namely OpenVLA / OpenVLA-OFT's ``experiments/robot/libero/run_libero_eval.py``
  and openpi's ``examples/libero/main.py``. Each builds one simulator per task with 256 px
  cameras, calls ``env.seed(s)`` once (0 in OpenVLA / OpenVLA-OFT, 7 in openpi), and runs
  episodes ``k = 0 .. 49`` in order: reset, init state ``k``, 10 no-op steps (gripper open),
  then at most 220 / 280 / 300 / 520 / 400 policy steps (spatial / object / goal / 10 / 90).
  The LIBERO env reproduces the scene of episode ``k`` whatever else runs
  (``env.scene_seed``); this module checks that no env setting departs from the loop.
- ``package``: the env settings as given, unchecked (quick CPU runs with smaller, cheaper
  renders, other time limits or settle steps, ``env.scene_seed=null`` for the earlier
  seeding by reset id).

Other envs have no official loop to reproduce; their only protocol is ``package``.
"""

from __future__ import annotations

from typing import Any

from rlinf_vla.config import ConfigError

#: Known values of ``eval.protocol``.
PROTOCOLS: tuple[str, ...] = ("official", "package")
#: The env settings of the official LIBERO loops (besides the scene seed and time limits).
LIBERO_OFFICIAL: dict[str, Any] = {
    "image_size": 256,
    "fast_render": False,
    "settle_steps": 10,
    "max_episode_steps": None,
}
#: Time limits per suite of the official LIBERO loops (policy steps after the settle steps).
LIBERO_OFFICIAL_MAX_STEPS: dict[str, int] = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}


def resolve(env_name: str, requested: str | None) -> str:
    """The protocol of an evaluation: ``requested``, or the env's default (LIBERO:
    ``official``; other envs: ``package``).

    Raises:
        ConfigError: an unknown protocol, or ``official`` for an env without an official loop.
    """
    if requested is None:
        return "official" if env_name == "libero" else "package"
    if requested not in PROTOCOLS:
        raise ConfigError(f"eval.protocol={requested!r}: known protocols: {', '.join(PROTOCOLS)}")
    if requested == "official" and env_name != "libero":
        raise ConfigError(
            f"eval.protocol=official: env {env_name!r} has no official evaluation loop to "
            "reproduce (only libero has); use eval.protocol=package or leave it null"
        )
    return requested


def check(env_name: str, protocol: str, env_cfg: Any) -> None:
    """Check that the env settings follow ``protocol``.

    Raises:
        ConfigError: naming every env key that departs from the official loop, its value and
            the official one.
    """
    if protocol != "official" or env_name != "libero":
        return
    from rlinf_vla.envs.libero.config import OFFICIAL_SCENE_SEEDS

    bad = [
        f"env.{key}={getattr(env_cfg, key)!r} (official: {want!r})"
        for key, want in LIBERO_OFFICIAL.items()
        if getattr(env_cfg, key) != want
    ]
    limits = {s: env_cfg.max_steps[s] for s in LIBERO_OFFICIAL_MAX_STEPS}
    if limits != LIBERO_OFFICIAL_MAX_STEPS:
        changed = {s: v for s, v in limits.items() if v != LIBERO_OFFICIAL_MAX_STEPS[s]}
        bad.append(f"env.max_steps={changed} (official: {LIBERO_OFFICIAL_MAX_STEPS})")
    if env_cfg.scene_seed not in OFFICIAL_SCENE_SEEDS:
        known = ", ".join(f"{s}: {loop}" for s, loop in OFFICIAL_SCENE_SEEDS.items())
        bad.append(f"env.scene_seed={env_cfg.scene_seed!r} (official: {known})")
    if bad:
        raise ConfigError(
            "eval.protocol=official reproduces the official LIBERO evaluation loop, but "
            + "; ".join(bad)
            + ". Restore these keys, or set eval.protocol=package to evaluate with these "
            f"settings (known protocols: {', '.join(PROTOCOLS)})"
        )


def describe(env_name: str, protocol: str, env_cfg: Any) -> dict[str, Any]:
    """What ``results.json`` records under ``protocol``: the name and, for LIBERO, the
    settings that decide a trial's scene and length."""
    out: dict[str, Any] = {"name": protocol}
    if env_name != "libero":
        return out
    from rlinf_vla.envs.libero.config import OFFICIAL_SCENE_SEEDS

    seed = env_cfg.scene_seed
    out.update(
        scene_seed=seed,
        reference_loop=OFFICIAL_SCENE_SEEDS.get(seed) if protocol == "official" else None,
        scenes=(
            "the official loop's episode k for (task, init state k)"
            if seed is not None
            else "seeded by reset id (they change with env.task_ids)"
        ),
        image_size=env_cfg.image_size,
        fast_render=env_cfg.fast_render,
        settle_steps=env_cfg.settle_steps,
        max_steps=env_cfg.max_episode_steps or dict(env_cfg.max_steps),
    )
    return out
