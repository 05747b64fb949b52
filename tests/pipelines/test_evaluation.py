"""greedy_eval: episode outcomes checked against scripted policies whose results are known."""

from __future__ import annotations

import torch
from torch import nn

from rlinf_vla.envs import make_env
from rlinf_vla.pipelines.evaluation import EVAL_RESET_ID_BASE, eval_reset_ids, greedy_eval
from rlinf_vla.types import ActOutput, Observation


class _Scripted(nn.Module):
    """A policy that plays the env's oracle (``greedy``) or stands still (``greedy=False``).

    It records the ``greedy`` flags and the training mode it was called with.
    """

    def __init__(self, env, chunk: int) -> None:
        super().__init__()
        self.env, self.chunk = env, chunk
        self.calls: list[tuple[bool, bool]] = []
        self.lin = nn.Linear(1, 1)

    def act(self, obs: Observation, greedy: bool = False) -> ActOutput:
        self.calls.append((greedy, self.training))
        actions = self.env.oracle_actions(self.chunk)
        if not greedy:
            actions = torch.zeros_like(actions)
        return ActOutput(actions=actions, logprob=torch.zeros(obs.batch_size), value=None)


def _oracle_length(env_kwargs: dict, reset_id: int) -> int:
    """Steps the oracle needs from ``reset_id``, stepping one action at a time."""
    env = make_env("toy", num_envs=1, **env_kwargs)
    env.reset([reset_id])
    for step in range(1, env.max_episode_steps + 1):
        res = env.chunk_step(env.oracle_actions(1))
        if res.info["done"][0]:
            return step
    raise AssertionError("the oracle did not finish")


def test_oracle_succeeds_on_every_episode_with_exact_lengths() -> None:
    kwargs = {"max_episode_steps": 20}
    env = make_env("toy", num_envs=4, **kwargs)
    policy = _Scripted(env, chunk=3).train()
    # 10 episodes on 4 envs: three rounds, the last one padded.
    result = greedy_eval(policy, env, episodes=10)
    assert torch.equal(result.reset_ids, eval_reset_ids(10))
    assert result.reset_ids[0] == EVAL_RESET_ID_BASE
    assert result.success.all() and not result.invalid.any()
    assert result.success_rate == 1.0
    expected = [_oracle_length(kwargs, int(i)) for i in result.reset_ids]
    assert result.episode_length.tolist() == expected
    # Sparse reward: exactly 1 per successful episode.
    assert torch.equal(result.episode_return, torch.ones(10))
    m = result.metrics()
    assert m["eval/success_rate"] == 1.0
    assert m["eval/episodes"] == 10.0
    assert m["eval/episode_length"] == sum(expected) / 10
    # Greedy actions, eval mode during the call, training mode restored afterwards.
    assert all(call == (True, False) for call in policy.calls)
    assert policy.training


def test_failures_run_to_the_time_limit() -> None:
    env = make_env("toy", num_envs=3, max_episode_steps=7)
    policy = _Scripted(env, chunk=2)
    result = greedy_eval(policy, env, episodes=5, greedy=False)  # stands still
    assert not result.success.any()
    assert result.success_rate == 0.0
    assert result.episode_length.tolist() == [7] * 5  # 4 chunks of 2, the last cut at the limit
    assert torch.equal(result.episode_return, torch.zeros(5))


def test_explicit_reset_ids_and_determinism() -> None:
    env = make_env("toy", num_envs=2, max_episode_steps=6)
    policy = _Scripted(env, chunk=2)
    ids = [3, 14, 15, 92, 65]
    a = greedy_eval(policy, env, episodes=5, reset_ids=ids)
    b = greedy_eval(policy, env, episodes=5, reset_ids=ids)
    assert a.reset_ids.tolist() == ids
    for key in ("success", "episode_return", "episode_length"):
        assert torch.equal(getattr(a, key), getattr(b, key))
    # Within 6 steps the oracle reaches only the nearer targets: each episode as a one-env run.
    for i, rid in enumerate(ids):
        assert bool(a.success[i]) == (_oracle_length({"max_episode_steps": 30}, rid) <= 6)
    assert 0 < int(a.success.sum()) < 5  # both outcomes occur, so the check above bites


def _dense_oracle_return(kwargs: dict, reset_id: int) -> float:
    """1 + scale * (d_start - d_success) / step_size, distances measured from the env state."""
    env = make_env("toy", num_envs=1, **kwargs)
    obs = env.reset([reset_id])
    target = env.target_pos[0].clone()
    d0 = float(torch.linalg.vector_norm(obs.state[0] - target))
    for _ in range(env.max_episode_steps):
        res = env.chunk_step(env.oracle_actions(1))
        if res.info["done"][0]:
            d = float(torch.linalg.vector_norm(res.final_obs.state[0] - target))
            return 1.0 + kwargs["progress_reward_scale"] * (d0 - d) / 0.06
    raise AssertionError("the oracle did not finish")


def test_dense_reward_return_is_the_telescoping_sum() -> None:
    kwargs = {"max_episode_steps": 20, "reward_mode": "dense", "progress_reward_scale": 0.1}
    env = make_env("toy", num_envs=4, **kwargs)
    result = greedy_eval(_Scripted(env, chunk=4), env, episodes=4)
    assert result.success.all()
    expected = torch.tensor([_dense_oracle_return(kwargs, int(i)) for i in result.reset_ids])
    assert torch.allclose(result.episode_return, expected, atol=1e-5)
    assert (expected > 1.3).all()  # the progress term is really there


def test_video_of_the_first_env(tmp_path) -> None:
    env = make_env("toy", num_envs=2, max_episode_steps=10)
    result = greedy_eval(_Scripted(env, chunk=4), env, episodes=4, video_dir=tmp_path)
    assert result.success.all()
    names = sorted(p.name for p in tmp_path.glob("*.mp4"))
    # env 0 ran one episode in each of the two rounds
    assert names == ["eval_env0_ep0_success.mp4", "eval_env0_ep1_success.mp4"]
    assert sorted(result.videos) == sorted(str(tmp_path / n) for n in names)
    import imageio.v3 as iio

    frames = iio.imread(tmp_path / names[0])
    # one frame for the reset and one per env step
    assert frames.shape[0] == int(result.episode_length[0]) + 1
