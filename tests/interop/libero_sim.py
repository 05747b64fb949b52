"""One LIBERO task's simulator in a subprocess of the main env, driven over a pipe.

openpi-client lives in .venv-openpi (numpy < 2) and LIBERO in the main env, so a client loop
that runs in either env reaches the simulator through :class:`LiberoSim`: it starts this file
with the main env's interpreter and forwards ``reset`` / ``step`` to LIBERO's own
``OffScreenRenderEnv``, built as openpi's LIBERO example builds it (the task's BDDL file, square
cameras of ``--resolution`` px, ``env.seed(--seed)``; each episode ``env.reset()`` then
``env.set_init_state(init_states[k])``). Observations come back as LIBERO returns them (the
camera images upside down, ``robot0_eef_quat`` in robosuite's xyzw order), plus MuJoCo's
flattened state for comparing trajectories.

Frames are a 4-byte big-endian length and msgpack with openpi's array encoding (the main env
writes it with ``rlinf_vla.real_robot.codec``, .venv-openpi reads it with
``openpi_client.msgpack_numpy``). The worker's stdout carries only frames: anything LIBERO
prints goes to stderr. This module imports only the standard library at the top.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

#: The keys of LIBERO's observation that a client loop reads (openpi's example reads these).
OBS_KEYS = (
    "agentview_image",
    "robot0_eye_in_hand_image",
    "robot0_eef_pos",
    "robot0_eef_quat",
    "robot0_gripper_qpos",
)


def _write(stream: BinaryIO, payload: bytes) -> None:
    stream.write(struct.pack(">I", len(payload)) + payload)
    stream.flush()


def _read(stream: BinaryIO) -> bytes:
    header = stream.read(4)
    if len(header) < 4:
        raise EOFError("the other end of the pipe closed")
    (n,) = struct.unpack(">I", header)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the pipe closed inside a frame")
    return data


class LiberoSim:
    """The client side: a LIBERO simulator in a subprocess run by ``python`` (the main env's).

    Args:
        python: the interpreter that has LIBERO and rlinf_vla.
        packb, unpackb: msgpack with openpi's array encoding in the caller's env.
        suite, task_id: the task (``libero_spatial``, 0..9).
        resolution: camera side in pixels (openpi's example renders 256).
        seed: ``env.seed`` (openpi's example: 7).
        fast_render: no reflections, shadows, skybox or multisampling (only the images change;
            both compared runs render alike).
    """

    def __init__(
        self,
        python: str,
        packb: Callable[[Any], bytes],
        unpackb: Callable[[bytes], Any],
        suite: str,
        task_id: int,
        resolution: int = 256,
        seed: int = 7,
        fast_render: bool = True,
    ) -> None:
        self._packb, self._unpackb = packb, unpackb
        cmd = [python, os.path.abspath(__file__), "--suite", suite, "--task-id", str(task_id)]
        cmd += ["--resolution", str(resolution), "--seed", str(seed)]
        cmd += ["--fast-render"] if fast_render else []
        env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
        env["PYOPENGL_PLATFORM"] = env["MUJOCO_GL"]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        hello = self._reply()
        self.instruction: str = hello["instruction"]
        self.num_init_states: int = hello["num_init_states"]

    def _reply(self) -> dict:
        assert self._proc.stdout is not None
        try:
            reply = self._unpackb(_read(self._proc.stdout))
        except EOFError:
            raise RuntimeError(f"the LIBERO worker exited with code {self._proc.wait()}") from None
        if "error" in reply:
            raise RuntimeError(f"the LIBERO worker failed:\n{reply['error']}")
        return reply

    def _call(self, **msg: Any) -> dict:
        assert self._proc.stdin is not None
        _write(self._proc.stdin, self._packb(msg))
        return self._reply()

    def reset(self, init_state: int) -> dict:
        """``env.reset()``, then ``env.set_init_state(init_states[init_state])``'s observation."""
        return self._call(cmd="reset", init_state=init_state)["obs"]

    def step(self, action: list[float]) -> tuple[dict, float, bool, Any]:
        """``env.step(action)``: observation, reward, done, and MuJoCo's flattened state."""
        r = self._call(cmd="step", action=[float(a) for a in action])
        return r["obs"], r["reward"], r["done"], r["sim_state"]

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, RuntimeError):
                self._call(cmd="close")
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> LiberoSim:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------- worker (main env)
def _serve(args: argparse.Namespace, out: BinaryIO) -> None:
    import traceback

    import numpy as np

    from rlinf_vla.envs.libero.env import (
        _fast_render_context,
        _fast_render_flags,
        _import_benchmark,
    )
    from rlinf_vla.real_robot import codec

    def send(msg: dict) -> None:
        _write(out, codec.packb(msg, openpi=True))

    try:
        benchmark = _import_benchmark()
        from libero.libero import get_libero_path
        from libero.libero.envs import OffScreenRenderEnv

        suite = benchmark.get_benchmark_dict()[args.suite]()
        task = suite.get_task(args.task_id)
        init_states = suite.get_task_init_states(args.task_id)
        bddl = Path(get_libero_path("bddl_files")) / task.problem_folder / task.bddl_file
        # A hard reset (LIBERO's default) rebuilds the simulator and its render context: the
        # fast-render settings stay patched in for the worker's whole life.
        fast = _fast_render_context() if args.fast_render else contextlib.nullcontext()
        with fast:
            env = OffScreenRenderEnv(
                bddl_file_name=str(bddl),
                camera_heights=args.resolution,
                camera_widths=args.resolution,
            )
            env.seed(args.seed)

            def observe(raw: dict) -> dict:
                return {k: np.asarray(raw[k]) for k in OBS_KEYS}

            send({"instruction": task.language, "num_init_states": len(init_states)})
            while True:
                msg = codec.unpackb(_read(sys.stdin.buffer), openpi=True)
                if msg["cmd"] == "close":
                    send({})
                    break
                if msg["cmd"] == "reset":
                    env.reset()
                    if args.fast_render:
                        _fast_render_flags(env.sim)
                    raw = env.set_init_state(init_states[msg["init_state"]])
                    send({"obs": observe(raw)})
                elif msg["cmd"] == "step":
                    raw, reward, done, _ = env.step(msg["action"])
                    send(
                        {
                            "obs": observe(raw),
                            "reward": float(reward),
                            "done": bool(done),
                            "sim_state": env.sim.get_state().flatten(),
                        }
                    )
                else:
                    raise ValueError(f"unknown command {msg['cmd']!r}")
            env.close()
    except EOFError:
        pass
    except Exception:
        send({"error": traceback.format_exc()})
        raise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", required=True)
    parser.add_argument("--task-id", type=int, required=True)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--fast-render", action="store_true")
    args = parser.parse_args()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stdout carries frames only; what LIBERO prints goes to stderr
    sys.stdout = sys.stderr
    _serve(args, out)


if __name__ == "__main__":
    main()
