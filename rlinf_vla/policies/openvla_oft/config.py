"""Config of OpenVLA-OFT (parallel decoding of an action chunk, proprio token, L1 head)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from rlinf_vla.policies.base import check
from rlinf_vla.policies.openvla.config import TINY_OPENVLA, OpenVLAConfig

__all__ = ["OpenVLAOFTConfig"]

TINY_OFT: dict[str, Any] = {**TINY_OPENVLA, "proprio_dim": 8}


@dataclass
class OpenVLAOFTConfig(OpenVLAConfig):
    """OpenVLA-OFT settings (plus :class:`OpenVLAConfig`); defaults are the LIBERO ones.

    Attributes:
        chunk_size: actions decoded in one pass (``NUM_ACTIONS_CHUNK``: 8 for LIBERO).
        image_keys: cameras in order: third-person ``main`` then ``wrist`` (LIBERO).
        center_crop: crop the central 90% of the image area (OFT trains with random crops).
        use_proprio: append the proprio projector token after the image patches.
        proprio_dim: size of ``obs.state`` (8 for LIBERO).
        action_head: ``l1_gaussian`` -> the upstream L1-regression head (``MLPResNet``) gives
            the mean of a Gaussian with a learnable per-dim log-std (RL on the checkpoints people
            have); ``discrete`` -> categorical action tokens from the LM head (RLinf's OFT).
        action_head_blocks: residual blocks of the ``MLPResNet`` (2 upstream).
        init_log_std: initial log-std of the Gaussian head, in normalised action units.
        log_std_range: the log-std is clamped to this range.
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"tiny": TINY_OFT, "full": {}}

    chunk_size: int = 8
    image_keys: tuple[str, ...] = ("main", "wrist")
    center_crop: bool = True
    use_proprio: bool = True
    proprio_dim: int = 8
    action_head: Literal["l1_gaussian", "discrete"] = "l1_gaussian"
    action_head_blocks: int = 2
    init_log_std: float = -2.0
    log_std_range: tuple[float, float] = (-5.0, 1.0)

    def __post_init__(self) -> None:
        super().__post_init__()
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
        check(self, "init_log_std", lo <= self.init_log_std <= hi, "must lie in log_std_range")
        check(
            self,
            "use_fused_vision_backbone",
            self.use_fused_vision_backbone,
            "must be true: OFT's multi-image input needs the fused DINOv2+SigLIP backbone",
        )
