"""The toy VLA env: "move to the blue square" among coloured shapes, batched in torch."""

from __future__ import annotations

import math
import time

import torch

from rlinf_vla.envs.base import StepOutput, VectorEnv, hash_ints, register_env
from rlinf_vla.envs.toy.config import COLORS, DEFAULT_MAX_EPISODE_STEPS, GRID, SHAPES, ToyEnvConfig
from rlinf_vla.types import Observation

_BACKGROUND = (40, 40, 48)
_AGENT_COLOR = (255, 255, 255)
_OBJECT_HALF_SIZE = 0.07
_AGENT_RADIUS = 0.03
_JITTER = 0.06


@register_env("toy")
class ToyEnv(VectorEnv):
    """Toy language-conditioned reaching task: the CI-scale workload for learning and benchmarks.

    Task sheet:

    - **Description.** A white agent dot and ``num_objects`` coloured shapes (square, circle,
      triangle; each colour used once) lie in the unit square. The instruction names one of
      them: ``"move to the blue square"``. The agent must move onto it.
    - **Randomisation (by reset id only).** The arena is split into 3x3 cells; the objects and the
      agent start in distinct random cells with a random offset of up to 0.06 from the cell
      centre (``agent_start="center"``: the agent starts exactly at the arena centre and the
      objects in the other cells); colours, shapes and the target are random. The same reset id always gives the same
      scene, on any device and with any seed (the seed only drives the reset-id cursor).
    - **Success.** The agent's centre is within ``success_radius`` (0.05) of the target's centre.
      It terminates the episode (sparse reward 1.0 at that step, 0 otherwise). Time limit: 30
      steps by default. ``reward_mode="dense"`` adds ``progress_reward_scale * (d_before -
      d_after) / step_size`` each step (``d``: distance to the target; potential-based
      shaping, see :class:`ToyEnvConfig`).
    - **Observation.** ``images["main"]``: uint8 ``[B, S, S, 3]`` top-down view (``S =
      image_size``, 64 by default; y grows downwards); ``state``: float32 ``[B, 2]`` agent
      position in ``[0, 1]^2`` (``[B, 4]`` with the offset to the target in ``"privileged"``
      mode); ``instruction``: the sentence above.
    - **Action.** float32 ``[A]`` (A = ``action_dim``, 7 by default): entries 0 and 1 are x and
      y velocity, clipped to ``[-1, 1]`` and scaled by ``step_size`` (0.06); the rest is ignored.
      Positions are clipped to the arena.
    - **Baselines.** The scripted :meth:`oracle_actions` solves every episode (at most 14 steps);
      uniform random actions solve about 2% (``tests/envs/test_toy.py``).
    - **Cost.** Fully vectorised; ``step_time_s`` / ``step_time_per_env_s`` add a sleep per step
      to emulate a slower simulator.
    """

    config_cls = ToyEnvConfig

    def __init__(self, config: ToyEnvConfig) -> None:
        super().__init__(config, DEFAULT_MAX_EPISODE_STEPS)
        self.cfg = config
        self.device = torch.device(config.device)
        n, m, s = config.num_envs, config.num_objects, config.image_size
        self._palette = torch.tensor(list(COLORS.values()), dtype=torch.uint8)
        self._background = torch.tensor(_BACKGROUND, dtype=torch.uint8)
        self._agent_color = torch.tensor(_AGENT_COLOR, dtype=torch.uint8)
        self._pos = torch.zeros(n, 2)
        self._obj_pos = torch.zeros(n, m, 2)
        self._obj_color = torch.zeros(n, m, dtype=torch.long)
        self._obj_shape = torch.zeros(n, m, dtype=torch.long)
        self._target = torch.zeros(n, dtype=torch.long)
        self._scene = torch.zeros(n, s, s, 3, dtype=torch.uint8)
        self._instructions = [""] * n
        self._last_obs: Observation | None = None  # returned while no observation is needed
        self._move_to(self.device)

    # ------------------------------------------------------------------ contract
    @property
    def action_dim(self) -> int:
        return self.cfg.action_dim

    @property
    def target_pos(self) -> torch.Tensor:
        """Target centre of every env, float32 ``[B, 2]``."""
        return self._obj_pos[torch.arange(self.num_envs, device=self.device), self._target]

    def oracle_actions(self, chunk: int = 1) -> torch.Tensor:
        """Scripted expert: actions ``[B, chunk, A]`` that walk straight onto the target.

        It plans from the current positions, so each chunk brings the agent closer and the
        episode succeeds within ``ceil(0.8 / step_size)`` steps.
        """
        delta = self.target_pos - self._pos
        step = self.cfg.step_size
        out = torch.zeros(self.num_envs, chunk, self.action_dim, device=self.device)
        pos = torch.zeros_like(delta)
        for k in range(chunk):
            a = ((delta - pos) / step).clamp(-1.0, 1.0)
            out[:, k, :2] = a
            pos = pos + a * step
        return out.cpu()

    def expert_actions(self) -> torch.Tensor:
        """The one-step oracle (:meth:`oracle_actions`): ``[B, A]`` straight at the target."""
        return self.oracle_actions(chunk=1)[:, 0]

    # ------------------------------------------------------------------ primitives
    def _reset_envs(self, env_ids: torch.Tensor, reset_ids: torch.Tensor) -> Observation:
        m = self.cfg.num_objects
        ids = reset_ids.to(self.device)
        u = hash_ints(ids[:, None], torch.arange(64, device=self.device)[None, :]).double()
        u = (u / 2**32).float()
        if self.cfg.agent_start == "center":
            # The agent takes the centre cell, the objects m of the other cells.
            middle = GRID * GRID // 2
            others = torch.tensor(
                [c for c in range(GRID * GRID) if c != middle], device=self.device
            )
            objs = others[torch.argsort(u[:, : GRID * GRID - 1], dim=1)[:, :m]]
            cells = torch.cat([objs, torch.full_like(objs[:, :1], middle)], dim=1)
        else:
            cells = torch.argsort(u[:, : GRID * GRID], dim=1)[:, : m + 1]
        centre = torch.stack(((cells % GRID).float(), (cells // GRID).float()), -1)
        centre = (centre + 0.5) / GRID
        jitter = (u[:, 16 : 16 + 2 * (m + 1)].view(-1, m + 1, 2) * 2 - 1) * _JITTER
        if self.cfg.agent_start == "center":
            jitter[:, m] = 0.0
        pos = centre + jitter
        colors = torch.argsort(u[:, 32 : 32 + len(COLORS)], dim=1)[:, :m]
        shapes = (u[:, 40 : 40 + m] * len(SHAPES)).long().clamp(max=len(SHAPES) - 1)
        target = (u[:, 48] * m).long().clamp(max=m - 1)
        rows = env_ids.to(self.device)
        self._obj_pos[rows] = pos[:, :m]
        self._pos[rows] = pos[:, m]
        self._obj_color[rows] = colors
        self._obj_shape[rows] = shapes
        self._target[rows] = target
        names = list(COLORS)
        tc = colors.gather(1, target[:, None]).flatten().tolist()
        ts = shapes.gather(1, target[:, None]).flatten().tolist()
        for i, c, s in zip(env_ids.tolist(), tc, ts, strict=True):
            self._instructions[i] = f"move to the {names[c]} {SHAPES[s]}"
        self._scene[rows] = self._render_scene(rows)
        return Observation(
            images={"main": self._render(rows)},
            state=self._state(rows),
            instruction=[self._instructions[i] for i in env_ids.tolist()],
        )

    def _step_envs(
        self, actions: torch.Tensor, active: torch.Tensor, need_obs: torch.Tensor
    ) -> StepOutput:
        cfg = self.cfg
        active = active.to(self.device)
        a = actions[:, :2].to(self.device).clamp(-1.0, 1.0)
        before = torch.linalg.vector_norm(self._pos - self.target_pos, dim=1)
        moved = (self._pos + a * cfg.step_size).clamp(0.0, 1.0)
        self._pos = torch.where(active[:, None], moved, self._pos)
        dist = torch.linalg.vector_norm(self._pos - self.target_pos, dim=1)
        success = dist <= cfg.success_radius
        reward = success.float()
        if cfg.reward_mode == "dense":
            reward = reward + cfg.progress_reward_scale * (before - dist) / cfg.step_size
        if bool(((need_obs.to(self.device) | success) & active).any()) or self._last_obs is None:
            self._last_obs = Observation(
                images={"main": self._render()},
                state=self._state(),
                instruction=list(self._instructions),
            )
        if cfg.step_time_s or cfg.step_time_per_env_s:
            time.sleep(cfg.step_time_s + cfg.step_time_per_env_s * int(active.sum()))
        return StepOutput(obs=self._last_obs, reward=reward, terminated=success, success=success)

    def _offload(self) -> None:
        self._move_to(torch.device("cpu"))

    def _onload(self) -> None:
        self._move_to(self.device)

    # ------------------------------------------------------------------ helpers
    def _move_to(self, device: torch.device) -> None:
        for name in (
            "_palette",
            "_background",
            "_agent_color",
            "_pos",
            "_obj_pos",
            "_obj_color",
            "_obj_shape",
            "_target",
            "_scene",
        ):
            setattr(self, name, getattr(self, name).to(device))

    def _state(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        pos = self._pos if rows is None else self._pos[rows]
        if self.cfg.state_mode == "proprio":
            return pos.clone()
        target = self.target_pos if rows is None else self.target_pos[rows]
        return torch.cat((pos, target - pos), dim=1)

    def _render_scene(self, rows: torch.Tensor) -> torch.Tensor:
        """Draw the objects of envs ``rows`` (static during an episode): uint8 ``[n, S, S, 3]``.

        Builds a colour-index map ``[n, S, S]`` (0 = background) and looks the colours up once,
        which keeps the number of full-image tensor ops small.
        """
        s = self.cfg.image_size
        grid = (torch.arange(s, device=self.device, dtype=torch.float32) + 0.5) / s
        obj_pos = self._obj_pos[rows]
        obj_shape = self._obj_shape[rows]
        obj_label = (self._obj_color[rows] + 1).to(torch.uint8)
        label = torch.zeros(len(rows), s, s, dtype=torch.uint8, device=self.device)
        r = _OBJECT_HALF_SIZE
        for j in range(self.cfg.num_objects):
            dx = grid[None, None, :] - obj_pos[:, j, 0, None, None]
            dy = grid[None, :, None] - obj_pos[:, j, 1, None, None]
            adx, ady = dx.abs(), dy.abs()
            shape = obj_shape[:, j, None, None]
            mask = (shape == 0) & (adx <= r) & (ady <= r)
            mask |= (shape == 1) & (dx * dx + dy * dy <= r * r)
            mask |= (shape == 2) & (ady <= r) & (adx <= (dy + r) * 0.5)
            label.masked_fill_(mask, 0)
            label += mask * obj_label[:, j, None, None]
        colors = torch.cat((self._background[None], self._palette))
        return colors[label.long()]

    def _render(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The scene of envs ``rows`` (all by default) with the agent drawn on top."""
        img = (self._scene if rows is None else self._scene[rows]).clone()
        pos = self._pos if rows is None else self._pos[rows]
        s = self.cfg.image_size
        half = math.ceil(_AGENT_RADIUS * s) + 1
        off = torch.arange(-half, half + 1, device=self.device)
        pix = (pos * s).floor().long()
        ix = pix[:, 0, None, None] + off[None, None, :]
        iy = pix[:, 1, None, None] + off[None, :, None]
        dx = (ix + 0.5) / s - pos[:, 0, None, None]
        dy = (iy + 0.5) / s - pos[:, 1, None, None]
        inside = (dx * dx + dy * dy <= _AGENT_RADIUS**2) & (ix >= 0) & (ix < s)
        inside &= (iy >= 0) & (iy < s)
        b = torch.arange(len(pos), device=self.device)[:, None, None].expand_as(inside)
        img[b[inside], iy.expand_as(inside)[inside], ix.expand_as(inside)[inside]] = (
            self._agent_color
        )
        return img
