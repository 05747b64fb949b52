"""OpenVLA-OFT's transforms: OpenVLA's, with several cameras, proprioception and OFT's
un-normalisation (``+1e-8`` in the range)."""

from __future__ import annotations

from rlinf_vla.policies.openvla.processor import OpenVLAProcessor

__all__ = ["OpenVLAOFTProcessor"]


class OpenVLAOFTProcessor(OpenVLAProcessor):
    """Pixel values of all ``image_keys`` (``[B, 6 * n_cameras, S, S]``), prompts, proprio
    ``BOUNDS_Q99`` normalisation with the dataset's ``proprio`` statistics, and actions."""

    policy_name = "openvla_oft"
    unnorm_eps = 1e-8
