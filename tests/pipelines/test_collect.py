"""`rlinf-vla collect`: expert episodes -> LeRobotDataset -> the same frames read back."""

import json

import numpy as np
import pytest
import torch

from rlinf_vla import cli
from rlinf_vla.data import open_dataset
from rlinf_vla.envs import make_env

PUSH = {"task": "PushCube-v1", "image_size": 32, "sim_backend": "cpu", "state_mode": "privileged"}


def _replay(rounds):
    """The expert's episodes stepped here, without the collect command, in two envs and in
    ``rounds`` of reset ids as collect runs them (PhysX's CPU solver carries a little history
    across resets, so the same order gives the same numbers): per episode the images, states
    and actions it saw and took."""
    env = make_env("maniskill", **PUSH, num_envs=2, auto_reset=False)
    episodes = []
    try:
        for ids in rounds:
            obs = env.reset(ids)
            frames = [{"main": [], "state": [], "action": []} for _ in ids]
            running = torch.ones(2, dtype=torch.bool)
            while running.any():
                a = env.expert_actions()
                for i in torch.nonzero(running).flatten().tolist():
                    frames[i]["main"].append(obs.images["main"][i].numpy())
                    frames[i]["state"].append(obs.state[i].numpy())
                    frames[i]["action"].append(a[i].numpy())
                result = env.chunk_step(a[:, None])
                running &= ~result.info["done"]
                obs = result.obs
            episodes += [{k: np.stack(v) for k, v in f.items()} for f in frames]
    finally:
        env.close()
    return episodes


@pytest.mark.sim
@pytest.mark.slow
def test_collected_maniskill_episodes_read_back_as_the_expert_played_them(tmp_path):
    pytest.importorskip("mani_skill")
    out = tmp_path / "push"
    overrides = [f"env.{k}={v}" for k, v in PUSH.items()]
    args = [
        "collect",
        *overrides,
        "env.num_envs=2",
        "collect.episodes=3",
        f"collect.output_dir={out}",
    ]
    args.append("collect.first_reset_id=7")
    assert cli.main(args) == 0
    summary = json.loads((out / "meta" / "collect.json").read_text())
    assert summary["kept"] == 3 and summary["attempted"] == 3
    assert summary["reset_ids"] == [7, 8, 9]  # the expert succeeds on all three
    ds = open_dataset(out)
    assert ds.version == "v3.0" and ds.fps == 20 and ds.robot_type == "panda"
    assert ds.tasks == ["push the blue cube onto the red and white target"]
    data = ds.load()
    want = _replay([[7, 8], [9, 10]])[:3]
    assert [e.length for e in ds.episodes] == [len(e["action"]) for e in want]
    np.testing.assert_array_equal(data["action"], np.concatenate([e["action"] for e in want]))
    np.testing.assert_array_equal(
        data["observation.state"], np.concatenate([e["state"] for e in want])
    )
    frames = data["images"]["observation.images.main"].astype(np.float64)
    rendered = np.concatenate([e["main"] for e in want]).astype(np.float64)
    # H.264 (crf 12, 4:2:0 chroma) on 32 x 32 renders: colour edges blur over 2 x 2 pixels
    assert np.abs(frames - rendered).mean() < 6.0
    # statistics over all frames, computed here with numpy
    stats = ds.stats["action"]
    np.testing.assert_allclose(stats["mean"], data["action"].mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        stats["q99"], np.quantile(data["action"], 0.99, axis=0), rtol=1e-5, atol=1e-6
    )


def test_collect_refuses_what_it_cannot_do_before_starting(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = [
        (["env=libero"], "has no scripted expert"),
        (["env=maniskill", "env.task=PegInsertionSide-v1"], "tasks with an expert"),
        (["env=maniskill", "env.control_mode=pd_joint_delta_pos"], "pd_ee_delta_pose"),
        ([f"collect.output_dir={tmp_path / 'full'}"], "collect.overwrite=true"),
        (["collect.output_dir=null"], "collect.output_dir"),
    ]
    for extra, message in cases:
        args = ["collect", f"collect.output_dir={tmp_path / 'new'}", *extra]
        assert cli.main(args) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert not (tmp_path / "new").exists()


def test_toy_collection_keeps_only_successes(tmp_path):
    # 6-step episodes on the toy env: the expert cannot reach far targets in time, so some
    # episodes fail; they are counted, not written.
    out = tmp_path / "toy"
    args = ["collect", "env=toy", "env.max_episode_steps=6", "env.num_envs=4"]
    args += ["collect.episodes=4", "collect.max_attempts=40", f"collect.output_dir={out}"]
    assert cli.main(args) == 0
    summary = json.loads((out / "meta" / "collect.json").read_text())
    assert summary["kept"] == 4 and summary["attempted"] > 4
    # the kept episodes are the ones the expert solves, checked on a fresh env
    env = make_env("toy", max_episode_steps=6, num_envs=1, auto_reset=False)
    tried = range(summary["attempted"])
    solved = []
    for rid in tried:
        env.reset([rid])
        done = success = False
        while not done:
            r = env.chunk_step(env.expert_actions()[:, None])
            done, success = bool(r.info["done"][0]), success or bool(r.success[0])
        solved += [rid] if success else []
    assert summary["reset_ids"] == solved[:4]
    assert len(open_dataset(out).episodes) == 4
    # an expert that never succeeds: a clear error, and no dataset
    args[2] = "env.max_episode_steps=1"
    args[-1] = f"collect.output_dir={tmp_path / 'none'}"
    assert cli.main(args) == 1
    assert not (tmp_path / "none").exists()
