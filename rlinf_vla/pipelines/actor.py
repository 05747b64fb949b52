"""The actor: turns trajectories into advantages and updates the policy (PPO epochs).

Rewards, dones and values are used per chunk (one decision of the policy): the chunk's
reward is the sum of its steps' rewards, it terminated (truncated) if any of its steps did.
Advantages come from ``rlinf_vla.algos`` (GAE, bootstrapping truncated episodes from the value
of their final observation) and are broadcast to the policy's log-prob granularity.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rlinf_vla.algos.presets import estimate, estimator_kind
from rlinf_vla.pipelines.dagger import Aggregate, expert_samples
from rlinf_vla.runtime import Channel, Worker, offload_module, resident
from rlinf_vla.runtime.rng import get_rng_state, set_rng_state
from rlinf_vla.training.algo_config import AlgoConfig
from rlinf_vla.training.learner import HasLearner, Learner, Schedule
from rlinf_vla.training.objective import LossSettings
from rlinf_vla.training.precision import autocast
from rlinf_vla.types import Observation

if TYPE_CHECKING:
    from rlinf_vla.policies.base import PolicyConfig


def is_log_std(name: str) -> bool:
    """A state-independent log-std parameter (``log_std``, under any module prefix)."""
    return name.rsplit(".", 1)[-1] == "log_std"


@dataclass
class Batch:
    """A flat batch of ``N`` samples (env chunk steps) for the update."""

    obs: Observation
    replay: dict[str, Tensor]
    old_logprob: Tensor  # [N, ...]
    old_value: Tensor  # [N]
    advantages: Tensor  # [N]
    returns: Tensor  # [N]
    mask: Tensor  # bool [N]: the sample enters the loss
    features: Tensor | None = None  # [N, ...] frozen features sent by the rollout workers
    weight: Tensor | None = None  # [N] the policy term's weight per sample (None: 1)

    def __len__(self) -> int:
        return self.old_value.shape[0]

    def select(self, idx: Tensor) -> Batch:
        return Batch(
            obs=self.obs.select(idx),
            replay={k: v[idx] for k, v in self.replay.items()},
            old_logprob=self.old_logprob[idx],
            old_value=self.old_value[idx],
            advantages=self.advantages[idx],
            returns=self.returns[idx],
            mask=self.mask[idx],
            features=None if self.features is None else self.features[idx],
            weight=None if self.weight is None else self.weight[idx],
        )


def chunk_level(traj: Any) -> dict[str, Tensor]:
    """Per-step ``[T, b, K]`` rewards and dones of a trajectory reduced to chunks ``[T, b]``
    (``granularity.chunk_rewards``)."""
    from rlinf_vla.algos.granularity import chunk_rewards

    rewards, terminated, truncated = chunk_rewards(traj.reward, traj.terminated, traj.truncated)
    return {"rewards": rewards, "terminated": terminated, "truncated": truncated}


def _advantages(traj: Any, algo: AlgoConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Advantages, returns and loss mask ``[T, b]`` of one trajectory, by the declared kind of
    the algorithm's estimator (:func:`~rlinf_vla.algos.presets.estimator_kind`; see
    :class:`~rlinf_vla.training.algo_config.AlgoConfig`)."""
    from rlinf_vla.algos import dynamic_sampling, granularity

    chunks = chunk_level(traj)
    T = traj.num_steps
    everything = torch.ones_like(chunks["rewards"], dtype=torch.bool)
    kind = estimator_kind(algo.advantage)
    if kind == "critic":  # e.g. GAE over chunk steps
        adv, ret = estimate(
            algo,
            values=traj.value,
            final_values=traj.final_value if algo.bootstrap_truncated else None,
            gamma=algo.gamma,
            **chunks,
        )
        return adv, ret, everything
    dones = chunks["terminated"] | chunks["truncated"]
    if kind == "return":  # discounted chunk returns, not across episode boundaries
        adv, ret = estimate(
            algo,
            rewards=chunks["rewards"],
            mask=None,
            dones=dones,
            gamma=algo.gamma,
            kl=None,
            kl_coef=0.0,
        )
        return adv, ret, everything
    # Group estimators: each env's first episode is scored; its chunk steps share the advantage.
    scores = granularity.episode_scores(chunks["rewards"], dones, gamma=algo.gamma)
    adv, _ = estimate(algo, scores=scores, group_size=algo.group_size)
    mask = granularity.valid_until_first_done(dones)
    if algo.dynamic_sampling:  # groups whose episodes all scored the same teach nothing
        keep, _ = dynamic_sampling(scores, algo.group_size)
        mask = mask & keep[None, :]
    return adv.expand(T, -1), scores.expand(T, -1), mask


def build_batch(trajectories: list[Any], algo: AlgoConfig) -> Batch:
    """Advantages per trajectory, then everything flattened to ``N = sum(T * b)`` samples;
    with ``algo.episode_weight="equal"`` (group algorithms) the weights under which each
    trajectory's scored episodes weigh the same (``granularity.episode_weights``)."""
    from rlinf_vla.algos.granularity import episode_weights
    from rlinf_vla.envs.base import cat_obs

    weighted = estimator_kind(algo.advantage) == "group" and algo.episode_weight == "equal"
    obs, replay, logprob, value, adv, ret, mask, weight = [], [], [], [], [], [], [], []
    for traj in trajectories:
        a, r, m = _advantages(traj, algo)
        if weighted:
            weight.append(episode_weights(m).flatten(0, 1))
        T = traj.num_steps
        obs.extend(traj.obs)
        replay.append({k: v.flatten(0, 1) for k, v in traj.replay.items()})
        logprob.append(traj.logprob.flatten(0, 1))
        value.append(traj.value[:T].flatten(0, 1))
        adv.append(a.flatten(0, 1))
        ret.append(r.flatten(0, 1))
        mask.append(m.flatten(0, 1))
    shipped = all(traj.features is not None for traj in trajectories)
    return Batch(
        obs=cat_obs(obs),
        replay={k: torch.cat([r[k] for r in replay]) for k in replay[0]},
        old_logprob=torch.cat(logprob),
        old_value=torch.cat(value),
        advantages=torch.cat(adv),
        returns=torch.cat(ret),
        mask=torch.cat(mask),
        features=torch.cat([t.features.flatten(0, 1) for t in trajectories]) if shipped else None,
        weight=torch.cat(weight) if weighted else None,
    )


class ActorWorker(Worker, HasLearner):
    """Holds the trainable policy and its optimizer; one PPO update per call of :meth:`train`."""

    def __init__(
        self,
        policy_name: str,
        policy_config: PolicyConfig,
        algo: dict[str, Any],
        seed: int,
        offload: bool = False,
    ) -> None:
        from rlinf_vla.config import from_section
        from rlinf_vla.policies import make_policy

        torch.manual_seed(seed)
        self._policy_name, self._policy_config = policy_name, policy_config
        self.algo = from_section(AlgoConfig, algo, "algo")
        self.policy = make_policy(policy_name, policy_config, device=str(self.device)).train()
        # the KL penalty's reference: the starting weights, frozen (a resume loads the trained
        # weights into self.policy later, so this stays the run's start)
        self.reference = (
            copy.deepcopy(self.policy).requires_grad_(False) if self.algo.kl_coef > 0 else None
        )
        self.fsdp = False
        a = self.algo
        self.learner = Learner(
            self.policy,
            a.lr,
            second_group=(lambda name: "value_head" in name, a.value_lr),
            extra_groups=[(is_log_std, a.log_std_lr)] if a.log_std_lr is not None else [],
            weight_decay=a.weight_decay,
            max_grad_norm=a.max_grad_norm,
            schedule=Schedule(a.warmup_iterations, a.lr_schedule, a.critic_warmup_iterations),
        )
        self.generator = torch.Generator().manual_seed(seed + 1000 * self.rank)
        # DAgger: the expert-labelled samples of every iteration so far (this rank's share)
        self.aggregate = Aggregate(a.buffer_size) if a.preset.imitation else None
        self.version = 0
        self._synced_full: set[str] = set()  # collectives whose receivers hold every weight
        # Collocated on a GPU: weights and optimizer state wait in host memory between updates
        # (not with FSDP, whose sharded parameters stay where FSDP put them).
        self.offload = offload and self.device.type == "cuda"
        if self.offload:
            offload_module(self.policy)
            if self.reference is not None:
                offload_module(self.reference)

    def shard(self) -> None:
        """Shard the policy and the optimizer state over the actor ranks with FSDP2.

        Needs the actor group's default process group (the runner forms it). Every block of a
        ``ModuleList`` (transformer layers, ...) becomes its own FSDP unit, gathered just
        before it runs; the rest of the model forms the root unit, gathered for ``evaluate``.
        Gradients are reduce-scattered by FSDP, so the manual all-reduce is off.
        """
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        taken: set[int] = set()
        for module in self.policy.modules():
            if isinstance(module, nn.ModuleList) and id(module) not in taken:
                for block in module:
                    inner = {id(m) for m in block.modules()}
                    if any(p.requires_grad for p in block.parameters()):
                        fully_shard(block, mesh=mesh)
                        taken |= inner
        fully_shard(self.policy, mesh=mesh)
        register_fsdp_forward_method(self.policy, "evaluate")
        self.fsdp = True
        self.learner.use_fsdp(self.world_size)

    def save(self, path: str) -> None:
        """Policy in its on-disk format (rank 0), optimizer and RNG states (every rank).

        With FSDP every rank takes part in gathering the full weights and optimizer state;
        rank 0 writes them. With LoRA the policy folder holds the weights with the adapter
        merged in (the official format), so the trained tensors themselves (the adapter, the
        heads) also go into the actor's state, for a resume.
        """
        from pathlib import Path

        trained = None
        if self.fsdp:
            full = self.state_dict()  # collective: every rank helps gather
            if self.rank == 0:
                self._plain_policy(full).save_pretrained(Path(path) / "policy")
            if self.policy.has_lora:
                names = self.changing_names()
                trained = {k: v for k, v in full.items() if k in names}
        else:
            if self.rank == 0:
                self.policy.save_pretrained(Path(path) / "policy")
            if self.policy.has_lora:
                trained = self.state_dict(self.changing_names())
        state = {
            "lora_trained": trained if self.rank == 0 else None,
            **self.learner.state_dict(self._optimizer_state()),
            "torch_rng": get_rng_state(self.device),
            "generator": self.generator.get_state(),
            "version": self.version,
        }
        if self.aggregate is not None:
            state["dagger_aggregate"] = self.aggregate.state_dict()
        torch.save(state, Path(path) / f"actor_rank{self.rank}.pt")

    def load(self, path: str) -> None:
        from pathlib import Path

        state = torch.load(Path(path) / f"actor_rank{self.rank}.pt", weights_only=False)
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            full = {}
            if self.policy.has_lora:  # the frozen base is the built one; the trained tensors
                full = self._lora_trained(state, path) if self.rank == 0 else {}
            elif self.rank == 0:
                full = type(self._plain_policy()).from_pretrained(Path(path) / "policy")
                full = full.state_dict()
            opts = StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True, strict=not self.policy.has_lora
            )
            set_model_state_dict(self.policy, full, options=opts)
            set_optimizer_state_dict(
                self.policy,
                self.optimizer,
                state["optimizer"] if self.rank == 0 else {},
                # parameters that never got a gradient (unused layers) have no Adam state
                options=StateDictOptions(
                    full_state_dict=True, broadcast_from_rank0=True, strict=False
                ),
            )
        elif self.policy.has_lora:
            # The base weights never train: the built policy has them (from policy.checkpoint
            # or the seed); the folder's weights have the adapter merged in.
            self.policy.load_state_dict(self._lora_trained(state, path), strict=False)
        else:
            loaded = type(self.policy).from_pretrained(Path(path) / "policy")
            self.policy.load_state_dict(loaded.state_dict())
        # The rates and weight decay are this run's config's (a resume may change algo.lr,
        # value_lr, weight_decay), not those the optimizer state was saved with.
        self.learner.load_state_dict(state, load_optimizer=not self.fsdp)
        set_rng_state(state["torch_rng"], self.device)
        self.generator.set_state(state["generator"])
        self.version = state["version"]
        if self.aggregate is not None:
            if "dagger_aggregate" not in state:
                from rlinf_vla.policies import CheckpointMismatchError

                raise CheckpointMismatchError(
                    f"{path} is not a dagger run's checkpoint (it holds no aggregate of "
                    f"expert-labelled states): resume it with its own algo, or start dagger "
                    f"from its weights with policy.checkpoint={path}/policy"
                )
            self.aggregate.load_state_dict(state["dagger_aggregate"])

    def _lora_trained(self, state: dict[str, Any], path: str) -> dict[str, Tensor]:
        """The trained tensors of a LoRA run's checkpoint (adapter, heads), checked to be
        exactly those this policy trains."""
        from rlinf_vla.policies import CheckpointMismatchError

        trained = state.get("lora_trained")
        if trained is None:
            raise CheckpointMismatchError(
                f"{path} is a LoRA run's checkpoint without its trained tensors apart from the "
                "merged weights (written before they were saved): it cannot be resumed; start a "
                f"new run from its weights with policy.checkpoint={path}/policy"
            )
        expected = self.changing_names() & set(self.policy.state_dict())
        if set(trained) != expected:
            raise CheckpointMismatchError(
                f"{path}: the checkpoint's trained tensors do not fit this policy (missing "
                f"{sorted(expected - set(trained))[:5]}, unexpected "
                f"{sorted(set(trained) - expected)[:5]}): resume with the run's own policy "
                "settings (lora_rank, lora_target_modules)"
            )
        return trained

    def parameter_counts(self) -> dict[str, int]:
        """``total`` and ``trained`` parameters of the policy (for the run's header)."""
        from rlinf_vla.pipelines.loop import parameter_counts

        return parameter_counts(self.policy)

    def state_dict(self, names: set[str] | None = None) -> dict[str, Tensor]:
        """The full weights on CPU, or only the tensors in ``names``. With FSDP every rank must
        call it; only rank 0 gets them (the others get ``{}``)."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full = get_model_state_dict(self.policy, options=opts)
            return full if names is None else {k: v for k, v in full.items() if k in names}
        return {
            k: v.detach().cpu()
            for k, v in self.policy.state_dict().items()
            if names is None or k in names
        }

    def changing_names(self) -> set[str]:
        """The state-dict entries an update can change: the trainable parameters (with LoRA:
        the adapter and the heads) and the buffers; the frozen weights never change."""
        trainable = {n for n, p in self.policy.named_parameters() if p.requires_grad}
        return trainable | {n for n, _ in self.policy.named_buffers()}

    def _optimizer_state(self) -> dict[str, Any]:
        if not self.fsdp:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.policy, self.optimizer, options=opts)

    def _plain_policy(self, weights: dict[str, Tensor] | None = None) -> Any:
        """An unsharded CPU copy of the policy (rank 0 writes checkpoints from it)."""
        if getattr(self, "_plain", None) is None:
            from rlinf_vla.policies import make_policy

            self._plain = make_policy(self._policy_name, self._policy_config, device="cpu")
        if weights is not None:
            self._plain.load_state_dict(weights)
        return self._plain

    def sync_to(self, collective_name: str) -> int:
        """Broadcast the weights to the rollout workers of ``collective_name`` (as its rank 0);
        returns the bytes sent.

        The first sync over a collective sends every weight; later ones only what an update
        can change (:meth:`changing_names`), the frozen weights being there already: with
        LoRA on a 7B policy about 1 % of the bytes. With FSDP all actor ranks call it (they
        help gather the weights); rank 0 sends.
        """
        full = collective_name not in self._synced_full
        weights = self.state_dict(None if full else self.changing_names())
        if self.rank == 0:
            self.collective(collective_name).broadcast_tensors(weights, src=0)
        self._synced_full.add(collective_name)
        return sum(t.numel() * t.element_size() for t in weights.values())

    def join_data_parallel(self, collective_name: str | None) -> None:
        """Sum gradients over the actor ranks through ``collective_name`` (``None``: one rank)."""
        self.learner.join_data_parallel(
            None if collective_name is None else self.collective(collective_name)
        )

    def train(
        self,
        channel: Channel,
        key: str,
        num_trajectories: int,
        iteration: int,
        total_iterations: int,
    ) -> dict[str, float]:
        """Take ``num_trajectories`` trajectories from ``channel[key]`` and run the PPO epochs,
        or DAgger's supervised steps (with the policy and optimizer on the device meanwhile,
        when they are offloaded)."""
        # in source order, not arrival order: the update must not depend on which rollout
        # worker finished first (rlinf_vla.pipelines.routing)
        trajectories = sorted(channel.get_batch(key, num_trajectories), key=lambda t: t.source)
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                resident(self.policy, self.device, self.optimizer, enabled=self.offload)
            )
            if self.reference is not None:
                stack.enter_context(resident(self.reference, self.device, enabled=self.offload))
            if self.aggregate is not None:
                return self._imitate(trajectories, iteration, total_iterations)
            return self._train(trajectories, iteration, total_iterations)

    def _imitate(
        self, trajectories: list[Any], iteration: int, total_iterations: int
    ) -> dict[str, float]:
        """DAgger: the rollout's expert-labelled samples join the aggregate, then
        ``update_epochs x ceil(new samples / minibatch_size)`` supervised steps on minibatches
        drawn from all of it (:mod:`rlinf_vla.pipelines.dagger`). Every rank takes as many
        steps (from the ranks' mean count), since their gradients are averaged step by step."""
        assert self.aggregate is not None
        a = self.algo
        lr = self.learner.set_lr(iteration, total_iterations)
        obs, targets, errors = expert_samples(trajectories)
        self.aggregate.add(obs, targets)
        new = self.learner.global_sum(float(len(targets))) / self.learner.global_sum(1.0)
        steps = a.update_epochs * math.ceil(new / a.minibatch_size)
        sums: dict[str, float] = {}
        skipped = 0
        for _ in range(steps):
            metrics = self._supervised_step(
                *self.aggregate.sample(a.minibatch_size, self.generator)
            )
            skipped += int(metrics["train/skipped_updates"])
            for k in ("train/loss", "train/grad_norm"):
                sums[k] = sums.get(k, 0.0) + metrics[k]
        self.version += 1
        return {
            **{k: v / max(steps, 1) for k, v in sums.items()},
            "train/skipped_updates": float(skipped),
            "train/update_steps": float(steps),
            "train/nan_streak": float(self.nan_streak),
            "train/lr": lr,
            "train/samples": float(len(targets)),
            "dagger/aggregate_samples": float(len(self.aggregate)),
            "dagger/action_error": errors["action_error"],
        }

    def _train(
        self, trajectories: list[Any], iteration: int, total_iterations: int
    ) -> dict[str, float]:
        from rlinf_vla.algos import whiten

        a = self.algo
        batch = build_batch(trajectories, a)
        if estimator_kind(a.advantage) == "critic" and a.normalize_advantages and len(batch) > 1:
            batch.advantages = whiten(batch.advantages)
        lr = self.learner.set_lr(iteration, total_iterations)
        features = self._frozen_features(batch) if a.cache_frozen_features else None
        settings = LossSettings.of(a)
        n = len(batch)
        sums: dict[str, float] = {}
        steps = skipped = zero = 0  # optimizer steps: minibatches with a sample in the loss
        grad_norm_sum = 0.0
        kl_stopped = False
        # a policy term alone: its gradient is 0 where every advantage is
        skip_zero = a.skip_zero_advantage and not (
            settings.value_coef or settings.entropy_coef or settings.kl_coef
        )
        for _ in range(a.update_epochs):
            if kl_stopped:
                break
            order = torch.randperm(n, generator=self.generator)
            for start in range(0, n, a.minibatch_size):
                mb_idx = order[start : start + a.minibatch_size]
                # Every term divides by its count over the whole minibatch on every rank, so
                # the micro-batches' (and ranks') gradients add up to the minibatch's,
                # whatever algo.micro_batch_size is (rlinf_vla.training.learner).
                valid = self.learner.global_sum(float(batch.mask[mb_idx].sum()))
                if not valid:  # no rank has a sample in the loss (DAPO's dropped groups):
                    continue  # no update, on every rank alike (valid is the global count)
                if skip_zero:
                    live = batch.mask[mb_idx] & (batch.advantages[mb_idx] != 0)
                    if not self.learner.global_sum(float(live.sum())):
                        zero += 1  # no signal on any rank: no step (and no momentum)
                        continue
                self.learner.zero_grad()
                minibatch: dict[str, float] = {}  # this rank's shares of the minibatch's values
                for m_start in range(0, len(mb_idx), a.micro_batch_size):
                    idx = mb_idx[m_start : m_start + a.micro_batch_size]
                    mb = batch.select(idx)
                    if not mb.mask.any() and not self.fsdp:
                        continue  # adds 0 (FSDP's collectives need every rank in every pass)
                    loss, metrics = self._micro_loss(mb, idx, features, settings, valid)
                    self.learner.backward(loss)
                    for k, v in metrics.items():
                        minibatch[k] = minibatch.get(k, 0.0) + v
                if a.target_kl is not None:  # the same sum, so the same decision, on every rank
                    kl = self.learner.global_sum(minibatch.get("approx_kl", 0.0))
                    if kl > 1.5 * a.target_kl:
                        self.learner.zero_grad()
                        kl_stopped = True
                        break
                for k, v in minibatch.items():
                    sums[k] = sums.get(k, 0.0) + v
                grad_norm = self.learner.step()
                skipped += not math.isfinite(grad_norm)
                grad_norm_sum += grad_norm
                steps += 1
        self.version += 1
        # the losses' metrics: a mean over the minibatches that held a valid sample
        result = {f"train/{k}": v / max(steps, 1) for k, v in sums.items()}
        result["train/grad_norm"] = grad_norm_sum / max(steps, 1)
        result["train/skipped_updates"] = float(skipped)
        result["train/skipped_zero_advantage"] = float(zero)
        result["train/update_steps"] = float(steps)
        if a.target_kl is not None:
            result["train/kl_stopped"] = float(kl_stopped)
        result["train/nan_streak"] = float(self.nan_streak)
        result["train/lr"] = lr
        result["train/advantage_mean"] = float(batch.advantages.mean())
        result["train/return_mean"] = float(batch.returns.mean())
        result["train/samples"] = float(batch.mask.sum())
        result["train/frozen_features"] = float(features is not None)
        return result

    def _micro_loss(
        self,
        mb: Batch,
        idx: Tensor,
        features: Tensor | None,
        settings: LossSettings,
        valid: float,
    ) -> tuple[Tensor, dict[str, float]]:
        """One micro-batch's share of its minibatch's loss; ``valid``: the minibatch's valid
        samples over every rank. Each sample has the same number of log-prob (entropy, value)
        entries, so a term's count is ``valid`` times its entries per sample (``token-mean``)
        or ``valid`` (the sequence modes)."""
        from rlinf_vla.algos.granularity import expand_like
        from rlinf_vla.training.objective import Counts, objective

        replay = {k: v.to(self.device) for k, v in mb.replay.items()}
        with autocast(self.device, self.algo.autocast):
            if features is None:
                out = self.policy.evaluate(mb.obs, replay)
            else:
                out = self.policy.evaluate_features(features[idx], replay)
        logprob, entropy = out.logprob.float(), out.entropy.float()
        values = None if out.value is None else out.value.float()
        dev = logprob.device
        ref_logprob = None
        if self.reference is not None:  # built exactly when kl_coef > 0
            with torch.no_grad(), autocast(self.device, self.algo.autocast):
                ref = (
                    self.reference.evaluate(mb.obs, replay)
                    if features is None  # the frozen part is the same in both
                    else self.reference.evaluate_features(features[idx], replay)
                )
            ref_logprob = ref.logprob.float()
        sample_mask = mb.mask.to(dev)

        def count(x: Tensor, agg: str) -> float:
            return valid * (x[0].numel() if agg == "token-mean" else 1)

        counts = Counts(
            policy=count(logprob, settings.agg),
            value=0.0 if values is None else count(values, "token-mean"),
            entropy=count(entropy, settings.agg),
            tokens=count(logprob, "token-mean"),
        )
        return objective(
            settings,
            counts,
            logprob=logprob,
            old_logprob=mb.old_logprob.to(dev),
            advantages=expand_like(mb.advantages.to(dev), logprob),
            mask=expand_like(sample_mask, logprob),
            entropy=entropy,
            entropy_mask=expand_like(sample_mask, entropy),
            values=values,
            old_values=None if values is None else mb.old_value.to(dev),
            returns=None if values is None else mb.returns.to(dev),
            value_mask=None if values is None else expand_like(sample_mask, values),
            ref_logprob=ref_logprob,
            weight=None if mb.weight is None else expand_like(mb.weight.to(dev), logprob),
        )

    def _frozen_features(self, batch: Batch) -> Tensor | None:
        """The policy's frozen features of every sample of ``batch`` (``[N, ...]``: those the
        rollout workers sent, else computed micro-batch by micro-batch), or ``None`` when it
        cannot split off its read-out."""
        if self.fsdp:  # the sharded policy gathers its weights for ``evaluate`` only
            return None
        if batch.features is not None and self.policy.trains_readout_only():
            return batch.features.to(self.device)  # computed by the rollout workers
        parts = []
        for start in range(0, len(batch), self.algo.micro_batch_size):
            mb = batch.select(
                torch.arange(start, min(start + self.algo.micro_batch_size, len(batch)))
            )
            replay = {k: v.to(self.device) for k, v in mb.replay.items()}
            with autocast(self.device, self.algo.autocast):
                part = self.policy.frozen_features(mb.obs, replay)
            if part is None:
                return None
            parts.append(part)
        return torch.cat(parts)

    # -- behaviour cloning (``rlinf-vla sft``) ----------------------------------------------
    def load_demonstrations(
        self, paths: list[str], features: list[dict[str, Any]], chunk_size: int
    ) -> dict[str, int]:
        """Read the datasets into this worker's memory; returns their ``frames`` and
        ``episodes``."""
        from rlinf_vla.pipelines.demos import FeatureMap, load_demonstrations

        maps = [FeatureMap(**f) for f in features]
        self.demos = load_demonstrations(paths, maps, chunk_size)
        return {"frames": len(self.demos), "episodes": self.demos.num_episodes}

    def sft_step(self, step: int, total_steps: int) -> dict[str, float]:
        """One optimizer step of behaviour cloning on ``algo.minibatch_size`` frames drawn by
        this rank (the family's own :meth:`~rlinf_vla.policies.Policy.loss`), accumulated over
        micro-batches of ``algo.micro_batch_size``; gradients are averaged over the ranks."""
        lr = self.learner.set_lr(step, total_steps)
        metrics = self._supervised_step(
            *self.demos.sample(self.algo.minibatch_size, self.generator)
        )
        self.version += 1
        return {**metrics, "train/lr": lr}

    def _supervised_step(self, obs: Observation, actions: Tensor) -> dict[str, float]:
        """One optimizer step of the family's supervised loss on this rank's minibatch
        (``obs``, target chunks ``actions``), accumulated over micro-batches of
        ``algo.micro_batch_size``; gradients are averaged over the ranks."""
        a = self.algo
        self.learner.zero_grad()
        loss_sum = 0.0
        # the mean over every rank's minibatch: the learner sums the ranks' gradients
        total = a.minibatch_size * self.learner.global_sum(1.0)
        for start in range(0, a.minibatch_size, a.micro_batch_size):
            rows = slice(start, start + a.micro_batch_size)
            share = len(actions[rows]) / total
            with autocast(self.device, a.autocast):
                loss = self.policy.loss(obs.select(rows), actions[rows].to(self.device))
            self.learner.backward(loss.float() * share)
            loss_sum += float(loss.detach()) * len(actions[rows]) / a.minibatch_size
        grad_norm = self.learner.step(loss_finite=math.isfinite(loss_sum))
        return {
            "train/loss": loss_sum,
            "train/grad_norm": grad_norm,
            "train/skipped_updates": float(not math.isfinite(grad_norm)),
            "train/nan_streak": float(self.nan_streak),
        }
