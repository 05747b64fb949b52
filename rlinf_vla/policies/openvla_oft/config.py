"""Config of OpenVLA-OFT (parallel decoding of an action chunk, proprio token, L1 head)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from rlinf_vla.policies.base import PolicyNeeds, check
from rlinf_vla.policies.openvla.config import TINY_OPENVLA, CheckpointFiles, OpenVLAConfig

__all__ = ["PLATFORMS", "OpenVLAOFTConfig", "detect_platform"]

TINY_OFT: dict[str, Any] = {**TINY_OPENVLA, "proprio_dim": 8}

#: openvla-oft's ``prismatic/vla/constants.py``: per robot platform, the chunk size
#: (``NUM_ACTIONS_CHUNK``), action and proprio sizes and ``ACTION_PROPRIO_NORMALIZATION_TYPE``
#: its checkpoints were trained with; plus the cameras of its evaluation (ALOHA: the
#: third-person image, then the left and right wrist images).
PLATFORMS: dict[str, dict[str, Any]] = {
    "libero": {
        "chunk_size": 8,
        "action_dim": 7,
        "proprio_dim": 8,
        "action_normalization": "bounds_q99",
    },
    "aloha": {
        "chunk_size": 25,
        "action_dim": 14,
        "proprio_dim": 14,
        "action_normalization": "bounds",
        "image_keys": ("main", "left_wrist", "right_wrist"),
    },
    "bridge": {
        "chunk_size": 5,
        "action_dim": 7,
        "proprio_dim": 7,
        "action_normalization": "bounds_q99",
    },
}


def detect_platform(names: Iterable[str]) -> str:
    """The platform of an official OFT checkpoint as ``constants.py`` decides it: the first of
    ``libero``, ``aloha``, ``bridge`` found in ``names`` (here: the dataset key that
    un-normalises, or all of them, and the folder name; upstream: the command line),
    ``libero`` when none is."""
    text = " ".join(names).lower()
    return next((p for p in PLATFORMS if p in text), "libero")


@dataclass
class OpenVLAOFTConfig(OpenVLAConfig):
    """OpenVLA-OFT settings (plus :class:`OpenVLAConfig`); defaults are the LIBERO ones.

    Attributes:
        chunk_size: actions decoded in one pass (``NUM_ACTIONS_CHUNK``: 8 for LIBERO, 25 for
            ALOHA). An official checkpoint gets its platform's (:data:`PLATFORMS`) unless set.
        action_normalization: the bounds of the action and proprio normalisation (OFT's
            ``ACTION_PROPRIO_NORMALIZATION_TYPE``). ``bounds_q99``: q01/q99 (LIBERO, Bridge);
            ``bounds``: min/max (ALOHA: absolute joint angles must not be clipped to the
            percentiles). ``auto``: the platform's for an official checkpoint (an ``aloha``
            dataset key -> ``bounds``), the recorded value for one this package wrote,
            ``bounds_q99`` otherwise.
        image_keys: cameras in order: third-person ``main`` then ``wrist`` (LIBERO).
        center_crop: the official test-time crop (OFT trains with random crops; its LIBERO
            and ALOHA evaluations crop).
        use_proprio: append the proprio projector token after the image patches.
        proprio_dim: size of ``obs.state`` (8 for LIBERO).
        action_head: ``l1_gaussian`` -> the upstream L1-regression head (``MLPResNet``) gives
            the mean of a Gaussian with a learnable per-dim log-std (RL on the checkpoints people
            have); ``discrete`` -> categorical action tokens from the LM head (RLinf's OFT).
        action_head_blocks: residual blocks of the ``MLPResNet`` (2 upstream).
        init_log_std: initial log-std of the Gaussian head, in normalised action units: one
            value for every action dim, or a list of ``action_dim`` values (e.g. less
            exploration noise on dims the task does not need to vary).
            ``None``: -2 for a new head, and with a ``checkpoint`` the log-std it trained
            (``rl_heads.safetensors``); a value given with a checkpoint resets that one (e.g.
            more exploration noise for RL after a behaviour-cloned start).
        log_std_range: the log-std is clamped to this range.
        clip_greedy: clip the greedy action (the Gaussian's mean) to the normalised range
            ``[-1, 1]`` before un-normalising it, as sampled actions always are. ``False`` (the
            default) executes the mean as upstream OFT does (it never samples). A sample beyond
            a bound executes the bound, so RL can leave the mean past it: ``True`` then
            executes what the training rollouts did.
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"tiny": TINY_OFT, "full": {}}

    chunk_size: int = 8
    action_normalization: str = "auto"
    image_keys: tuple[str, ...] = ("main", "wrist")
    center_crop: bool | str = True
    use_proprio: bool = True
    proprio_dim: int = 8
    action_head: Literal["l1_gaussian", "discrete"] = "l1_gaussian"
    action_head_blocks: int = 2
    init_log_std: float | list[float] | None = None
    log_std_range: tuple[float, float] = (-5.0, 1.0)
    clip_greedy: bool = False

    def log_std_values(self) -> list[float]:
        """``init_log_std`` as a list (one value, or one per action dim)."""
        value = self.init_log_std
        return [float(x) for x in value] if isinstance(value, list | tuple) else [float(value)]

    def needs(self) -> PolicyNeeds:
        """Its cameras and, with ``use_proprio``, exactly ``proprio_dim`` state values."""
        return PolicyNeeds(
            cameras=tuple(self.image_keys),
            action_dim=self.action_dim,
            state_dim=self.proprio_dim if self.use_proprio else None,
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.action_normalization == "auto":  # a checkpoint's folder decides it before
            self.action_normalization = "bounds_q99"
        check(
            self,
            "action_normalization",
            self.action_normalization in ("bounds_q99", "bounds"),
            "must be auto, bounds_q99 or bounds",
        )
        self.log_std_range = tuple(float(x) for x in self.log_std_range)
        check(
            self,
            "action_head",
            self.action_head in ("l1_gaussian", "discrete"),
            "must be 'l1_gaussian' or 'discrete'",
        )
        check(self, "proprio_dim", self.proprio_dim >= 1, "must be >= 1")
        check(self, "action_head_blocks", self.action_head_blocks >= 0, "must be >= 0")
        lo, hi = self.log_std_range
        check(self, "log_std_range", lo < hi, "must be (low, high) with low < high")
        given = [] if self.init_log_std is None else self.log_std_values()
        check(self, "init_log_std", all(lo <= x <= hi for x in given), "must lie in log_std_range")
        check(
            self,
            "init_log_std",
            len(given) in (0, 1, self.action_dim),
            f"must be one value or action_dim={self.action_dim} values",
        )
        check(
            self,
            "use_fused_vision_backbone",
            self.use_fused_vision_backbone,
            "must be true: OFT's multi-image input needs the fused DINOv2+SigLIP backbone",
        )

    def default_center_crop(self, files: CheckpointFiles | None) -> bool:
        """``center_crop=auto``: on (every official OFT evaluation crops)."""
        return True
