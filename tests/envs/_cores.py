"""A tiny single-env core for subprocess tests (importable by spawned children)."""

from __future__ import annotations

import os
import time

import numpy as np


class CounterCore:
    """Position ``x`` starts at the reset id and moves by ``action[0]``; success at ``x >= 10``."""

    def __init__(self, fail_start: bool = False, step_time_s: float = 0.0) -> None:
        if fail_start:
            raise ValueError("this core refuses to start")
        self.x = 0.0
        self.renders = 0
        self.step_time_s = step_time_s  # a slower simulator

    def _obs(self) -> dict:
        self.renders += 1
        return {
            "images": {"main": np.full((4, 4, 3), int(self.x) % 256, dtype=np.uint8)},
            "state": np.array([self.x], dtype=np.float32),
            "instruction": "count to ten",
        }

    def reset(self, reset_id: int) -> dict:
        self.x = float(reset_id)
        return self._obs()

    def step(self, action: np.ndarray, render: bool) -> tuple:
        time.sleep(self.step_time_s)
        self.x += float(action[0])
        success = self.x >= 10
        obs = self._obs() if render or success else None
        return obs, float(success), success, success

    def render_count(self) -> int:
        return self.renders

    def pid(self) -> int:
        return os.getpid()

    def burn(self, seconds: float) -> None:
        """Compute (not sleep) for ``seconds`` of this process's CPU time."""
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    def boom(self) -> None:
        raise RuntimeError("boom inside the core")

    def close(self) -> None:
        pass
