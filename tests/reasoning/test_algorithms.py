"""Every algorithm in `rlinf-vla math-grpo`: PPO's critic (a value head on the last hidden state,
per-token GAE) against hand-computed numbers, and two steps of each algorithm end to end."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlinf_vla.reasoning.config import MathAlgoConfig
from rlinf_vla.reasoning.model import make_token_batch, response_logprobs
from rlinf_vla.reasoning.trainer import MathGrpoRunner
from rlinf_vla.reasoning.workers import Sequence
from rlinf_vla.training.objective import Counts
from tests.reasoning.conftest import math_actor, small_run_args


def test_ppo_gae_over_tokens_by_hand() -> None:
    """Two responses (3 and 1 tokens) scored 1 and 0; the critic's values come from the actor."""
    algo = MathAlgoConfig(name="ppo", gamma=0.5, lam=0.5, normalize_advantages=False)
    values = [[0.5, 0.25, 1.0], [0.2]]
    asked = []

    def scatter(method, seqs, args):
        asked.append(method)
        return [values]  # one actor rank, the responses in order

    runner = SimpleNamespace(
        job=SimpleNamespace(algo=algo), actor=SimpleNamespace(scatter=scatter), pad_id=0
    )
    groups = [{"prompt": [1], "responses": [[4, 5, 6], [7]], "score": torch.tensor([1.0, 0.0])}]
    seqs = MathGrpoRunner.sequences(runner, groups)
    assert asked == ["token_values"]
    # response 0: rewards (0, 0, 1), V (0.5, 0.25, 1.0), V after the last token 0:
    #   delta_2 = 1 - 1.0 = 0;  delta_1 = 0 + 0.5 * 1.0 - 0.25 = 0.25;  delta_0 = 0.125 - 0.5
    #   A_2 = 0;  A_1 = 0.25 + 0.25 * 0 = 0.25;  A_0 = -0.375 + 0.25 * 0.25 = -0.3125
    assert seqs[0].advantages == pytest.approx([-0.3125, 0.25, 0.0])
    assert seqs[0].returns == pytest.approx([0.1875, 0.5, 1.0])  # A + V
    assert seqs[0].values == pytest.approx([0.5, 0.25, 1.0])
    # response 1: one token, reward 0: A = 0 - 0.2
    assert seqs[1].advantages == pytest.approx([-0.2])
    assert seqs[1].returns == pytest.approx([0.0])


def test_ppo_trains_its_value_head_and_keeps_it_in_checkpoints(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    actor = math_actor(tiny_model_dir, name="ppo", lr=1e-3, value_lr=1e-2)
    head = actor.value_head
    assert head is not None
    assert {id(p) for p in actor.optimizer.param_groups[1]["params"]} == {
        id(p) for p in head.parameters()
    }
    prompt, response = [3, 4, 5], [6, 7]
    seq = Sequence(prompt, response, [0.5, -0.5], returns=[1.0, 2.0], values=[0.0, 0.0])

    def values() -> list[float]:
        return actor.token_values([seq], pad_id=0)[0]

    def value_error() -> float:
        return sum((v - r) ** 2 for v, r in zip(values(), seq.returns, strict=True))

    assert values() == [0.0, 0.0]  # the head starts at zero
    before = value_error()
    for step in range(5):
        metrics = actor.train([[seq]], [Counts(2.0, value=2.0, tokens=2.0)], [True], 0, step)
        assert metrics["train/value_loss"] > 0
    assert value_error() < before  # the values moved towards the returns
    trained = [v.clone() for v in head.state_dict().values()]
    actor.save(str(tmp_path))
    fresh = math_actor(tiny_model_dir, name="ppo", lr=1e-3, value_lr=1e-2)
    fresh.load(str(tmp_path))
    for a, b in zip(trained, fresh.value_head.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # the policy's log-probs and the critic's values come from one forward pass
    batch = make_token_batch([prompt], [response], 0)
    with torch.no_grad():
        logprob, vals = response_logprobs(fresh.model, batch, 64, 1.0, fresh.value_head)
        alone = response_logprobs(fresh.model, batch, 64, 1.0)
    assert torch.equal(logprob, alone)
    assert vals[0].tolist() == pytest.approx(values(), abs=1e-6)


def test_a_run_without_a_critic_has_no_value_head(tiny_model_dir: Path) -> None:
    for name in ("grpo", "rloo", "reinforce_pp", "dapo"):
        actor = math_actor(tiny_model_dir, name=name)
        assert actor.value_head is None and len(actor.optimizer.param_groups) == 1, name


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("algo", ["ppo", "rloo", "dapo", "reinforce_pp"])
def test_each_algorithm_trains_two_steps(tiny_model_dir: Path, tmp_path: Path, algo: str) -> None:
    from rlinf_vla import cli
    from rlinf_vla.run.tracking import read_metrics

    args = [
        *small_run_args(tiny_model_dir, tmp_path),
        f"algo={algo}",
        "runner.max_steps=2",
        "runner.eval_interval=0",
        "runner.save_interval=2",
        "cluster.num_cpus=2",
    ]
    if algo == "reinforce_pp":
        args.append("algo.kl_coef=0.01")  # the KL folded into the reward
    assert cli.main(["math-grpo", *args]) == 0
    rows = read_metrics(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [1, 2]
    for row in rows:
        assert row["response/tokens"] > 0
        if row["train/updates"]:
            assert row["train/grad_norm"] >= 0 and "train/policy_loss" in row
    if algo == "ppo":
        # A resumed PPO run gets its critic back through the same ActorWorker.load as
        # test_ppo_trains_its_value_head_and_keeps_it_in_checkpoints (the value head, its
        # optimizer group); a resumed math-grpo run calls it as in
        # tests/reasoning/test_math_grpo.py::test_two_steps_end_to_end_then_resume.
        assert any("train/value_loss" in r for r in rows)
