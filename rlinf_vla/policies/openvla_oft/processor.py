"""OpenVLA-OFT's transforms: OpenVLA's, with several cameras, proprioception and OFT's
un-normalisation (``+1e-8`` in the range, q01/q99 or min/max bounds)."""

from __future__ import annotations

from rlinf_vla.policies.openvla.processor import OpenVLAProcessor
from rlinf_vla.policies.openvla_oft.config import OpenVLAOFTConfig
from rlinf_vla.policies.transforms import Bounds, BoundsQ99, ProprioBounds, ProprioBoundsQ99

__all__ = ["OpenVLAOFTProcessor"]


class OpenVLAOFTProcessor(OpenVLAProcessor):
    """Pixel values of all ``image_keys`` (``[B, 6 * n_cameras, S, S]``), prompts, proprio
    normalisation with the dataset's ``proprio`` statistics, and actions; the bounds are the
    config's ``action_normalization`` (OFT's ``ACTION_PROPRIO_NORMALIZATION_TYPE``)."""

    policy_name = "openvla_oft"
    unnorm_eps = 1e-8
    # resize_image_for_policy runs only for images that are not already at the model size
    rlds_jpeg_at_model_size = False
    config: OpenVLAOFTConfig

    def normalization_classes(self) -> tuple[type[Bounds], type[ProprioBounds]]:
        if self.config.action_normalization == "bounds":
            return Bounds, ProprioBounds
        return BoundsQ99, ProprioBoundsQ99
