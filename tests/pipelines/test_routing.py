"""The routing table of `rlinf-vla train`: every env stage served by one rollout worker and
trained on by one actor worker, dealt out round-robin; with several env and rollout workers a
run is the same whichever rollout worker finishes first."""

import json

import pytest

from rlinf_vla.pipelines.routing import Routing


def test_round_robin_table_by_hand():
    routing = Routing.round_robin(env_workers=2, stages=2, rollout_workers=3, actor_workers=2)
    assert routing.table() == [
        "env 0 stage 0 -> rollout 0 -> actor 0",
        "env 0 stage 1 -> rollout 1 -> actor 1",
        "env 1 stage 0 -> rollout 2 -> actor 0",
        "env 1 stage 1 -> rollout 0 -> actor 1",
    ]
    assert routing.served_by(0) == ([(0, 0), (1, 1)], ["trajectory/0", "trajectory/1"])
    assert routing.served_by(2) == ([(1, 0)], ["trajectory/0"])
    assert [routing.rollout_of(src) for src in [(0, 0), (0, 1), (1, 0), (1, 1)]] == [0, 1, 2, 0]
    with pytest.raises(KeyError, match=r"\(2, 0\)"):
        routing.rollout_of((2, 0))
    assert [routing.trajectories_for(a) for a in (0, 1)] == [2, 2]


@pytest.mark.parametrize(("envs", "stages", "rollouts", "actors"), [(1, 1, 1, 1), (3, 2, 2, 4)])
def test_every_source_has_exactly_one_route(envs, stages, rollouts, actors):
    routing = Routing.round_robin(envs, stages, rollouts, actors)
    served = [src for w in range(rollouts) for src in routing.served_by(w)[0]]
    assert sorted(served) == [(e, s) for e in range(envs) for s in range(stages)]
    assert sum(routing.trajectories_for(a) for a in range(actors)) == envs * stages


@pytest.mark.slow
@pytest.mark.ray
def test_two_env_and_two_rollout_workers_give_the_same_run_twice(tmp_path):
    """Two env workers of two stages each, served by two rollout workers over their own
    channels: the same run twice, whichever rollout worker finishes first."""
    from rlinf_vla import cli

    args = [
        "env=toy",
        "env.num_envs=8",
        "env.max_episode_steps=8",
        "runner.rollout_chunks=4",
        "algo.update_epochs=1",
        "placement=disaggregated",
        "cluster.devices_per_node=5",
        "placement.components.env=0-1",
        "placement.components.rollout=2-3",
        "placement.components.actor=4",
        "placement.stages=2",
        "runner.max_iterations=2",
        "runner.eval_interval=0",
        "runner.seed=5",
    ]
    rows = []
    # the second run through Ray calls, the first over same-node pipes: the transport changes
    # nothing either
    for run, pipes in (("a", "true"), ("b", "false")):
        out = f"runner.output_dir={tmp_path / run}"
        assert cli.main(["train", *args, out, f"cluster.pipes={pipes}"]) == 0
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        rows.append([json.loads(line) for line in lines])
    for a, b in zip(*rows, strict=True):
        for key in (
            "env/episode_return",
            "train/policy_loss",
            "train/value_loss",
            "train/grad_norm",
        ):
            assert a[key] == b[key], key
