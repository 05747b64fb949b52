"""The policy contract, the policy registry and the helpers every policy family shares.

A policy is an ``nn.Module`` with

- ``act(obs, greedy=False) -> ActOutput``: actions ``float32 [B, K, A]`` in env units, their
  log-probability at the configured granularity, a value estimate ``[B]`` and ``replay``, the
  tensors needed to recompute the log-probability later;
- ``evaluate(obs, replay) -> EvalOutput``: log-probability, entropy and value of the replayed
  actions under the current weights (with unchanged weights, ``evaluate`` reproduces ``act``);
- ``loss(obs, actions) -> Tensor``: the family's supervised loss (SFT, and the tests that check
  that a model can learn);
- ``save_pretrained(path)`` / ``from_pretrained(path, **overrides)`` in the official on-disk format
  of the family, with the normalisation statistics next to the weights.

Families register their class where it is defined with :func:`register_policy`; ``make_policy``
(in ``rlinf_vla.policies``) looks names up in :data:`POLICIES`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import torch
from torch import Tensor, nn

from rlinf_vla.types import ActOutput, EvalOutput, Observation

__all__ = [
    "POLICIES",
    "CheckpointMismatchError",
    "Policy",
    "PolicyConfig",
    "PolicyNeeds",
    "PolicySpec",
    "check_state_dict",
    "find_checkpoint",
    "load_safetensors_dir",
    "reduce_to_granularity",
    "register_policy",
    "require_cameras",
    "save_safetensors_dir",
]

Granularity = Literal["token", "action", "chunk"]
_SUMMED_DIMS: dict[str, tuple[int, ...]] = {"token": (), "action": (-1,), "chunk": (-2, -1)}


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------
@dataclass
class PolicyConfig:
    """Settings every policy family shares; each family's config subclasses this.

    Architecture fields live in the family config; ``preset`` picks a set of them
    (``PRESETS[preset]``), explicit keyword arguments override the preset.

    Attributes:
        preset: ``"tiny"`` (the default: random weights, a few hundred thousand parameters, the
            same module and key structure as the real model; for tests and CPU runs) or
            ``"full"`` (published sizes). Ignored with a ``checkpoint``, whose own config gives
            the architecture.
        checkpoint: a checkpoint directory to load weights (and architecture) from.
        action_dim: ``A``, the env's action size.
        chunk_size: ``K``, the number of actions returned by one ``act``.
        logprob_granularity: ``token`` -> log-probs ``[B, K, A]``; ``action`` -> ``[B, K]`` (sum
            over the action dims); ``chunk`` -> ``[B]`` (sum over the chunk).
        value_head: add a value head (PPO critic); ``value`` is ``None`` without.
        value_hidden_sizes: hidden layer sizes of the value MLP.
        detach_value_input: stop the critic's gradient at the backbone features.
        lora_rank: ``> 0`` wraps the family's LoRA targets with a peft LoRA adapter of this rank
            and freezes the base weights.
        lora_alpha: LoRA scaling numerator (``scale = alpha / rank``).
        lora_dropout: dropout on the LoRA input.
        lora_target_modules: module-name regex (or list of names) the adapter wraps; empty ->
            the family default (the language backbone's linear layers).
        lora_adapter: a peft adapter folder to load on top of the base weights.
        trainable_modules: a regex over parameter names (``named_parameters``, e.g.
            ``action_head.model.fc1.weight``); when set, every parameter whose name it does not
            match anywhere (``re.search``) is frozen at the end of the policy's construction
            (after LoRA, which may have frozen more already). ``None``: every parameter the
            family (and LoRA) leaves trainable trains. A regex that matches no trainable
            parameter is an error.
        dtype: ``auto`` (bfloat16 on CUDA, float32 on CPU), ``float32`` or ``bfloat16``.
        device: torch device the policy is moved to.
        gradient_checkpointing: recompute activations of the backbones in the backward pass.
        tokenizer: a tokenizer folder (``tokenizer.json`` / ``tokenizer.model``); ``None`` -> the
            checkpoint's own tokenizer files, or the built-in offline tokenizer of the preset.
        seed: seed of the random initialisation (``None`` -> torch's global RNG).
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"tiny": {}, "full": {}}

    preset: str = "tiny"
    checkpoint: str | None = None
    action_dim: int = 7
    chunk_size: int = 1
    logprob_granularity: Granularity = "action"
    value_head: bool = True
    value_hidden_sizes: tuple[int, ...] = (512, 128)
    detach_value_input: bool = False
    lora_rank: int = 0
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: str | tuple[str, ...] = ""
    lora_adapter: str | None = None
    trainable_modules: str | None = None
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    device: str = "cpu"
    gradient_checkpointing: bool = False
    tokenizer: str | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        self.value_hidden_sizes = tuple(int(h) for h in self.value_hidden_sizes)
        if isinstance(self.lora_target_modules, list):
            self.lora_target_modules = tuple(self.lora_target_modules)
        check(self, "preset", self.preset in self.PRESETS, f"must be one of {sorted(self.PRESETS)}")
        check(self, "action_dim", self.action_dim >= 1, "must be >= 1")
        check(self, "chunk_size", self.chunk_size >= 1, "must be >= 1")
        check(
            self,
            "logprob_granularity",
            self.logprob_granularity in _SUMMED_DIMS,
            f"must be one of {sorted(_SUMMED_DIMS)}",
        )
        check(self, "lora_rank", self.lora_rank >= 0, "must be >= 0")
        if self.trainable_modules is not None:
            try:
                re.compile(self.trainable_modules)
            except re.error as e:
                check(self, "trainable_modules", False, f"is not a valid regex ({e})")
        check(self, "lora_dropout", 0.0 <= self.lora_dropout < 1.0, "must lie in [0, 1)")
        check(
            self,
            "dtype",
            self.dtype in ("auto", "float32", "bfloat16"),
            "must be 'auto', 'float32' or 'bfloat16'",
        )

    @classmethod
    def from_kwargs(cls, policy_name: str = "", **kwargs: Any) -> PolicyConfig:
        """The preset's values updated with ``kwargs``; unknown keys fail, naming them."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown config key(s) {unknown} for policy {policy_name or cls.__name__!r}; "
                f"known keys: {sorted(known)}"
            )
        preset = kwargs.get("preset", cls.preset)
        if preset not in cls.PRESETS:
            raise ValueError(
                f"{cls.__name__}.preset must be one of {sorted(cls.PRESETS)} (got {preset!r})"
            )
        return cls(**{**copy.deepcopy(cls.PRESETS[preset]), **kwargs})

    def replace(self, **changes: Any) -> PolicyConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON-able values."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def needs(self) -> PolicyNeeds:
        """What the policy built from this config needs from an env or a dataset (the fit
        check, ``rlinf_vla.fit``). A family that reads cameras or the robot's state says so."""
        return PolicyNeeds(cameras=(), action_dim=self.action_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if str(self.device).startswith("cuda") else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]


@dataclass(frozen=True)
class PolicyNeeds:
    """What a policy reads and writes, beside :meth:`EnvConfig.spec` what an env provides.

    Attributes:
        cameras: the ``images`` keys it reads (``policy.image_keys``).
        action_dim: the size of its actions (``policy.action_dim``).
        state_dim: the exact size of ``obs.state`` it reads (``policy.proprio_dim``), or
            ``None``.
        max_state_dim: it zero-pads the state to this size, so any state up to it fits
            (``policy.max_state_dim``), or ``None``.
    """

    cameras: tuple[str, ...]
    action_dim: int
    state_dim: int | None = None
    max_state_dim: int | None = None


def check(cfg: Any, name: str, ok: bool, message: str) -> None:
    """Raise ``ValueError`` naming ``Config.name`` and its value when ``ok`` is false."""
    if not ok:
        raise ValueError(f"{type(cfg).__name__}.{name} {message} (got {getattr(cfg, name)!r})")


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicySpec:
    """A registered policy: its class and the config values its name implies."""

    cls: type[Policy]
    defaults: Mapping[str, Any] = field(default_factory=dict)


#: Registered policies by name, filled by :func:`register_policy`.
POLICIES: dict[str, PolicySpec] = {}

_P = TypeVar("_P", bound="type[Policy]")


def register_policy(name: str, **defaults: Any) -> Callable[[_P], _P]:
    """Class decorator: register a :class:`Policy` subclass under ``name``.

    ``defaults`` are config values the name implies (``register_policy("pi05", pi05=True)``); a
    class may be registered under several names.
    """

    def decorator(cls: _P) -> _P:
        if name in POLICIES and POLICIES[name].cls is not cls:
            raise ValueError(f"policy {name!r} is already registered by {POLICIES[name].cls}")
        POLICIES[name] = PolicySpec(cls, dict(defaults))
        return cls

    return decorator


# ----------------------------------------------------------------------------------------------
# The contract
# ----------------------------------------------------------------------------------------------
class Policy(nn.Module, ABC):
    """Base class of every VLA policy (see the module docstring for the contract)."""

    config_cls: ClassVar[type[PolicyConfig]] = PolicyConfig

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.config = config

    # -- the RL contract -------------------------------------------------------------------
    @abstractmethod
    def act(self, obs: Observation, greedy: bool = False) -> ActOutput:
        """Sample (or, with ``greedy``, pick the most likely) actions ``[B, K, A]``."""

    @abstractmethod
    def evaluate(self, obs: Observation, replay: dict[str, Tensor]) -> EvalOutput:
        """Log-prob, entropy and value of the actions in ``replay`` under the current weights."""

    @abstractmethod
    def loss(self, obs: Observation, actions: Tensor) -> Tensor:
        """The family's supervised loss (a scalar) for demonstration ``actions [B, K, A]``."""

    @classmethod
    def statistics_config(
        cls,
        name: str,
        action: Mapping[str, Any],
        state: Mapping[str, Any] | None,
        counts: Mapping[str, int],
    ) -> dict[str, Any]:
        """Config entries that make the family normalise with a dataset's statistics (used by
        ``rlinf-vla sft``), in the layout its checkpoints keep them, so a saved checkpoint
        carries them in the family's official place.

        Args:
            name: the dataset's name (OpenVLA keys its statistics by it).
            action, state: per-dimension ``mean``, ``std``, ``min``, ``max``, ``q01``, ``q99``
                (lists of floats); ``state`` is ``None`` when the policy reads none.
            counts: ``frames`` and ``episodes`` of the data.
        """
        raise NotImplementedError(f"{cls.__name__} cannot take dataset statistics")

    # -- read-out-only training ------------------------------------------------------------
    def trains_readout_only(self) -> bool:
        """Whether this family splits off its read-out (:meth:`frozen_features`) and every
        trainable parameter lies in it. ``False`` by default."""
        return False

    def act_with_features(
        self, obs: Observation, greedy: bool = False
    ) -> tuple[ActOutput, Tensor | None]:
        """:meth:`act`, plus the :meth:`frozen_features` of the sampled actions when acting
        computes them anyway (``None`` otherwise, the default).

        A rollout worker sends them with the trajectory, so an actor that caches frozen
        features does not run the frozen part of the policy again."""
        return self.act(obs, greedy=greedy), None

    def frozen_features(self, obs: Observation, replay: dict[str, Tensor]) -> Tensor | None:
        """The output of the frozen part of the policy for the replayed actions, or ``None``.

        When every trainable parameter lies in the policy's read-out (the action head and the
        value head, e.g. LoRA on ``lm_head`` only), the rest of the network computes the same
        features in every update epoch. A family that can split there returns them (no
        gradient) and :meth:`evaluate_features` finishes the pass, so the actor computes them
        once per iteration. ``None`` (the default, and whenever a parameter outside the
        read-out trains): call :meth:`evaluate` every time.
        """
        return None

    def evaluate_features(self, features: Tensor, replay: dict[str, Tensor]) -> EvalOutput:
        """:meth:`evaluate` from :meth:`frozen_features`' output (the same values)."""
        raise NotImplementedError(f"{type(self).__name__} does not split off its read-out")

    @torch.no_grad()
    def value(self, obs: Observation) -> Tensor | None:
        """The critic's estimate ``V(obs)`` ``[B]``, or ``None`` without a value head.

        Used to bootstrap truncated episodes and the state a rollout stops in. The default runs
        :meth:`act`; families whose value head reads the observation prefix override it with
        the prefix pass alone (no action decoding).
        """
        if getattr(self, "value_head", None) is None:
            return None
        return self.act(obs, greedy=True).value

    def critic_values(self, obs: Observation, replay: dict[str, Tensor]) -> Tensor:
        """The critic's values ``[B]`` (or per token, as :meth:`evaluate` gives them) with
        gradients, for updates that fit the critic alone (``algo.critic_epochs``). The
        default runs :meth:`evaluate`; a family whose critic has features of its own computes
        just those."""
        value = self.evaluate(obs, replay).value
        if value is None:
            raise ValueError(f"{type(self).__name__} has no value head (value_head=false)")
        return value

    # -- checkpoints ---------------------------------------------------------------------------
    @abstractmethod
    def save_pretrained(self, path: str | Path) -> None:
        """Write the policy to ``path`` in the family's official on-disk format."""

    @classmethod
    @abstractmethod
    def from_pretrained(cls, path: str | Path, **overrides: Any) -> Policy:
        """Load a policy from a checkpoint directory; ``overrides`` change config values."""

    @classmethod
    def from_config(cls, config: PolicyConfig) -> Policy:
        """The policy of a config that is already resolved: with ``config.checkpoint`` (set by
        the family's ``config_from_dir``, the checkpoint's config with the caller's keys on
        top) the weights of that folder are loaded, without reading its config again."""
        if config.checkpoint:
            return cls(config, checkpoint_dir=Path(config.checkpoint))  # type: ignore[call-arg]
        return cls(config)

    # -- shared helpers ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def reduce(self, x: Tensor) -> Tensor:
        """Per-token ``[B, K, A]`` log-probs/entropies at the configured granularity."""
        return reduce_to_granularity(x, self.config.logprob_granularity)

    def lora_target_modules(self) -> str | list[str]:
        """The default LoRA targets of the family (a regex over module names)."""
        raise NotImplementedError(f"{type(self).__name__} has no LoRA targets")

    def lora_root(self) -> nn.Module:
        """The module the LoRA adapter is injected into (its names are the adapter's keys)."""
        raise NotImplementedError(f"{type(self).__name__} has no LoRA root")

    #: Names of the RL heads (value head, log-stds, ...): kept in float32 whatever the dtype.
    _rl_heads: ClassVar[tuple[str, ...]] = ()

    def _finish_init(self) -> None:
        """Dtype/device placement, LoRA, the RL heads back to float32, then
        ``trainable_modules``."""
        cfg = self.config
        self.to(device=cfg.device, dtype=cfg.torch_dtype)
        if cfg.lora_adapter:
            self._load_lora_adapter(cfg.lora_adapter)
        elif cfg.lora_rank > 0:
            self._add_lora()
        for name in self._rl_heads:
            head = getattr(self, name, None)
            if head is not None:
                head.float()
        if cfg.trainable_modules is not None:
            self._freeze_unmatched(cfg.trainable_modules)

    def _freeze_unmatched(self, pattern: str) -> None:
        """Freeze every parameter whose name ``pattern`` does not match (``re.search``)."""
        regex = re.compile(pattern)
        trainable = [n for n, p in self.named_parameters() if p.requires_grad]
        if not any(regex.search(n) for n in trainable):
            prefixes = list(dict.fromkeys(".".join(n.split(".")[:2]) for n in trainable))
            raise ValueError(
                f"{type(self.config).__name__}.trainable_modules={pattern!r} matches no "
                f"trainable parameter name (re.search), e.g. {trainable[-1]!r}; the trainable "
                f"parameters are under: {', '.join(prefixes)}"
            )
        for name, p in self.named_parameters():
            if not regex.search(name):
                p.requires_grad_(False)

    # LoRA (peft is imported lazily) ----------------------------------------------------------
    def _add_lora(self) -> None:
        from peft import LoraConfig

        cfg = self.config
        targets = cfg.lora_target_modules or self.lora_target_modules()
        if isinstance(targets, tuple):
            targets = list(targets)
        lora_cfg = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=targets,
            init_lora_weights="gaussian",
        )
        self._inject(lora_cfg)

    def _load_lora_adapter(self, adapter_dir: str) -> None:
        from peft import LoraConfig, set_peft_model_state_dict

        adapter_dir = Path(adapter_dir)
        lora_cfg = LoraConfig.from_pretrained(str(adapter_dir))
        lora_cfg.inference_mode = False
        self._inject(lora_cfg)
        weights = load_safetensors_dir(adapter_dir, index_name="adapter_model")
        # peft saves keys as ``base_model.model.<module>.lora_A.weight``.
        weights = {_strip_prefix(k, "base_model.model."): v for k, v in weights.items()}
        result = set_peft_model_state_dict(self.lora_root(), weights)
        bad = list(getattr(result, "unexpected_keys", []) or [])
        if bad:
            raise CheckpointMismatchError(
                f"LoRA adapter {adapter_dir} does not fit the policy: "
                + _summarize("unexpected", bad)
            )

    def _inject(self, lora_cfg: Any) -> None:
        from peft import inject_adapter_in_model

        if lora_cfg.target_modules == "all-linear":
            # peft resolves "all-linear" only on transformers models: every nn.Linear leaf name
            # of the root except the language model's output layer, as peft does.
            lora_cfg.target_modules = sorted(
                {
                    name.rsplit(".", 1)[-1]
                    for name, m in self.lora_root().named_modules()
                    if isinstance(m, nn.Linear) and not name.endswith("lm_head")
                }
            )
        inject_adapter_in_model(lora_cfg, self.lora_root())
        self._lora_config = lora_cfg
        self._freeze_base()

    def _freeze_base(self) -> None:
        """Freeze every base weight inside :meth:`lora_root`; LoRA weights and the heads outside
        the root (value head, action heads, projectors) stay trainable."""
        root_ids = {id(p) for p in self.lora_root().parameters()}
        for name, p in self.named_parameters():
            if "lora_" in name:
                p.requires_grad_(True)
            elif id(p) in root_ids:
                p.requires_grad_(False)

    @property
    def has_lora(self) -> bool:
        return hasattr(self, "_lora_config")

    def merged_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """``module``'s state dict with LoRA deltas merged into the base weights and the peft
        wrapper names removed (``q_proj.base_layer.weight`` -> ``q_proj.weight``)."""
        deltas: dict[str, Tensor] = {}
        if self.has_lora:
            from peft.tuners.lora import LoraLayer

            for name, m in module.named_modules():
                if isinstance(m, LoraLayer):
                    for adapter in m.active_adapters:
                        d = m.get_delta_weight(adapter).detach()
                        key = f"{name}.weight"
                        deltas[key] = deltas[key] + d if key in deltas else d
        out: dict[str, Tensor] = {}
        for key, value in module.state_dict().items():
            if "lora_" in key:
                continue
            key = key.replace(".base_layer.", ".")
            out[key] = value + deltas[key].to(value.dtype) if key in deltas else value
        return out

    def save_lora_adapter(self, path: str | Path) -> None:
        """Write the LoRA adapter as a peft folder (``adapter_config.json`` + safetensors)."""
        from peft import get_peft_model_state_dict

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        weights = get_peft_model_state_dict(self.lora_root())
        weights = {f"base_model.model.{k}": v for k, v in weights.items()}
        save_safetensors_dir(weights, path, index_name="adapter_model")
        self._lora_config.save_pretrained(str(path))

    def enable_gradient_checkpointing(self) -> None:
        """Recompute backbone activations in the backward pass (family-specific)."""


def _strip_prefix(key: str, prefix: str) -> str:
    return key[len(prefix) :] if key.startswith(prefix) else key


def reduce_to_granularity(x: Tensor, granularity: str) -> Tensor:
    """Sum a per-token ``[B, K, A]`` tensor to ``token`` ``[B, K, A]``, ``action`` ``[B, K]``
    or ``chunk`` ``[B]`` (dims are sampled independently, so log-probs and entropies add)."""
    if granularity not in _SUMMED_DIMS:
        raise ValueError(f"unknown granularity {granularity!r}; known: {sorted(_SUMMED_DIMS)}")
    dims = _SUMMED_DIMS[granularity]
    return x.sum(dim=dims) if dims else x


def require_cameras(obs: Observation, keys: Iterable[str], policy: str) -> None:
    """Fail naming the first camera ``policy`` needs that ``obs.images`` lacks."""
    for key in keys:
        if key not in obs.images:
            raise KeyError(
                f"policy {policy!r} needs camera {key!r}, but the observation has "
                f"{sorted(obs.images)}"
            )


# ----------------------------------------------------------------------------------------------
# Checkpoint helpers
# ----------------------------------------------------------------------------------------------
class CheckpointMismatchError(ValueError):
    """A checkpoint whose keys or shapes do not fit the policy; the message is a short diff."""


def _pattern(key: str) -> str:
    return re.sub(r"\.\d+(?=\.)", ".*", key)


def _summarize(kind: str, keys: Iterable[str], limit: int = 8) -> str:
    """``n kind keys: pattern (xN), ...`` with layer indices folded into ``*``."""
    keys = sorted(keys)
    counts: dict[str, int] = {}
    for k in keys:
        counts[_pattern(k)] = counts.get(_pattern(k), 0) + 1
    items = [f"{p} (x{n})" if n > 1 else p for p, n in counts.items()]
    shown = ", ".join(items[:limit])
    more = f", ... and {len(items) - limit} more patterns" if len(items) > limit else ""
    return f"{len(keys)} {kind} key(s): {shown}{more}"


def check_state_dict(
    expected: Mapping[str, Tensor],
    got: Mapping[str, Tensor],
    source: str,
    optional: Iterable[str] = (),
) -> None:
    """Raise :class:`CheckpointMismatchError` when ``got`` lacks keys of ``expected``, has extra
    keys, or has tensors of another shape. ``optional`` expected keys may be absent."""
    optional = set(optional)
    missing = [k for k in expected if k not in got and k not in optional]
    unexpected = [k for k in got if k not in expected]
    wrong = [
        f"{k} {tuple(got[k].shape)} != {tuple(expected[k].shape)}"
        for k in expected
        if k in got and tuple(got[k].shape) != tuple(expected[k].shape)
    ]
    if not (missing or unexpected or wrong):
        return
    parts = []
    if missing:
        parts.append(_summarize("missing", missing))
    if unexpected:
        parts.append(_summarize("unexpected", unexpected))
    if wrong:
        more = f" ... and {len(wrong) - 5} more" if len(wrong) > 5 else ""
        parts.append(f"{len(wrong)} shape mismatch(es): " + "; ".join(wrong[:5]) + more)
    raise CheckpointMismatchError(f"checkpoint {source} does not fit: " + " | ".join(parts))


#: A Hugging Face model id, ``org/name`` with an optional ``@revision``.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def find_checkpoint(checkpoint: str | Path) -> Path:
    """The folder of ``checkpoint``: a path (a run's checkpoint folder stands for its
    ``policy/``), or a Hugging Face model id (``openvla/openvla-7b``,
    ``org/name@revision``) looked up in the local Hugging Face cache (``HF_HUB_CACHE`` /
    ``HF_HOME``; nothing is downloaded).

    Raises:
        FileNotFoundError: neither a folder nor a model in the cache; the message says how to
            download it.
    """
    path = Path(checkpoint).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint={str(checkpoint)!r} is not a checkpoint folder")
        # a run's checkpoint (checkpoints/iter_<N>, step_<N>) keeps the policy in policy/
        if (path / "policy").is_dir() and not (path / "config.json").exists():
            return path / "policy"
        return path
    text = str(checkpoint)
    if not _HUB_ID.match(text):
        raise FileNotFoundError(f"checkpoint={text!r} does not exist")
    from huggingface_hub import constants, snapshot_download

    repo_id, _, revision = text.partition("@")
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, local_files_only=True))
    except Exception:  # huggingface_hub's LocalEntryNotFoundError and kin: not in the cache
        raise FileNotFoundError(
            f"checkpoint={text!r} is neither a folder nor a model in the local Hugging Face "
            f"cache ({constants.HF_HUB_CACHE}); download it where there is network, e.g. "
            f"`hf download {repo_id}{f' --revision {revision}' if revision else ''}` (the "
            "cache folder can be copied), or set the checkpoint to its folder"
        ) from None


def load_safetensors_dir(path: str | Path, index_name: str = "model") -> dict[str, Tensor]:
    """All tensors of ``{index_name}.safetensors`` or of the shards listed in
    ``{index_name}.safetensors.index.json`` in ``path``."""
    from safetensors.torch import load_file

    path = Path(path)
    single = path / f"{index_name}.safetensors"
    index = path / f"{index_name}.safetensors.index.json"
    if single.exists():
        return load_file(str(single))
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, Tensor] = {}
        for shard in shards:
            out.update(load_file(str(path / shard)))
        return out
    raise FileNotFoundError(f"no {single.name} or {index.name} in {path}")


def save_safetensors_dir(
    state_dict: Mapping[str, Tensor],
    path: str | Path,
    index_name: str = "model",
    max_shard_bytes: int = 5 * 1024**3,
) -> None:
    """Write ``state_dict`` as ``{index_name}.safetensors``, or as HF-style shards
    ``{index_name}-0000i-of-0000n.safetensors`` plus an index when it exceeds one shard."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / f"{index_name}.safetensors"), metadata=meta)
        return
    weight_map = {}
    n = len(shards)
    for i, shard in enumerate(shards, start=1):
        name = f"{index_name}-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(path / name), metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (path / f"{index_name}.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def load_rl_heads(module: nn.Module, path: Path, names: Iterable[str]) -> None:
    """Load the RL-only heads (value head, log-std, noise net) saved next to the weights in
    ``rl_heads.safetensors``; heads missing from the file keep their fresh initialisation."""
    from safetensors.torch import load_file

    file = path / "rl_heads.safetensors"
    if not file.exists():
        return
    weights = load_file(str(file))
    for name in names:
        sub = getattr(module, name, None)
        if sub is None:
            continue
        prefix = f"{name}."
        part = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
        if isinstance(sub, nn.Parameter):
            if name in weights:
                sub.data.copy_(weights[name])
            continue
        if part:
            check_state_dict(sub.state_dict(), part, f"{file} ({name})")
            sub.load_state_dict(part)


def save_rl_heads(module: nn.Module, path: Path, names: Iterable[str]) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, Tensor] = {}
    for name in names:
        sub = getattr(module, name, None)
        if sub is None:
            continue
        if isinstance(sub, nn.Parameter):
            tensors[name] = sub.detach().cpu().contiguous()
        else:
            for k, v in sub.state_dict().items():
                tensors[f"{name}.{k}"] = v.detach().cpu().contiguous()
    if tensors:
        save_file(tensors, str(path / "rl_heads.safetensors"), metadata={"format": "pt"})


@functools.cache
def _cache_keyword(model_cls: type) -> str:
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def kv_cache(model: nn.Module, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}``: how ``model``'s forward (a Hugging Face model) takes a KV cache.

    Newer transformers releases name the argument ``cache`` and warn on ``past_key_values``
    (removed in 5.40); earlier ones know only ``past_key_values``. Pass a ``DynamicCache``: it
    is filled in place, so the output's field (renamed the same way) is never needed. A PEFT
    wrapper passes the keyword on to the model it wraps, whose forward decides.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {_cache_keyword(type(base)): cache}


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Fix torch's CPU RNG inside the block (restored afterwards); ``None`` does nothing."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
