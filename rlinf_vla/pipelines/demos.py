"""Demonstrations for behaviour cloning: LeRobot datasets as batches of (observation, action chunk).

``rlinf-vla sft`` reads one or more LeRobotDataset folders (v2.1 or v3.0, :mod:`rlinf_vla.data`)
and maps their features onto the policy's inputs by name:

- each camera the policy reads (``main``, ``wrist``...) from ``observation.images.<camera>``,
  or from the feature ``data.cameras`` names for it;
- the proprioceptive state from ``data.state`` (``observation.state``), the actions from
  ``data.action`` (``action``), the instruction from the frame's task string.

A sample is frame ``t`` of an episode with the target chunk ``a[t], ..., a[t + K - 1]`` of the
same episode; past the episode's end the chunk repeats its last action (the robot holds its
final command), so every frame, the last ones too, teaches the policy.

The statistics the policy normalises with (its actions, its state) are the datasets' own
(``meta/stats.json``, combined over the datasets by their frame counts).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlinf_vla.config import ConfigError
from rlinf_vla.types import Observation

IMAGE_PREFIX = "observation.images."


@dataclass(frozen=True)
class FeatureMap:
    """Which dataset feature feeds which policy input.

    Attributes:
        cameras: policy camera name -> dataset feature (``observation.images.main``).
        state: the state feature, or ``None`` when the policy reads no state.
        action: the action feature.
    """

    cameras: dict[str, str]
    state: str | None
    action: str


def map_features(
    path: str,
    features: dict[str, dict[str, Any]],
    policy_cameras: Sequence[str],
    cameras: dict[str, str],
    state: str | None,
    action: str,
) -> FeatureMap:
    """Match a dataset's features to the policy's inputs; fails naming what the dataset has.

    Args:
        path: the dataset folder (for messages).
        features: the dataset's ``meta/info.json`` features (name -> dtype, shape...).
        policy_cameras: the cameras the policy reads.
        cameras: explicit policy camera -> feature choices (``data.cameras``).
        state, action: the state and action feature names (``state=None``: no state).

    Raises:
        ConfigError: every input that has no feature, in one message.
    """
    visual = sorted(k for k, v in features.items() if v.get("dtype") in ("video", "image"))
    problems = []
    unknown = sorted(set(cameras) - set(policy_cameras))
    if unknown:
        problems.append(
            f"data.cameras names camera(s) {unknown} the policy does not read "
            f"(it reads {list(policy_cameras)})"
        )
    chosen: dict[str, str] = {}
    for cam in policy_cameras:
        feature = cameras.get(cam, IMAGE_PREFIX + cam)
        if feature not in visual:
            guess = f" (set data.cameras.{cam}=<one of them>)" if visual else ""
            problems.append(
                f"the policy's camera {cam!r} needs the image feature {feature!r}, which the "
                f"dataset lacks; its image features: {visual}{guess}"
            )
        chosen[cam] = feature
    for what, name in (("data.action", action), ("data.state", state)):
        if name is not None and name not in features:
            numeric = sorted(k for k in features if k not in visual)
            problems.append(
                f"{what}={name!r} is not a feature of the dataset; its others: {numeric}"
            )
    if problems:
        raise ConfigError(f"data.paths: {path}: " + "; ".join(problems))
    return FeatureMap(chosen, state, action)


def combine_stats(parts: list[tuple[dict[str, Any], int]]) -> dict[str, np.ndarray]:
    """Statistics of several datasets' feature from each one's (``stats``, frame count):
    min/max of the extremes, the count-weighted mean, the pooled std, and count-weighted
    quantiles (an approximation where the datasets differ; exact for one dataset)."""
    if len(parts) == 1:
        return {k: np.asarray(v, dtype=np.float64) for k, v in parts[0][0].items()}
    counts = np.array([n for _, n in parts], dtype=np.float64)
    w = counts / counts.sum()

    def stack(key: str) -> np.ndarray:
        return np.stack([np.asarray(s[key], dtype=np.float64) for s, _ in parts])

    mean = np.einsum("i,i...->...", w, stack("mean"))
    second = np.einsum("i,i...->...", w, stack("std") ** 2 + stack("mean") ** 2)
    out = {
        "min": stack("min").min(0),
        "max": stack("max").max(0),
        "mean": mean,
        "std": np.sqrt(np.maximum(second - mean**2, 0.0)),
    }
    for key in parts[0][0]:
        if key.startswith("q") and key[1:].isdigit():
            out[key] = np.einsum("i,i...->...", w, stack(key))
    return out


class Demonstrations:
    """Frames of one or more datasets in memory, sampled as training batches.

    Args:
        frames: per dataset, what :meth:`rlinf_vla.data.Dataset.load` returns.
        features: per dataset, its :class:`FeatureMap`.
        chunk_size: ``K``, actions per sample.
        names: per dataset, its path (for errors).

    Raises:
        ValueError: a dataset's frames cannot train (:func:`check_frames`).
    """

    def __init__(
        self,
        frames: list[dict[str, Any]],
        features: list[FeatureMap],
        chunk_size: int,
        names: list[str] | None = None,
    ) -> None:
        images: dict[str, list[np.ndarray]] = {cam: [] for cam in features[0].cameras}
        states, actions, episodes, tasks = [], [], [], []
        offset = 0
        for data, fmap, name in zip(frames, features, names or [""] * len(frames), strict=True):
            check_frames(name, data, fmap)
            for cam, feature in fmap.cameras.items():
                images[cam].append(np.asarray(data["images"][feature]))
            if fmap.state is not None:
                states.append(np.asarray(data[fmap.state], dtype=np.float32))
            actions.append(np.asarray(data[fmap.action], dtype=np.float32))
            ep = np.asarray(data["episode_index"], dtype=np.int64)
            # episodes of different datasets never merge: shift past the previous ones
            episodes.append(ep - ep.min() + offset if len(ep) else ep)
            offset = int(episodes[-1].max()) + 1 if len(ep) else offset
            names = data["tasks"]
            tasks += [names[int(i)] for i in np.asarray(data["task_index"])]
        self.images = {k: torch.from_numpy(np.concatenate(v)) for k, v in images.items()}
        self.state = torch.from_numpy(np.concatenate(states)) if states else None
        self.actions = torch.from_numpy(np.concatenate(actions))
        self.tasks = tasks
        episode = torch.from_numpy(np.concatenate(episodes))
        n = len(episode)
        if n == 0:
            raise ValueError("the datasets hold no frames")
        # chunk target rows: t, t+1, ..., t+K-1 clamped to the episode's last frame
        ends = torch.zeros(n, dtype=torch.long)
        change = torch.nonzero(episode[1:] != episode[:-1]).flatten() + 1
        bounds = [0, *change.tolist(), n]
        for a, b in itertools.pairwise(bounds):
            ends[a:b] = b - 1
        steps = torch.arange(chunk_size)
        self.targets = torch.minimum(torch.arange(n)[:, None] + steps, ends[:, None])
        self.episode = episode
        self.num_episodes = len(bounds) - 1
        self.chunk_size = chunk_size

    def __len__(self) -> int:
        return len(self.episode)

    def batch(self, rows: torch.Tensor) -> tuple[Observation, torch.Tensor]:
        """The observations of frames ``rows`` and their target chunks ``float32 [B, K, A]``."""
        obs = Observation(
            images={k: v[rows] for k, v in self.images.items()},
            state=None if self.state is None else self.state[rows],
            instruction=[self.tasks[i] for i in rows.tolist()],
        )
        return obs, self.actions[self.targets[rows]]

    def sample(self, size: int, generator: torch.Generator) -> tuple[Observation, torch.Tensor]:
        """``size`` frames drawn uniformly (with replacement) with ``generator``."""
        return self.batch(torch.randint(len(self), (size,), generator=generator))


def load_demonstrations(
    paths: Sequence[str], features: list[FeatureMap], chunk_size: int
) -> Demonstrations:
    """Read the datasets into memory (videos decoded) as :class:`Demonstrations`."""
    from rlinf_vla.data import open_dataset

    frames = [open_dataset(Path(p)).load() for p in paths]
    return Demonstrations(frames, features, chunk_size, [str(p) for p in paths])


def value_problem(name: str, data: dict[str, Any], features: list[str]) -> str | None:
    """Where the numeric ``features`` of dataset ``name``'s frames (``data``: what
    :meth:`~rlinf_vla.data.Dataset.load_tabular` returns) are not finite: the feature, how many
    frames, the first episode and frame; ``None`` when every value is finite."""
    episode = np.asarray(data["episode_index"])
    frame = np.asarray(data.get("frame_index", np.arange(len(episode))))
    for feature in features:
        values = np.asarray(data[feature], dtype=np.float64).reshape(len(episode), -1)
        bad = ~np.isfinite(values).all(axis=1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            return (
                f"{name}: {feature} holds NaN or inf in {int(bad.sum())} frame(s), the first "
                f"in episode {int(episode[i])} at frame {int(frame[i])}"
            )
    return None


def check_frames(name: str, data: dict[str, Any], fmap: FeatureMap) -> None:
    """``ValueError`` naming the dataset ``name``, the feature and the first episode and frame
    where its frames cannot train: actions or states that are not finite, a camera whose
    frames are not ``uint8 [T, H, W, 3]`` for every frame."""
    problem = value_problem(name, data, [f for f in (fmap.action, fmap.state) if f])
    if problem:
        raise ValueError(problem)
    n = len(data["episode_index"])
    for cam, feature in fmap.cameras.items():
        images = np.asarray(data["images"][feature])
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(
                f"{name}: camera {cam!r} ({feature}): frames are {images.dtype} "
                f"{list(images.shape)}, expected uint8 [T, H, W, 3]"
            )
        if len(images) != n:
            raise ValueError(f"{name}: {feature} has {len(images)} frames for {n} rows")
