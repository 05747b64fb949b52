"""Gradient accumulation leaves the update unchanged: the gradient the actor accumulates over the
micro-batches of a minibatch is the gradient of the masked-mean loss over the whole minibatch,
whatever ``algo.micro_batch_size`` is, with samples masked out and micro-batches that hold no
valid sample at all."""

import pytest
import torch

from rlinf_vla.pipelines.actor import ActorWorker
from rlinf_vla.training.batch import Batch
from tests.policies.conftest import make_obs
from tests.training.actors import local_actor

N = 8  # samples, all in one minibatch
# 5 of 8 samples invalid: however the shuffle splits them into pairs, one pair (and, at
# micro-batch 1, five micro-batches) holds no valid sample.
VALID = torch.tensor([True, False, False, True, False, True, False, False])
CLIP = 0.2
VALUE_COEF, ENTROPY_COEF = 0.5, 0.1
LORA = {"lora_rank": 4, "lora_target_modules": ".*lm_head"}  # the read-out alone trains


def _actor(algo_name: str, micro_batch_size: int, readout: bool) -> ActorWorker:
    policy = {"preset": "tiny", "chunk_size": 2, "seed": 0, **(LORA if readout else {})}
    algo = {
        "name": algo_name,
        "group_size": 2,
        "update_epochs": 1,
        "minibatch_size": N,
        "micro_batch_size": micro_batch_size,
        "clip_low": CLIP,
        "clip_high": CLIP,
        "value_coef": VALUE_COEF,
        "entropy_coef": ENTROPY_COEF,
        "normalize_advantages": False,
        "max_grad_norm": 1e9,  # no clipping: the gradients stay as accumulated
        "cache_frozen_features": readout,
    }
    return local_actor("openvla", algo, **policy)


def _batch(policy, mask: torch.Tensor) -> Batch:
    """A rollout batch of the policy's own actions, with a stale ``old_logprob`` (ratios away
    from 1, some clipped) and random advantages and returns."""
    g = torch.Generator().manual_seed(1)
    obs = make_obs(N, seed=1)
    with torch.no_grad():
        out = policy.act(obs)
    return Batch(
        obs=obs,
        replay=out.replay,
        old_logprob=out.logprob + 0.3 * torch.randn(out.logprob.shape, generator=g),
        old_value=out.value,
        advantages=torch.randn(N, generator=g),
        returns=torch.randn(N, generator=g),
        mask=mask,
    )


def _update(actor: ActorWorker, batch: Batch) -> tuple[dict, dict]:
    """One ``_train`` on ``batch``: the gradients of its one minibatch and its metrics."""
    metrics = actor.updater.update(batch, iteration=0, total_iterations=1)
    grads = {
        n: p.grad.clone()
        for n, p in actor.policy.named_parameters()
        if p.grad is not None and p.grad.any()
    }
    return grads, metrics


def _masked_mean_loss(policy, batch: Batch, with_value: bool) -> tuple[torch.Tensor, dict]:
    """The PPO loss of the whole batch, a mean over its valid entries, written out by hand."""
    out = policy.evaluate(batch.obs, batch.replay)
    m = batch.mask.float()  # [N]
    mk = m[:, None].expand_as(out.logprob)  # [N, K]: per action, like the log-probs
    log_ratio = out.logprob - batch.old_logprob
    ratio = log_ratio.exp()
    adv = batch.advantages[:, None]
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP)
    pg = (torch.maximum(unclipped, clipped) * mk).sum() / mk.sum()
    entropy = (out.entropy * mk).sum() / mk.sum()
    loss = pg - ENTROPY_COEF * entropy
    metrics = {
        "policy_loss": pg,
        "entropy": entropy,
        "approx_kl": (((ratio - 1) - log_ratio) * mk).sum() / mk.sum(),
        "clip_fraction": ((clipped > unclipped).float() * mk).sum() / mk.sum(),
    }
    if with_value:
        v = (0.5 * (out.value - batch.returns) ** 2 * m).sum() / m.sum()
        loss = loss + VALUE_COEF * v
        metrics["value_loss"] = v
    return loss, {k: float(x.detach()) for k, x in metrics.items()}


@pytest.mark.parametrize(
    ("algo_name", "readout"),
    [("ppo", False), ("grpo", False), ("ppo", True)],
    ids=["ppo", "grpo", "ppo-cached-readout"],
)
def test_micro_batch_size_leaves_the_gradient_unchanged(algo_name, readout):
    reference = _actor(algo_name, N, readout)
    batch = _batch(reference.policy, VALID)
    # The gradient of the whole minibatch's masked-mean loss, by autograd, no accumulation.
    params = {n: p for n, p in reference.policy.named_parameters() if p.requires_grad}
    loss, expected_metrics = _masked_mean_loss(reference.policy, batch, algo_name == "ppo")
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    expected = {n: g for n, g in zip(params, grads, strict=True) if g is not None and g.any()}
    assert any("value_head" in n for n in expected) == (algo_name == "ppo")

    for micro_batch_size in (1, 2, N):
        actor = _actor(algo_name, micro_batch_size, readout)
        got, metrics = _update(actor, batch)
        assert got.keys() == expected.keys(), micro_batch_size
        for name, grad in expected.items():
            where = f"micro-batch {micro_batch_size}, {name}"
            torch.testing.assert_close(
                got[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}"
            )
        for key, value in expected_metrics.items():
            assert metrics[f"train/{key}"] == pytest.approx(value, rel=1e-4, abs=1e-6), (
                micro_batch_size,
                key,
            )


def test_a_batch_without_valid_samples_changes_nothing():
    actor = _actor("ppo", 2, readout=False)
    before = {n: p.detach().clone() for n, p in actor.policy.named_parameters()}
    batch = _batch(actor.policy, torch.zeros(N, dtype=torch.bool))
    grads, metrics = _update(actor, batch)
    assert grads == {}
    for name, p in actor.policy.named_parameters():
        assert torch.equal(p, before[name]), name
    assert all(v == v for v in metrics.values())  # no NaN
