"""``algo.kl_coef`` of ``rlinf-vla train``: a KL penalty to the policy the run started from,
checked against the ``k2`` and ``k3`` estimates written out by hand, and a reference that neither the
updates nor a resume move."""

import pytest
import torch

from rlinf_vla.pipelines.actor import ActorWorker
from rlinf_vla.training.batch import Batch
from tests.policies.conftest import make_obs
from tests.training.actors import one_step_grpo_actor, own_actions_batch

N = 6
KL_COEF = 0.5
VALID = torch.tensor([True, True, False, True, True, False])


def _actor(kl_coef: float, lr: float = 1e-3, estimator: str = "k2") -> ActorWorker:
    return one_step_grpo_actor(N, kl_coef=kl_coef, kl_estimator=estimator, lr=lr, max_grad_norm=1e9)


def _batch(policy) -> Batch:
    g = torch.Generator().manual_seed(3)
    return own_actions_batch(policy, make_obs(N, seed=2), torch.randn(N, generator=g), VALID)


def _train(actor: ActorWorker, batch: Batch) -> dict:
    return actor.updater.update(batch, iteration=0, total_iterations=1)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_kl_term_is_the_estimate_to_the_starting_policy(estimator):
    actor = _actor(KL_COEF, estimator=estimator)
    start = {n: p.detach().clone() for n, p in actor.policy.named_parameters()}
    batch = _batch(actor.policy)
    # At the start the policy is its reference: KL 0.
    assert _train(actor, batch)["train/kl"] == pytest.approx(0.0, abs=1e-7)
    # Move the policy away from the start, then measure the KL of the next update by hand.
    with torch.no_grad():
        for p in actor.policy.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
        lp = actor.policy.evaluate(batch.obs, batch.replay).logprob
        # the starting policy, built anew (not the actor's copy)
        ref = _actor(0.0).policy.evaluate(batch.obs, batch.replay).logprob
    d = ref - lp
    # Schulman's estimators of KL(policy || reference) from samples of the policy
    kl = 0.5 * d**2 if estimator == "k2" else d.exp() - d - 1
    mask = VALID[:, None].expand_as(kl).float()
    by_hand = float((kl * mask).sum() / mask.sum())
    assert by_hand > 1e-4  # the perturbation moved the policy
    assert _train(actor, batch)["train/kl"] == pytest.approx(by_hand, rel=1e-4)
    # the reference is still the starting policy
    for n, p in actor.reference.named_parameters():
        assert torch.equal(p, start[n]), n
        assert not p.requires_grad


def test_kl_term_pulls_towards_the_start():
    # With advantages of 0 the KL term alone acts: a step must lower the KL to the start.
    actor = _actor(KL_COEF, lr=1e-3)
    batch = _batch(actor.policy)
    batch.advantages = torch.zeros(N)
    with torch.no_grad():
        for p in actor.policy.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    first = _train(actor, batch)["train/kl"]
    second = _train(actor, batch)["train/kl"]
    assert 0 < second < first


def test_a_resumed_actor_keeps_the_runs_start_as_reference(tmp_path):
    actor = _actor(KL_COEF, lr=1e-2)
    batch = _batch(actor.policy)
    for _ in range(3):
        _train(actor, batch)
    actor.save(str(tmp_path / "actor"))
    resumed = _actor(KL_COEF, lr=1e-2)
    resumed.load(str(tmp_path / "actor"))
    fresh = _actor(0.0)
    for n, p in resumed.reference.named_parameters():
        assert torch.equal(p, dict(fresh.policy.named_parameters())[n]), n
    moved = [
        n
        for n, p in resumed.policy.named_parameters()
        if not torch.equal(p, dict(fresh.policy.named_parameters())[n])
    ]
    assert moved  # the trained weights were loaded into the policy, not the reference
