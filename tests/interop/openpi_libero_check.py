"""openpi's LIBERO example loop with PyPI's openpi-client, unmodified, against a running
``rlinf-vla serve server.protocol=openpi server.openpi_layout=libero`` (run in .venv-openpi by
tests/interop/test_openpi_libero.py)::

    .venv-openpi/bin/python tests/interop/openpi_libero_check.py --port 8000 \\
        --sim-python .venv/bin/python --task-id 0 --episodes 2 --max-steps 20 --out DIR

The loop is :func:`libero_loop.run_episode`; here it gets openpi's parts: images go through
``openpi_client.image_tools.resize_with_pad`` and ``convert_to_uint8``, and each query is the
observation map of openpi's example (``observation/image``, ``observation/wrist_image``,
``observation/state``, ``prompt``) sent with ``WebsocketClientPolicy.infer``, whose
``actions`` are the chunk. The simulator is LIBERO in the main env (:mod:`libero_sim`).
Writes ``DIR/episodes.npz`` (each episode's record, keys ``<episode>/<name>``) and prints a
JSON summary on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from libero_loop import MAX_STEPS, RESOLUTION, SEED, run_episode
from libero_sim import LiberoSim
from openpi_client import image_tools, msgpack_numpy, websocket_client_policy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--sim-python", required=True, help="the main env's interpreter")
    parser.add_argument("--suite", default="libero_spatial")
    parser.add_argument("--task-id", type=int, default=0)
    parser.add_argument("--episodes", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None, help="default: the suite's")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    max_steps = args.max_steps or MAX_STEPS[args.suite]

    client = websocket_client_policy.WebsocketClientPolicy(args.host, args.port)

    def resize(image: np.ndarray, size: int) -> np.ndarray:
        return image_tools.convert_to_uint8(image_tools.resize_with_pad(image, size, size))

    def infer(img: np.ndarray, wrist: np.ndarray, state: np.ndarray, prompt: str) -> np.ndarray:
        element = {
            "observation/image": img,
            "observation/wrist_image": wrist,
            "observation/state": state,
            "prompt": str(prompt),
        }
        return client.infer(element)["actions"]

    summary: dict = {"episodes": []}
    saved: dict[str, np.ndarray] = {}
    with LiberoSim(
        args.sim_python,
        msgpack_numpy.packb,
        msgpack_numpy.unpackb,
        args.suite,
        args.task_id,
        resolution=RESOLUTION,
        seed=SEED,
    ) as sim:
        summary["prompt"] = sim.instruction
        for episode in range(args.episodes):
            record = run_episode(sim, episode, sim.instruction, resize, infer, max_steps)
            summary["episodes"].append({"success": record["success"], "steps": record["steps"]})
            for key, value in record.items():
                saved[f"{episode}/{key}"] = np.asarray(value)
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez(args.out / "episodes.npz", **saved)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
