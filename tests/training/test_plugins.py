"""A new policy loss and new advantage estimators, registered with what they declare and named
by a preset, are what both trainers call, with no other edit: the embodied actor's update
(``rlinf-vla train``) and the ``math-grpo`` trainer's advantages and loss step."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlinf_vla.algos import ADVANTAGES, ALGORITHMS, LOSSES, aggregate, masked_mean
from rlinf_vla.algos.advantages import KIND_INPUTS, SETTINGS, gae, grpo, reinforce_pp
from rlinf_vla.algos.presets import (
    PRESET_KEYS,
    AlgorithmPreset,
    estimate,
    estimator_kind,
    load_preset,
)
from rlinf_vla.config import ConfigError
from rlinf_vla.reasoning.config import MathAlgoConfig
from rlinf_vla.reasoning.trainer import MathGrpoRunner
from rlinf_vla.training.algo_config import AlgoConfig
from rlinf_vla.training.batch import build_batch
from rlinf_vla.training.batch import trajectory_advantages as _advantages
from rlinf_vla.training.objective import Counts, LossSettings, objective
from tests.policies.conftest import make_obs
from tests.reasoning.conftest import build_tiny_model, math_actor
from tests.training.actors import local_actor
from tests.training.test_advantages import _episodes

#: what the test loss reports as its clip fraction (PPO's at ratio 1 is 0)
MARK = 0.25
#: the keywords both trainers pass to a policy loss
POLICY_LOSS_INPUTS = {
    "logprob",
    "old_logprob",
    "advantages",
    "mask",
    "clip_low",
    "clip_high",
    "dual_clip",
    "agg",
    "denominator",
    "weight",
}
PRESET = """name: test_pg
advantage: test_vs_worst
policy_loss: test_pg
clip_high: 0.3
normalize_std: false
agg: token-mean
"""


@pytest.fixture
def registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ADVANTAGES``, ``LOSSES`` and ``ALGORITHMS`` as they are now, restored after the test."""
    for registry in (ADVANTAGES, LOSSES, ALGORITHMS):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))


@pytest.fixture
def calls(registries: None, tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    """The recipe of docs/algorithms.md: the policy loss ``test_pg`` and the group estimator
    ``test_vs_worst`` registered, and the preset ``test_pg`` naming them read from its YAML.
    Returns the keywords of each call of either, by name."""
    record: dict[str, list[dict[str, Any]]] = {"test_pg": [], "test_vs_worst": []}

    @LOSSES.register("test_pg", term="policy")
    def unclipped_pg(
        *,
        logprob,
        old_logprob,
        advantages,
        mask,
        clip_low,
        clip_high,
        dual_clip,
        agg,
        denominator,
        weight,
    ):
        """The importance-weighted policy gradient without a clip, ``L_t = -w_t A_t r_t``.
        Shapes: ``[N, ...]`` -> 0-d."""
        record["test_pg"].append(
            {"clip_low": clip_low, "clip_high": clip_high, "weight": weight, "agg": agg}
        )
        ratio = torch.exp(logprob - old_logprob)
        losses = -advantages * ratio * (1.0 if weight is None else weight)
        loss = aggregate(losses, mask, agg, denominator)
        with torch.no_grad():
            zero = torch.zeros(())
            metrics = {
                "clip_fraction": zero + MARK,
                "dual_clip_fraction": zero,
                "approx_kl": masked_mean((ratio - 1) - (logprob - old_logprob), mask),
                "ratio_mean": masked_mean(ratio, mask),
            }
        return loss, metrics

    @ADVANTAGES.register("test_vs_worst", kind="group", settings=("normalize_std",))
    def vs_worst(*, scores, group_size, normalize_std):
        """``A_i = s_i - min_g(s)``, divided by the group's range with ``normalize_std``.
        Shapes: ``scores [N]`` -> ``[N]``."""
        record["test_vs_worst"].append(
            {"scores": scores.tolist(), "group_size": group_size, "normalize_std": normalize_std}
        )
        s = scores.view(-1, group_size)
        low = s.min(dim=1, keepdim=True).values
        adv = s - low
        if normalize_std:
            adv = adv / (s.max(dim=1, keepdim=True).values - low + 1e-6)
        return adv.reshape(-1), scores.clone()

    (tmp_path / "test_pg.yaml").write_text(PRESET)
    ALGORITHMS.add("test_pg", load_preset(tmp_path / "test_pg.yaml"))
    return record


def test_the_embodied_actor_updates_with_the_registered_estimator_and_loss(calls):
    actor = local_actor(
        "openvla",
        {
            "name": "test_pg",
            "group_size": 2,
            "update_epochs": 1,
            "minibatch_size": 12,
            "micro_batch_size": 6,
        },
        preset="tiny",
        chunk_size=1,
        seed=0,
    )
    # _episodes: 4 envs in groups of 2 over 3 chunk steps, first-episode scores (1, 0 | 1, 1);
    # the observations, replay and log-probs are the policy's own (every ratio starts at 1)
    traj = _episodes()
    obs = [make_obs(4, seed=t) for t in range(traj.num_steps)]
    with torch.no_grad():
        acts = [actor.policy.act(o) for o in obs]
    traj = dataclasses.replace(
        traj,
        obs=obs,
        replay={k: torch.stack([a.replay[k] for a in acts]) for k in acts[0].replay},
        logprob=torch.stack([a.logprob for a in acts]),
    )
    metrics = actor.updater.update(build_batch([traj], actor.algo), 0, total_iterations=1)

    assert calls["test_vs_worst"] == [
        {"scores": [1.0, 0.0, 1.0, 1.0], "group_size": 2, "normalize_std": False}
    ]
    # advantages (1, 0 | 0, 0) on each of the 3 steps
    assert metrics["train/advantage_mean"] == pytest.approx(0.25)
    assert len(calls["test_pg"]) == 2  # two micro-batches of 6 (algo.micro_batch_size)
    for call in calls["test_pg"]:
        assert (call["clip_low"], call["clip_high"], call["agg"]) == (0.2, 0.3, "token-mean")
        assert call["weight"] is not None  # episode_weight=equal weighs the scored episodes
    assert metrics["train/clip_fraction"] == pytest.approx(MARK)
    # at ratio 1: -sum(w A) / valid samples; env 0 (A = 1) has 2 of the 9 valid steps, each
    # weighing mean length / its length = 2.25 / 2
    assert metrics["train/policy_loss"] == pytest.approx(-2 * 1.125 / 9, rel=1e-4)
    assert metrics["train/update_steps"] == 1.0


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_lm"))


def test_math_grpo_uses_the_registered_estimator_and_loss(calls, tiny_lm):
    algo = MathAlgoConfig(name="test_pg", group_size=2)
    runner = SimpleNamespace(job=SimpleNamespace(algo=algo), actor=None, pad_id=0)
    groups = [
        {"prompt": [3, 4], "responses": [[5, 6], [7]], "score": torch.tensor([1.0, 0.0])},
        {"prompt": [8], "responses": [[9, 10, 11], [12]], "score": torch.tensor([3.0, 1.0])},
    ]
    seqs = MathGrpoRunner.sequences(runner, groups)
    assert calls["test_vs_worst"] == [
        {"scores": [1.0, 0.0, 3.0, 1.0], "group_size": 2, "normalize_std": False}
    ]
    assert [s.advantages for s in seqs] == [[1.0, 1.0], [0.0], [2.0, 2.0, 2.0], [0.0]]

    actor = math_actor(tiny_lm, name="test_pg", skip_zero_advantage=False)
    metrics = actor.train([seqs], [Counts(policy=7.0, tokens=7.0)], [True], 0, 0)
    assert len(calls["test_pg"]) == 1
    call = calls["test_pg"][0]
    assert (call["clip_low"], call["clip_high"], call["agg"]) == (0.2, 0.3, "token-mean")
    assert call["weight"] is None
    assert metrics["train/clip_fraction"] == pytest.approx(MARK)
    # on-policy, ratio 1: -(2 tokens x 1 + 3 tokens x 2) / 7 tokens
    assert metrics["train/policy_loss"] == pytest.approx(-8 / 7, rel=1e-4)


#: per kind: a built-in preset and its estimator, which the test estimator doubles
BUILT_IN = {
    "critic": ("ppo", gae),
    "group": ("grpo", grpo),
    "return": ("reinforce_pp", reinforce_pp),
}


@pytest.mark.parametrize("kind", sorted(KIND_INPUTS))
def test_both_trainers_call_an_estimator_with_the_inputs_of_its_kind(registries, kind):
    preset, built_in = BUILT_IN[kind]
    settings = ADVANTAGES[ALGORITHMS[preset].advantage].settings
    seen: list[set[str]] = []

    @ADVANTAGES.register(f"test_{kind}", kind=kind, settings=tuple(settings))
    def doubled(**inputs):
        """Twice the built-in estimator's advantages. Shapes: as the built-in one."""
        seen.append(set(inputs))
        adv, ret = built_in(**inputs)
        return 2 * adv, ret

    assert estimator_kind(f"test_{kind}") == kind
    given = {"group_size": 2} if kind == "group" else {}
    # embodied: per chunk step of each env
    base = AlgoConfig(name=preset, **given)
    ours = AlgoConfig(name=preset, advantage=f"test_{kind}", **given)
    (adv, ret, mask), (ours_adv, ours_ret, ours_mask) = (
        _advantages(_episodes(), algo) for algo in (base, ours)
    )
    torch.testing.assert_close(ours_adv, 2 * adv)
    assert torch.equal(ours_ret, ret) and torch.equal(ours_mask, mask)
    # math-grpo: per token of each response (a critic's values from the actor, unwhitened)
    values = [[0.5, 0.25], [0.2], [0.1, 0.0, 0.3], [0.4]]
    actor = SimpleNamespace(scatter=lambda method, seqs, args: [values])
    groups = [
        {"prompt": [3], "responses": [[5, 6], [7]], "score": torch.tensor([1.0, 0.0])},
        {"prompt": [8], "responses": [[9, 10, 11], [12]], "score": torch.tensor([0.0, 1.0])},
    ]
    advantages = []
    for name in (None, f"test_{kind}"):
        chosen = {"advantage": name} if name else {}
        algo = MathAlgoConfig(name=preset, group_size=2, normalize_advantages=False, **chosen)
        runner = SimpleNamespace(job=SimpleNamespace(algo=algo), actor=actor, pad_id=0)
        advantages.append([s.advantages for s in MathGrpoRunner.sequences(runner, groups)])
    assert advantages[1] == [[2 * a for a in seq] for seq in advantages[0]]
    assert advantages[0] != [[0.0] * len(seq) for seq in advantages[0]]
    # both trainers passed exactly the inputs of the kind and the declared settings
    assert seen == [KIND_INPUTS[kind] | settings] * 2


def test_a_preset_names_a_policy_loss(registries):
    with pytest.raises(
        ValueError,
        match=r"^policy_loss 'value' is the value term, not a policy loss \(policy losses: ppo\)$",
    ):
        AlgorithmPreset(advantage="grpo", policy_loss="value")
    with pytest.raises(ValueError, match=r"'a2c' is not a registered loss \(policy losses: ppo\)"):
        AlgorithmPreset(advantage="grpo", policy_loss="a2c")
    with pytest.raises(ConfigError, match=r"algo\.policy_loss 'kl' is the kl term"):
        AlgoConfig(name="grpo", policy_loss="kl")
    with pytest.raises(ConfigError, match=r"algo\.policy_loss 'entropy' is the entropy term"):
        MathAlgoConfig(name="grpo", policy_loss="entropy")


def test_registrations_declare_a_known_kind_term_and_settings(registries):
    with pytest.raises(ValueError, match="estimator kind 'baseline' is not one of critic, group"):
        ADVANTAGES.register("x", kind="baseline")(grpo)
    with pytest.raises(ValueError, match=r"setting\(s\) \['eps'\]; known: lam, normalize_std"):
        ADVANTAGES.register("x", kind="group", settings=("eps",))(grpo)
    with pytest.raises(ValueError, match="loss term 'bonus' is not one of policy, value"):
        LOSSES.register("x", term="bonus")(grpo)
    assert "x" not in ADVANTAGES and "x" not in LOSSES
    assert set(SETTINGS) <= set(PRESET_KEYS)  # the trainers read them from the algo section
    # a group estimator that declares no setting: algo.normalize_std changes nothing for it
    ADVANTAGES.register("plain_group", kind="group")(grpo)
    assert "normalize_std" not in AlgorithmPreset(advantage="plain_group").effective_keys()
    assert "normalize_std" in AlgorithmPreset(advantage="grpo").effective_keys()
    # a trainer must pass the inputs of the kind, no more and no fewer
    with pytest.raises(TypeError, match=r"a group estimator \(grpo\) takes \['group_size', "):
        estimate(AlgoConfig(name="grpo"), scores=torch.zeros(4), group_size=2, lam=1.0)


def test_a_policy_loss_without_the_policy_metrics_is_refused(registries):
    @LOSSES.register("bare_pg", term="policy")
    def bare_pg(*, logprob, old_logprob, advantages, mask, **settings):
        """``-mean(A log π)`` and no metrics. Shapes: ``[N]`` -> 0-d."""
        return -(advantages * logprob)[mask].mean(), {"ratio_mean": torch.ones(())}

    x = torch.zeros(3)
    with pytest.raises(
        ValueError,
        match=r"'bare_pg' returned no \['clip_fraction', 'dual_clip_fraction', 'approx_kl'\]",
    ):
        objective(
            LossSettings(policy_loss="bare_pg"),
            Counts(policy=3.0),
            logprob=x,
            old_logprob=x,
            advantages=x,
            mask=torch.ones(3, dtype=torch.bool),
        )
