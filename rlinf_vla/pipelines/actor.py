"""The actor worker: holds the trainable policy and its optimizer on a device and updates them
(a Ray actor, or an object in the same process with ``placement=local``).

What an update does lives in :mod:`rlinf_vla.training`: the batch and its advantages
(``batch``), the algorithm's epochs (``updater``), behaviour cloning's step (``supervised``),
DAgger's aggregate (``dagger``), sharding and the actor's part of a checkpoint
(``checkpointing``). This shell takes the trajectories from the channel, keeps offloaded
weights on the device while they update, and sends the weights to the rollout workers.
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rlinf_vla.runtime import Channel, Worker, offload_module, resident
from rlinf_vla.training.algo_config import AlgoConfig
from rlinf_vla.training.batch import build_batch
from rlinf_vla.training.checkpointing import PolicyState
from rlinf_vla.training.dagger import DaggerUpdater
from rlinf_vla.training.learner import HasLearner
from rlinf_vla.training.supervised import SupervisedUpdater
from rlinf_vla.training.updater import PolicyUpdater, build_learner

if TYPE_CHECKING:
    from rlinf_vla.policies.base import PolicyConfig


class ActorWorker(Worker, HasLearner):
    """Holds the trainable policy and its optimizer; one update per call of :meth:`train`
    (the algorithm's epochs, or DAgger's supervised steps), one behaviour-cloning step per
    call of :meth:`sft_step`."""

    def __init__(
        self,
        policy_name: str,
        policy_config: PolicyConfig,
        algo: AlgoConfig,
        seed: int,
        offload: bool = False,
    ) -> None:
        from rlinf_vla.policies import make_policy

        torch.manual_seed(seed)
        self.algo = algo
        self.policy = make_policy(policy_name, policy_config, device=str(self.device)).train()
        # the KL penalty's reference: the starting weights, frozen (a resume loads the trained
        # weights into self.policy later, so this stays the run's start)
        self.reference = (
            copy.deepcopy(self.policy).requires_grad_(False) if algo.kl_coef > 0 else None
        )
        self.learner = build_learner(self.policy, algo)
        self.generator = torch.Generator().manual_seed(seed + 1000 * self.rank)
        self.weights = PolicyState(
            self.policy,
            self.learner,
            self.rank,
            self.world_size,
            self.device,
            plain=lambda: make_policy(policy_name, policy_config, device="cpu"),
        )
        parts = (self.policy, self.learner, algo, self.device, self.generator)
        self.updater = PolicyUpdater(*parts, reference=self.reference)
        self.supervised = SupervisedUpdater(*parts)
        # DAgger: the expert-labelled samples of every iteration so far (this rank's share)
        self.dagger = (
            DaggerUpdater(self.supervised, algo.buffer_size) if algo.preset.imitation else None
        )
        self.version = 0  # updates so far (the weights' version the rollout workers get)
        self._synced_full: set[str] = set()  # collectives whose receivers hold every weight
        # Collocated on a GPU: weights and optimizer state wait in host memory between updates
        # (not with FSDP, whose sharded parameters stay where FSDP put them).
        self.offload = offload and self.device.type == "cuda"
        if self.offload:
            offload_module(self.policy)
            if self.reference is not None:
                offload_module(self.reference)

    def shard(self) -> None:
        """Shard the policy and the optimizer state over the actor ranks with FSDP2 (needs
        the actor group's default process group, which the runner forms)."""
        self.weights.shard()

    def save(self, path: str) -> None:
        """Policy in its on-disk format (rank 0), optimizer and RNG states (every rank)."""
        extra: dict[str, Any] = {"generator": self.generator.get_state(), "version": self.version}
        if self.dagger is not None:
            extra.update(self.dagger.state_dict())
        self.weights.save(path, extra)

    def load(self, path: str) -> None:
        state = self.weights.load(path)
        self.generator.set_state(state["generator"])
        self.version = state["version"]
        if self.dagger is not None:
            self.dagger.load_state_dict(state, path)

    def parameter_counts(self) -> dict[str, int]:
        """``total`` and ``trained`` parameters of the policy (for the run's header)."""
        from rlinf_vla.run.loop import parameter_counts

        return parameter_counts(self.policy)

    def state_dict(self, names: set[str] | None = None) -> dict[str, Tensor]:
        """The full weights on CPU, or only the tensors in ``names`` (sharded: every rank
        calls it, rank 0 gets them)."""
        return self.weights.state_dict(names)

    def changing_names(self) -> set[str]:
        """The state-dict entries an update can change (:meth:`PolicyState.changing_names`)."""
        return self.weights.changing_names()

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
        """Take ``num_trajectories`` trajectories from ``channel[key]`` and update the policy:
        the algorithm's epochs, or DAgger's supervised steps (with the policy and optimizer on
        the device meanwhile, when they are offloaded)."""
        # in source order, not arrival order: the update must not depend on which rollout
        # worker finished first (rlinf_vla.pipelines.routing)
        trajectories = sorted(channel.get_batch(key, num_trajectories), key=lambda t: t.source)
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                resident(self.policy, self.device, self.optimizer, enabled=self.offload)
            )
            if self.reference is not None:
                stack.enter_context(resident(self.reference, self.device, enabled=self.offload))
            if self.dagger is not None:
                metrics = self.dagger.update(trajectories, iteration, total_iterations)
            else:
                batch = build_batch(trajectories, self.algo)
                metrics = self.updater.update(batch, iteration, total_iterations)
        self.version += 1
        return metrics

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
        """One optimizer step of behaviour cloning on demonstrations this rank draws."""
        metrics = self.supervised.sft_step(self.demos, step, total_steps)
        self.version += 1
        return metrics
