"""``algo=dagger``: the expert-labelled samples of a rollout, their aggregate, and DAgger end to end
on the toy env (it learns the oracle from random weights; a resumed run continues the aggregate)."""

from __future__ import annotations

import json

import pytest
import torch

from rlinf_vla import cli
from rlinf_vla.pipelines.rollout import Trajectory
from rlinf_vla.training.dagger import Aggregate, expert_samples
from rlinf_vla.types import Observation
from tests.pipelines.test_sft import TOY as TOY_TASK


def _obs(values: list[float]) -> Observation:
    n = len(values)
    return Observation(
        images={"main": torch.full((n, 2, 2, 3), 0, dtype=torch.uint8)},
        state=torch.tensor(values)[:, None],
        instruction=[f"task {v}" for v in values],
    )


def _trajectory(invalid: torch.Tensor) -> Trajectory:
    T, b, K, A = 2, 3, 2, 1
    expert = torch.arange(T * b * K * A, dtype=torch.float32).view(T, b, K, A)
    return Trajectory(
        obs=[_obs([10.0 * t + i for i in range(b)]) for t in range(T)],
        replay={},
        actions=expert + 0.5,  # every entry sent 0.5 away from the expert's label
        logprob=torch.zeros(T, b),
        value=torch.zeros(T + 1, b),
        final_value=torch.zeros(T, b),
        reward=torch.zeros(T, b, K),
        terminated=torch.zeros(T, b, K, dtype=torch.bool),
        truncated=torch.zeros(T, b, K, dtype=torch.bool),
        invalid=invalid,
        source=(0, 0),
        expert=expert,
    )


def test_samples_are_each_chunk_steps_observation_with_the_experts_labels():
    invalid = torch.tensor([[False, True, False], [False, False, False]])
    obs, targets, stats = expert_samples([_trajectory(invalid)])
    # the crashed chunk (step 0, env 1) is left out; the rest in time-major order
    assert obs.state[:, 0].tolist() == [0.0, 2.0, 10.0, 11.0, 12.0]
    assert obs.instruction == ["task 0.0", "task 2.0", "task 10.0", "task 11.0", "task 12.0"]
    expert = _trajectory(invalid).expert
    want = torch.stack([expert[0, 0], expert[0, 2], expert[1, 0], expert[1, 1], expert[1, 2]])
    assert torch.equal(targets, want)
    assert stats["action_error"] == pytest.approx(0.5)


def test_samples_without_labels_fail_naming_the_stage():
    traj = _trajectory(torch.zeros(2, 3, dtype=torch.bool))
    traj.expert = None
    with pytest.raises(ValueError, match=r"env stage \(0, 0\) carries no expert labels"):
        expert_samples([traj])


def test_the_aggregate_keeps_everything_or_the_newest_and_survives_a_checkpoint():
    actions = torch.arange(5.0)[:, None, None]
    unbounded, bounded = Aggregate(), Aggregate(capacity=3)
    for agg in (unbounded, bounded):
        agg.add(_obs([0.0, 1.0]), actions[:2])
        agg.add(_obs([2.0, 3.0, 4.0]), actions[2:])
    assert len(unbounded) == 5 and unbounded.seen == 5
    assert len(bounded) == 3 and bounded.seen == 5
    assert bounded.obs.state[:, 0].tolist() == [2.0, 3.0, 4.0]  # the oldest went first
    assert bounded.actions.flatten().tolist() == [2.0, 3.0, 4.0]
    # a sample's observation and target stay together
    obs, targets = unbounded.sample(64, torch.Generator().manual_seed(0))
    assert torch.equal(obs.state[:, 0], targets.flatten())
    assert set(targets.flatten().tolist()) == {0.0, 1.0, 2.0, 3.0, 4.0}
    again = Aggregate(capacity=2)  # a resume with a tighter bound keeps the newest
    again.load_state_dict(unbounded.state_dict())
    assert again.seen == 5 and again.actions.flatten().tolist() == [3.0, 4.0]
    assert again.obs.instruction == ["task 3.0", "task 4.0"]
    with pytest.raises(ValueError, match="2 observations for 3 target chunks"):
        unbounded.add(_obs([0.0, 1.0]), actions[:3])


# The toy task of the SFT tests (one target, the agent starts in the centre), as DAgger runs it.
TOY = [
    *TOY_TASK,
    "env.num_envs=8",
    "policy=openvla_oft",
    "policy.chunk_size=2",
    "algo=dagger",
    "algo.lr=1e-3",
    "algo.minibatch_size=32",
    "runner.rollout_chunks=8",
    "runner.eval_videos=false",
    "runner.logging.tensorboard=false",
    "cluster.devices_per_node=1",
]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_dagger_learns_the_toy_oracle_from_random_weights(tmp_path):
    # The policy acts from its random weights, the oracle labels where it went, and the policy
    # learns the labels: greedy success on 32 held-out scenes from at most 0.3 after the first
    # iteration to at least 0.8 after the tenth (1.0 when the settings were chosen).
    run = tmp_path / "dagger"
    args = [*TOY, "placement=local", "algo.update_epochs=16", "runner.max_iterations=10"]
    args += ["runner.eval_interval=1", "runner.eval_episodes=32", f"runner.output_dir={run}"]
    assert cli.main(["train", *args]) == 0
    rows = _rows(run)
    assert rows[0]["eval/success_rate"] <= 0.3
    assert rows[-1]["eval/success_rate"] >= 0.8
    assert rows[-1]["train/loss"] < 0.5 * rows[0]["train/loss"]
    assert rows[-1]["dagger/action_error"] < 0.5 * rows[0]["dagger/action_error"]
    # every chunk step of every iteration joins the aggregate: 8 envs x 8 chunks each
    assert [r["dagger/aggregate_samples"] for r in rows] == [64.0 * i for i in range(1, 11)]
    assert all(r["train/update_steps"] == 16 * 2 for r in rows)  # 16 epochs of 64 / 32


@pytest.mark.slow
def test_a_resumed_dagger_run_continues_its_aggregate(tmp_path):
    # A run resumed from its checkpoint after iteration 2 takes the same steps as one that ran
    # through, on an aggregate that holds every iteration's samples.
    common = [*TOY, "placement=local", "env.num_envs=4", "algo.update_epochs=2"]
    common += ["runner.eval_interval=0"]
    common += ["runner.save_interval=2", "runner.seed=5"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli.main(["train", *common, "runner.max_iterations=3", f"runner.output_dir={full}"]) == 0
    assert cli.main(["train", *common, "runner.max_iterations=2", f"runner.output_dir={part}"]) == 0
    again = ["runner.max_iterations=3", f"runner.resume={part}", f"runner.output_dir={part}"]
    assert cli.main(["train", *common, *again]) == 0
    expected, resumed = _rows(full), _rows(part)
    assert [r["dagger/aggregate_samples"] for r in resumed] == [32.0, 64.0, 96.0]
    for a, b in zip(expected, resumed, strict=True):
        for key in ("train/loss", "train/grad_norm", "dagger/action_error", "env/episode_return"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
