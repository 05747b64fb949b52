"""`rlinf-vla sft`: demonstrations as batches, dataset statistics in the policy, bad datasets."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rlinf_vla.config import ConfigError
from rlinf_vla.pipelines.demos import Demonstrations, FeatureMap, combine_stats, map_features

FMAP = FeatureMap({"main": "observation.images.main"}, "observation.state", "action")


def _frames(episode_lengths, action_dim=2, offset=0.0):
    n = sum(episode_lengths)
    ep = np.concatenate([np.full(k, i) for i, k in enumerate(episode_lengths)])
    return {
        "images": {"observation.images.main": np.zeros((n, 8, 8, 3), np.uint8)},
        "observation.state": np.arange(n, dtype=np.float32)[:, None].repeat(3, 1),
        "action": offset + np.arange(n * action_dim, dtype=np.float32).reshape(n, action_dim),
        "episode_index": ep,
        "frame_index": np.concatenate([np.arange(k) for k in episode_lengths]),
        "task_index": ep % 2,
        "tasks": ["task a", "task b"],
    }


def test_chunk_targets_stay_in_the_episode_and_repeat_its_last_action():
    demos = Demonstrations([_frames([3, 2])], [FMAP], chunk_size=3)
    obs, actions = demos.batch(torch.arange(5))
    # frame -> rows of its chunk, by hand: episode 0 = frames 0..2, episode 1 = frames 3..4
    rows = [[0, 1, 2], [1, 2, 2], [2, 2, 2], [3, 4, 4], [4, 4, 4]]
    a = _frames([3, 2])["action"]
    assert torch.equal(actions, torch.from_numpy(a[np.array(rows)]))
    assert obs.instruction == ["task a", "task a", "task a", "task b", "task b"]
    assert obs.state[:, 0].tolist() == [0, 1, 2, 3, 4]
    assert demos.num_episodes == 2


def test_episodes_of_two_datasets_never_merge():
    # both datasets number their episodes from 0: frame 2 (last of dataset 1) must not chunk
    # into dataset 2's first frame
    demos = Demonstrations([_frames([3]), _frames([2], offset=100.0)], [FMAP, FMAP], chunk_size=2)
    _, actions = demos.batch(torch.tensor([2, 3]))
    a1, a2 = _frames([3])["action"], _frames([2], offset=100.0)["action"]
    assert torch.equal(actions[0], torch.from_numpy(a1[[2, 2]]))
    assert torch.equal(actions[1], torch.from_numpy(a2[[0, 1]]))
    assert demos.num_episodes == 2


def test_combined_statistics_equal_those_of_the_concatenated_data():
    rng = np.random.default_rng(0)
    x, y = rng.normal(1.0, 2.0, (50, 3)), rng.normal(-2.0, 0.5, (30, 3))

    def stats(a):
        return {"mean": a.mean(0), "std": a.std(0), "min": a.min(0), "max": a.max(0)}

    both = np.concatenate([x, y])
    got = combine_stats([(stats(x), 50), (stats(y), 30)])
    for key, want in stats(both).items():
        np.testing.assert_allclose(got[key], want, rtol=1e-10, err_msg=key)


def test_missing_features_are_named_with_what_the_dataset_has():
    features = {
        "observation.images.top": {"dtype": "video", "shape": [8, 8, 3]},
        "observation.state": {"dtype": "float32", "shape": [3]},
        "action": {"dtype": "float32", "shape": [2]},
    }
    with pytest.raises(ConfigError) as e:
        map_features("d", features, ["main", "wrist"], {}, "observation.qpos", "action")
    text = str(e.value)
    assert "'main'" in text and "'wrist'" in text and "observation.images.top" in text
    assert "observation.qpos" in text and "observation.state" in text
    # naming the feature explicitly maps it
    fmap = map_features(
        "d", features, ["main"], {"main": "observation.images.top"}, "observation.state", "action"
    )
    assert fmap.cameras == {"main": "observation.images.top"}


def _stats(low, high):
    low, high = np.asarray(low, float), np.asarray(high, float)
    return {
        "mean": list((low + high) / 2),
        "std": list((high - low) / 4),
        "min": list(low - 1),
        "max": list(high + 1),
        "q01": list(low),
        "q99": list(high),
    }


def test_openvla_family_normalises_with_the_dataset_statistics():
    from rlinf_vla.policies import POLICIES, make_policy

    action = _stats([-1, 0, 2], [1, 4, 3])
    cls = POLICIES["openvla_oft"].cls
    cfg = cls.statistics_config(
        "pick", action, _stats([0] * 8, [2] * 8), {"frames": 9, "episodes": 2}
    )
    assert cfg["unnorm_key"] == "pick" and cfg["gripper"] == "env"
    entry = cfg["norm_stats"]["pick"]
    assert entry["num_transitions"] == 9 and entry["num_trajectories"] == 2
    policy = make_policy("openvla_oft", preset="tiny", action_dim=3, **cfg)
    x = torch.tensor([[0.0, 1.0, 2.5]])
    # BOUNDS_Q99 by hand: 2 (x - q01) / (q99 - q01) - 1
    want = torch.tensor([[0.0, 2 * 1 / 4 - 1, 2 * 0.5 / 1 - 1]])
    torch.testing.assert_close(policy.processor.normalize_actions(x), want, atol=1e-6, rtol=0)


def test_pi0_normalises_with_the_dataset_statistics():
    from rlinf_vla.policies import POLICIES, make_policy

    action = _stats([-1, 0, 2], [1, 4, 3])
    cfg = POLICIES["pi0"].cls.statistics_config("d", action, None, {"frames": 1, "episodes": 1})
    assert set(cfg["norm_stats"]) == {"actions"}
    policy = make_policy("pi0", preset="tiny", action_dim=3, chunk_size=4, **cfg)
    x = torch.tensor([[2.0, 2.0, 2.5]])
    # π0 z-scores: (x - mean) / (std + 1e-6), mean (0, 2, 2.5), std (0.5, 1, 0.25)
    want = torch.tensor([[2.0 / (0.5 + 1e-6), 0.0, 0.0]])
    got = policy.processor.normalize_actions(x)[..., :3]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# -- end to end on the toy env ------------------------------------------------------------------
# One shape, the agent starting at the centre, 2-D actions; the state holds the offset to the
# target (privileged), so a tiny policy can clone the expert in a few hundred steps on a CPU.
TOY = [
    "env=toy",
    "env.num_objects=1",
    "env.state_mode=privileged",
    "env.action_dim=2",
    "env.max_episode_steps=16",
    "env.success_radius=0.1",
    "env.agent_start=center",
]


@pytest.fixture(scope="module")
def toy_demos(tmp_path_factory):
    from rlinf_vla import cli

    out = tmp_path_factory.mktemp("demos") / "toy"
    args = [*TOY, "env.num_envs=8", "collect.episodes=24", f"collect.output_dir={out}"]
    assert cli.main(["collect", *args]) == 0
    return out


def _sft(out, demos, *extra):
    from rlinf_vla import cli

    args = [
        "sft",
        *TOY,
        "policy=openvla_oft",
        "policy.chunk_size=2",
        f"data.paths=[{demos}]",
        "sft.lr=1e-3",
        "runner.eval_episodes=16",
        "runner.eval_videos=false",
        "runner.logging.tensorboard=false",
        "cluster.devices_per_node=1",
        f"runner.output_dir={out}",
        *extra,
    ]
    return cli.main(args)


@pytest.mark.slow
@pytest.mark.ray
def test_cloning_the_toy_expert_lowers_the_loss_raises_success_and_resumes(tmp_path, toy_demos):
    from rlinf_vla.data import open_dataset
    from rlinf_vla.run.tracking import read_metrics

    run = tmp_path / "sft"
    common = ["runner.eval_interval=150", "runner.save_interval=75", "runner.eval_at_start=true"]
    assert _sft(run, toy_demos, "sft.steps=75", *common) == 0
    assert _sft(run, toy_demos, "sft.steps=150", f"runner.resume={run}", *common) == 0
    rows = read_metrics(run)
    assert [r["iteration"] for r in rows] == list(range(151))
    loss = [r["train/loss"] for r in rows[1:]]
    assert np.mean(loss[-20:]) < 0.5 * np.mean(loss[:10])
    assert rows[0]["eval/success_rate"] <= 0.25  # random weights: where the expert never goes
    assert rows[-1]["eval/success_rate"] >= 0.75
    # the dataset's statistics travel with the checkpoint, where OpenVLA keeps them
    import json

    saved = json.loads((run / "checkpoints/step_150/policy/dataset_statistics.json").read_text())
    [(name, entry)] = saved.items()
    assert name == "toy"  # the dataset folder names the statistics (unnorm_key)
    stats = open_dataset(toy_demos).stats
    np.testing.assert_allclose(entry["action"]["q99"], stats["action"]["q99"], rtol=1e-6)
    np.testing.assert_allclose(
        entry["proprio"]["mean"], stats["observation.state"]["mean"], rtol=1e-6
    )
    assert entry["num_trajectories"] == 24


@pytest.mark.slow
@pytest.mark.ray
def test_an_sft_checkpoint_starts_rl(tmp_path, toy_demos):
    from rlinf_vla import cli
    from rlinf_vla.run.tracking import read_metrics

    run = tmp_path / "sft"
    assert _sft(run, toy_demos, "sft.steps=2", "runner.eval_interval=0") == 0
    args = [
        "train",
        *TOY,
        "env.num_envs=4",
        "policy=openvla_oft",
        f"policy.checkpoint={run}/checkpoints/step_2",
        "runner.max_iterations=1",
        "runner.rollout_chunks=4",
        "runner.eval_interval=0",
        "runner.logging.tensorboard=false",
        "cluster.devices_per_node=1",
        f"runner.output_dir={tmp_path / 'rl'}",
    ]
    assert cli.main(args) == 0
    [row] = read_metrics(tmp_path / "rl")
    assert row["env_steps"] == 4 * 4 * 2  # envs x chunks x the checkpoint's chunk size


def _bad(tmp_path, demos, *extra, capsys):
    assert _sft(tmp_path / "run", demos, *extra) == 2
    return capsys.readouterr().err


def test_datasets_that_do_not_fit_fail_before_anything_starts(
    tmp_path, toy_demos, nothing_starts, capsys
):
    err = _bad(tmp_path, toy_demos, "policy.action_dim=3", capsys=capsys)
    assert "its actions have 2 dims, the policy 3" in err
    err = _bad(tmp_path, toy_demos, "policy.image_keys=[wrist]", capsys=capsys)
    assert "'wrist'" in err and "observation.images.main" in err
    err = _bad(tmp_path, tmp_path / "nowhere", capsys=capsys)
    assert "nowhere" in err
    (tmp_path / "empty").mkdir()
    err = _bad(tmp_path, tmp_path / "empty", capsys=capsys)
    assert "info.json" in err


@pytest.fixture(scope="module")
def long_state_demos(tmp_path_factory):
    """Two short episodes whose state has 12 values, more than the tiny π0 pads to (8)."""
    from rlinf_vla.data import LeRobotWriter

    writer = LeRobotWriter(
        tmp_path_factory.mktemp("long_state") / "ds", 10, {"main": (16, 16)}, 12, 2
    )
    rng = np.random.default_rng(0)
    for _ in range(2):
        images = {"main": rng.integers(0, 255, (6, 16, 16, 3), dtype=np.uint8)}
        state = rng.normal(size=(6, 12)).astype(np.float32)
        writer.add_episode(images, state, rng.uniform(-1, 1, (6, 2)).astype(np.float32), "go")
    return writer.close()


def _sft_job(demos, *extra):
    from rlinf_vla import cli
    from rlinf_vla.pipelines.sft import validate

    args = [*TOY, "policy=pi0", "policy.preset=tiny", f"data.paths=[{demos}]", *extra]
    return validate(cli.compose("sft", args))


def test_a_fresh_pi0_pads_the_state_to_the_datas_size_unless_told(long_state_demos):
    assert _sft_job(long_state_demos).policy_config.max_state_dim == 12
    assert _sft_job(long_state_demos, "policy.max_state_dim=16").policy_config.max_state_dim == 16
    with pytest.raises(ConfigError, match=r"state has 12 dims, more than .*max_state_dim=10"):
        _sft_job(long_state_demos, "policy.max_state_dim=10")


def _evaluated_run(tmp_path, evaluations):
    """A run folder with complete checkpoints ``step_<n>`` and one metrics row per
    ``(step, success, first reset id)``."""
    from rlinf_vla.run.checkpoints import write_manifest

    run = tmp_path / "run"
    rows = []
    for step, rate, first in evaluations:
        folder = run / "checkpoints" / f"step_{step}"
        folder.mkdir(parents=True)
        (folder / "actor_rank0.pt").write_bytes(b"weights %d" % step)
        write_manifest(folder)
        rows.append({"iteration": step, "eval/success_rate": rate, "eval/first_reset_id": first})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_the_best_checkpoint_is_chosen_on_validation_scenes_only(tmp_path):
    from rlinf_vla.config import RunAborted
    from rlinf_vla.pipelines.evaluation import (
        EVAL_RESET_ID_BASE,
        VALIDATION_RESET_ID_BASE,
        best_checkpoint,
    )

    val, test = float(VALIDATION_RESET_ID_BASE), float(EVAL_RESET_ID_BASE)
    run = _evaluated_run(
        tmp_path,
        [(100, 0.5, val), (200, 0.75, val), (300, 0.75, val), (400, 1.0, test), (500, 0.6, val)],
    )
    # the held-out evaluation of step 400 plays no part; of two equal rates, the later wins
    chosen = best_checkpoint(run, "step")
    assert chosen.path.name == "step_300"
    assert "0.750 on validation scenes, the best of 4" in chosen.notes[0]
    # a damaged checkpoint is never chosen
    (run / "checkpoints" / "step_300" / "actor_rank0.pt").write_bytes(b"changed")
    assert best_checkpoint(run, "step").path.name == "step_200"
    assert best_checkpoint(run, "step", scenes="held_out").path.name == "step_400"
    held_out_only = _evaluated_run(tmp_path / "b", [(100, 0.5, test)])
    with pytest.raises(RunAborted, match="no complete checkpoint was evaluated on validation"):
        best_checkpoint(held_out_only, "step")


def test_validation_scenes_are_neither_held_out_nor_demonstration_scenes():
    from rlinf_vla.pipelines.evaluation import (
        SCENE_BLOCKS,
        SCENES_PER_BLOCK,
        eval_reset_ids,
    )

    validation = set(eval_reset_ids(SCENES_PER_BLOCK, SCENE_BLOCKS["validation"]).tolist())
    held_out = set(eval_reset_ids(SCENES_PER_BLOCK, SCENE_BLOCKS["held_out"]).tolist())
    assert not validation & held_out
    assert max(held_out) == 2**31 - 1  # the last block: ids the envs take
    assert min(validation) > 10**9  # far above the demonstrations' ids (collect: 0, 1, ...)


@pytest.mark.slow
@pytest.mark.ray
def test_sft_evaluates_on_the_validation_scenes_it_is_told(tmp_path, toy_demos):
    from rlinf_vla.pipelines.evaluation import VALIDATION_RESET_ID_BASE, best_checkpoint
    from rlinf_vla.run.tracking import read_metrics

    run = tmp_path / "sft"
    common = ["runner.eval_interval=2", "runner.save_interval=2", "runner.eval_episodes=4"]
    assert _sft(run, toy_demos, "sft.steps=4", "runner.eval_scenes=validation", *common) == 0
    evals = [r for r in read_metrics(run) if "eval/success_rate" in r]
    assert [r["iteration"] for r in evals] == [2, 4]
    assert all(r["eval/first_reset_id"] == VALIDATION_RESET_ID_BASE for r in evals)
    best = max(evals, key=lambda r: (r["eval/success_rate"], r["iteration"]))
    assert best_checkpoint(run, "step").path.name == f"step_{best['iteration']}"


#: A 6-joint arm's dataset written by LeRobot's own writer (tests/data/fixtures).
SO100 = Path(__file__).parents[1] / "data" / "fixtures" / "lerobot_so100"


def test_lerobots_own_dataset_of_a_6d_arm_reads_back_as_written():
    from rlinf_vla.data import open_dataset

    ds = open_dataset(SO100)
    assert (
        ds.num_frames == 45 and len(ds.episodes) == 3 and ds.cameras == ["observation.images.front"]
    )
    frames = ds.load([0])
    state, image = frames["observation.state"], frames["images"]["observation.images.front"]
    assert state.shape == (15, 6) and image.shape == (15, 48, 64, 3)
    # the red square the writer drew at the first two joints' position (AV1 is lossy)
    for q, picture in zip(state, image, strict=True):
        y, x = int((q[1] + 1) * 20), int((q[0] + 1) * 28)
        r, g, b = picture[y + 2 : y + 6, x + 2 : x + 6].reshape(-1, 3).mean(0)
        assert r > 150 and g < 110 and b < 100, (q[:2], (r, g, b))


def test_without_evaluation_sft_takes_the_datasets_sizes_and_builds_no_env(nothing_starts):
    from rlinf_vla import cli
    from rlinf_vla.pipelines.sft import validate

    # the default env (ManiSkill) takes 7-D actions, 16 state values and a "main" camera
    job = validate(cli.compose("sft", [f"data.paths=[{SO100}]", "runner.eval_interval=0"]))
    assert job.env_config is None
    cfg = job.policy_config
    assert (cfg.action_dim, cfg.proprio_dim, tuple(cfg.image_keys)) == (6, 6, ("front",))


def test_with_evaluation_a_dataset_that_does_not_fit_the_env_names_both_sides(
    capsys, nothing_starts, tmp_path
):
    from rlinf_vla import cli

    code = cli.main(["sft", f"data.paths=[{SO100}]", f"runner.output_dir={tmp_path / 'run'}"])
    assert code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "env 'maniskill' takes 7-dim actions, the policy and data 6" in err
    assert "the policy reads camera(s) ['front'] that env 'maniskill' does not provide" in err
    assert err.count("or runner.eval_interval=0 to train without evaluating") == 3


@pytest.mark.ray
def test_lerobots_own_dataset_trains_without_a_simulator(tmp_path):
    from rlinf_vla import cli
    from rlinf_vla.run.tracking import read_metrics

    run = tmp_path / "so100"
    args = [f"data.paths=[{SO100}]", "runner.eval_interval=0", "sft.steps=40", "sft.lr=1e-3"]
    args += ["runner.save_interval=40", "runner.logging.tensorboard=false"]
    args += ["cluster.devices_per_node=1", f"runner.output_dir={run}"]
    assert cli.main(["sft", *args]) == 0
    loss = [r["train/loss"] for r in read_metrics(run)]
    assert len(loss) == 40 and np.mean(loss[-10:]) < 0.7 * np.mean(loss[:5])
    stats = json.loads((run / "checkpoints/step_40/policy/dataset_statistics.json").read_text())
    [(name, entry)] = stats.items()  # the dataset's statistics, as the official format keeps them
    assert name == "lerobot_so100" and len(entry["action"]["q99"]) == 6
    assert len(entry["proprio"]["mean"]) == 6


def _two_episodes(path, action_nan_at=None):
    """A LeRobot dataset of two 6-frame episodes (8 x 8 camera, 3-D state, 2-D action); with
    ``action_nan_at=(episode, frame)`` that frame's action is made NaN in the data file
    afterwards, as a writer that does not check would leave it (the statistics stay finite)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlinf_vla.data import LeRobotWriter

    rng = np.random.default_rng(0)
    with LeRobotWriter(path, fps=10, cameras={"main": (8, 8)}, state_dim=3, action_dim=2) as w:
        for _ in range(2):
            action = rng.uniform(-1, 1, (6, 2)).astype(np.float32)
            w.add_episode(
                images={"main": rng.integers(0, 255, (6, 8, 8, 3), dtype=np.uint8)},
                state=rng.normal(size=(6, 3)).astype(np.float32),
                action=action,
                task="go",
            )
    if action_nan_at is not None:
        [data_file] = (path / "data").rglob("*.parquet")
        table = pq.read_table(data_file)
        episode, frame = action_nan_at
        actions = table.column("action").to_pylist()
        actions[episode * 6 + frame][1] = float("nan")
        column = pa.array(actions, type=table.schema.field("action").type)
        table = table.set_column(table.schema.get_field_index("action"), "action", column)
        pq.write_table(table, data_file)
    return path


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            "nan action",
            "action holds NaN or inf in 1 frame(s), the first in episode 1 at frame 4",
        ),
        (
            "no stats.json",
            "meta/stats.json is missing (the policy normalises with the data's statistics)",
        ),
        ("nan stats", "the statistics ['q99'] of 'observation.state' hold NaN or inf"),
        ("state named otherwise", "data.state='observation.joints' is not a feature of"),
        ("truncated video", "the last its episodes need, does not decode"),
        ("mixed action sizes", "column 'action' has 6 values for 6 rows of shape [2]"),
        ("images of another size", "frames are 8x8, feature observation.images.main says 16x16"),
    ],
)
def test_datasets_that_cannot_train_are_refused_before_anything_starts(
    tmp_path, capsys, nothing_starts, damage, message
):
    from rlinf_vla import cli

    ds = _two_episodes(tmp_path / "ds", action_nan_at=(1, 4) if damage == "nan action" else None)
    extra = []
    if damage == "no stats.json":
        (ds / "meta" / "stats.json").unlink()
    elif damage == "nan stats":
        stats = json.loads((ds / "meta" / "stats.json").read_text())
        stats["observation.state"]["q99"][1] = float("nan")
        (ds / "meta" / "stats.json").write_text(json.dumps(stats))
    elif damage == "state named otherwise":
        extra = ["data.state=observation.joints"]
    elif damage == "truncated video":  # a copy cut short: the last frames are gone
        [video] = (ds / "videos").rglob("*.mp4")
        video.write_bytes(video.read_bytes()[: video.stat().st_size // 2])
    elif damage == "mixed action sizes":  # episode 1 written by an arm with one joint less
        import pyarrow as pa
        import pyarrow.parquet as pq

        [data_file] = (ds / "data").rglob("*.parquet")
        table = pq.read_table(data_file)
        episodes = table.column("episode_index").to_pylist()
        actions = [
            a[:1] if e == 1 else a
            for a, e in zip(table.column("action").to_pylist(), episodes, strict=True)
        ]
        column = pa.array(actions, type=pa.list_(pa.float32()))
        pq.write_table(
            table.set_column(table.schema.get_field_index("action"), "action", column), data_file
        )
    elif damage == "images of another size":  # the metadata says 16 x 16, the video is 8 x 8
        info = json.loads((ds / "meta" / "info.json").read_text())
        feature = info["features"]["observation.images.main"]
        feature["shape"] = [16, 16, 3]
        for k in ("video.height", "video.width"):
            if k in feature.get("info", {}):
                feature["info"][k] = 16
        (ds / "meta" / "info.json").write_text(json.dumps(info))
    args = ["sft", f"data.paths=[{ds}]", "runner.eval_interval=0", *extra]
    assert cli.main([*args, f"runner.output_dir={tmp_path / 'run'}"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "Traceback" not in err
    if damage == "state named otherwise":
        assert "['action', 'observation.state'" in err and "data.state=null" in err


def test_frames_that_cannot_train_name_their_dataset_episode_and_frame():
    from rlinf_vla.pipelines.demos import check_frames

    n = 8
    data = {
        "episode_index": np.repeat([0, 1], 4),
        "frame_index": np.tile(np.arange(4), 2),
        "action": np.zeros((n, 2), np.float32),
        "observation.state": np.zeros((n, 3), np.float32),
        "images": {"observation.images.main": np.zeros((n, 8, 8, 3), np.uint8)},
    }
    fmap = FeatureMap({"main": "observation.images.main"}, "observation.state", "action")
    check_frames("data/x", data, fmap)  # a good one passes
    data["observation.state"][6, 0] = np.inf
    with pytest.raises(
        ValueError,
        match=r"data/x: observation.state holds NaN or inf in 1 frame\(s\), the first in episode 1 at frame 2",
    ):
        check_frames("data/x", data, fmap)
    data["observation.state"][6, 0] = 0
    data["images"]["observation.images.main"] = np.zeros((n, 8, 8), np.float32)
    with pytest.raises(ValueError, match=r"camera 'main' .* float32 \[8, 8, 8\], expected uint8"):
        check_frames("data/x", data, fmap)
