"""The trained policy across the actor ranks: FSDP2 sharding, its full weights (for the weight
sync and checkpoints), and the actor's part of a checkpoint.

A checkpoint folder holds the policy in its on-disk format (``policy/``, written by rank 0:
the family's ``save_pretrained``, loadable as ``policy.checkpoint``) and one
``actor_rank{r}.pt`` per rank: the optimizer state, the skip streak, the RNG states and what
the caller adds (the minibatch generator, the update count, DAgger's aggregate). With LoRA the
policy folder holds the weights with the adapter merged in (the official format), so the
trained tensors themselves (the adapter, the heads) also go into rank 0's file, for a resume.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlinf_vla.runtime.rng import get_rng_state, set_rng_state
from rlinf_vla.training.learner import Learner


class PolicyState:
    """Weights and optimizer state of ``policy`` (trained by ``learner``) on rank ``rank`` of
    ``world_size``; ``plain`` builds an unsharded CPU copy of the policy (rank 0 writes a
    sharded policy's checkpoints from it)."""

    def __init__(
        self,
        policy: Any,
        learner: Learner,
        rank: int,
        world_size: int,
        device: torch.device,
        plain: Callable[[], Any],
    ) -> None:
        self.policy, self.learner = policy, learner
        self.rank, self.world_size, self.device = rank, world_size, device
        self._build_plain = plain
        self._plain: Any = None

    @property
    def sharded(self) -> bool:
        return bool(self.learner.fsdp_world)

    def shard(self) -> None:
        """Shard the policy and the optimizer state over the ranks with FSDP2.

        Needs the ranks' default process group. Every block of a ``ModuleList`` (transformer
        layers, ...) becomes its own FSDP unit, gathered just before it runs; the rest of the
        model forms the root unit, gathered for ``evaluate``. Gradients are reduce-scattered
        by FSDP, so the learner's all-reduce is off.
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
        self.learner.use_fsdp(self.world_size)

    def state_dict(self, names: set[str] | None = None) -> dict[str, Tensor]:
        """The full weights on CPU, or only the tensors in ``names``. Sharded, every rank must
        call it; only rank 0 gets them (the others get ``{}``)."""
        if self.sharded:
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

    def save(self, path: str, extra: dict[str, Any]) -> None:
        """The policy (rank 0) and this rank's ``actor_rank{r}.pt`` with ``extra`` in it.
        Sharded, every rank takes part in gathering the full weights and optimizer state."""
        trained = None
        if self.sharded:
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
            **extra,
        }
        torch.save(state, Path(path) / f"actor_rank{self.rank}.pt")

    def load(self, path: str) -> dict[str, Any]:
        """Restore the weights, the optimizer and the RNG state of :meth:`save`; returns the
        rank's saved state (the caller's ``extra`` is in it). The rates and weight decay are
        this run's config's (a resume may change ``algo.lr``, ``value_lr``, ``weight_decay``),
        not those the optimizer state was saved with."""
        state = torch.load(Path(path) / f"actor_rank{self.rank}.pt", weights_only=False)
        if self.sharded:
            self._load_sharded(state, path)
        elif self.policy.has_lora:
            # The base weights never train: the built policy has them (from policy.checkpoint
            # or the seed); the folder's weights have the adapter merged in.
            self.policy.load_state_dict(self._lora_trained(state, path), strict=False)
        else:
            loaded = type(self.policy).from_pretrained(Path(path) / "policy")
            self.policy.load_state_dict(loaded.state_dict())
        self.learner.load_state_dict(state, load_optimizer=not self.sharded)
        set_rng_state(state["torch_rng"], self.device)
        return state

    def _load_sharded(self, state: dict[str, Any], path: str) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        full = {}
        if self.policy.has_lora:  # the frozen base is the built one; the trained tensors
            full = self._lora_trained(state, path) if self.rank == 0 else {}
        elif self.rank == 0:
            full = type(self._plain_policy()).from_pretrained(Path(path) / "policy").state_dict()
        opts = StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=not self.policy.has_lora
        )
        set_model_state_dict(self.policy, full, options=opts)
        set_optimizer_state_dict(
            self.policy,
            self.learner.optimizer,
            state["optimizer"] if self.rank == 0 else {},
            # parameters that never got a gradient (unused layers) have no Adam state
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
        )

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

    def _optimizer_state(self) -> dict[str, Any]:
        optimizer = self.learner.optimizer
        if not self.sharded:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.policy, optimizer, options=opts)

    def _plain_policy(self, weights: dict[str, Tensor] | None = None) -> Any:
        """The unsharded CPU copy of the policy, with ``weights`` loaded when given."""
        if self._plain is None:
            self._plain = self._build_plain()
        if weights is not None:
            self._plain.load_state_dict(weights)
        return self._plain
