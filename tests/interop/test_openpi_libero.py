"""openpi's LIBERO example loop with the real openpi-client against ``rlinf-vla serve
server.protocol=openpi`` reaches the same episodes as the native client against ``rlinf-vla
serve``, with the same policy (tiny OpenVLA-OFT, seed 0) and the same LIBERO scenes.

Two servers of the same policy run side by side (openpi protocol, LIBERO layout; native
protocol). tests/interop/openpi_libero_check.py runs the loop (:mod:`libero_loop`) in
.venv-openpi with openpi-client's ``WebsocketClientPolicy`` and ``image_tools``; this process
runs the same loop with :class:`~rlinf_vla.real_robot.client.PolicyClient` and PIL. Both reach
LIBERO through a simulator subprocess of the main env (:mod:`libero_sim`), built as openpi's
example builds it. The observations sent, the chunks received, the actions executed, MuJoCo's
state after every step and each episode's outcome must agree. The tiny random policy does not
solve the task: the outcomes compared are failures after ``MAX_STEPS`` policy steps.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.interop.libero_loop import REPLAN_STEPS, RESOLUTION, SEED, run_episode
from tests.interop.libero_sim import LiberoSim
from tests.interop.serving import ROOT, ServeProcess

OPENPI_PYTHON = ROOT / ".venv-openpi" / "bin" / "python"
CHECK = Path(__file__).with_name("openpi_libero_check.py")
SUITE, TASK_ID, EPISODES, MAX_STEPS = "libero_spatial", 0, 2, 20
POLICY = ("policy=openvla_oft", "policy.preset=tiny", "policy.seed=0")

_required = os.environ.get("RLINF_REQUIRE_OPENPI") == "1"  # scripts/test.sh's openpi stage
pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(
        not OPENPI_PYTHON.exists() and not _required,
        reason=f"{OPENPI_PYTHON} is missing: run scripts/install_openpi_client.sh",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("libero") is None and not _required,
        reason="LIBERO is not installed (pip install 'rlinf-vla[libero]')",
    ),
]


def resize_with_pad(image: np.ndarray, size: int) -> np.ndarray:
    """``image`` scaled (bilinear, aspect kept) to fit ``size x size``, centred on black."""
    from PIL import Image

    h, w = image.shape[:2]
    if (h, w) == (size, size):
        return image
    scale = max(h / size, w / size)
    rh, rw = int(h / scale), int(w / scale)
    resized = np.asarray(Image.fromarray(image).resize((rw, rh), resample=Image.BILINEAR))
    out = np.zeros((size, size, 3), dtype=np.uint8)
    top, left = (size - rh) // 2, (size - rw) // 2
    out[top : top + rh, left : left + rw] = resized
    return out


def native_episodes(port: int) -> tuple[str, list[dict]]:
    from rlinf_vla.real_robot import codec
    from rlinf_vla.real_robot.client import PolicyClient

    def packb(obj: object) -> bytes:
        return codec.packb(obj, openpi=True)

    def unpackb(data: bytes) -> object:
        return codec.unpackb(data, openpi=True)

    with (
        PolicyClient(f"ws://127.0.0.1:{port}") as client,
        LiberoSim(
            sys.executable, packb, unpackb, SUITE, TASK_ID, resolution=RESOLUTION, seed=SEED
        ) as sim,
    ):

        def infer(img: np.ndarray, wrist: np.ndarray, state: np.ndarray, prompt: str):
            return client.infer({"main": img, "wrist": wrist}, state, prompt)[0]

        episodes = [
            run_episode(sim, e, sim.instruction, resize_with_pad, infer, MAX_STEPS)
            for e in range(EPISODES)
        ]
        return sim.instruction, episodes


def test_openpi_libero_loop_matches_the_native_client(tmp_path: Path) -> None:
    start = time.perf_counter()
    openpi_server = ServeProcess(*POLICY, "server.protocol=openpi", "server.openpi_layout=libero")
    native_server = ServeProcess(*POLICY)
    try:
        openpi_port, native_port = openpi_server.wait_port(), native_server.wait_port()
        # the openpi loop in .venv-openpi and the native loop here run at the same time
        with open(tmp_path / "check.log", "w") as log:  # the child keeps its own descriptor
            check = subprocess.Popen(
                [
                    str(OPENPI_PYTHON),
                    str(CHECK),
                    "--port",
                    str(openpi_port),
                    "--sim-python",
                    sys.executable,
                    "--suite",
                    SUITE,
                    "--task-id",
                    str(TASK_ID),
                    "--episodes",
                    str(EPISODES),
                    "--max-steps",
                    str(MAX_STEPS),
                    "--out",
                    str(tmp_path),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )
        try:
            prompt, native = native_episodes(native_port)
            check.wait(timeout=300)
        finally:
            if check.poll() is None:
                check.kill()
                check.wait()
        output = (tmp_path / "check.log").read_text()
        assert check.returncode == 0, f"openpi LIBERO loop failed:\n{output}"
    finally:
        openpi_server.stop()
        native_server.stop()
    summary = json.loads(output.strip().splitlines()[-1])
    assert summary["prompt"] == prompt
    assert prompt.startswith("pick up the black bowl"), prompt
    outcomes = [{"success": e["success"], "steps": e["steps"]} for e in native]
    assert summary["episodes"] == outcomes
    # the tiny random policy fails: each episode runs its MAX_STEPS policy steps
    assert outcomes == [{"success": False, "steps": MAX_STEPS}] * EPISODES

    data = np.load(tmp_path / "episodes.npz")
    queries = -(-MAX_STEPS // REPLAN_STEPS)
    for e, ours in enumerate(native):
        theirs = {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(f"{e}/")}
        assert theirs["images"].shape == (queries, 224, 224, 3)
        assert theirs["chunks"].shape == (queries, 8, 7)
        for q in range(queries):  # in order, so a failure names the first divergence
            where = f"episode {e}, query {q}"
            # openpi's image_tools and PIL here give the same pixels; the same state
            for key in ("images", "wrist_images"):
                np.testing.assert_array_equal(theirs[key][q], ours[key][q], err_msg=where)
            np.testing.assert_allclose(
                theirs["states"][q], ours["states"][q], rtol=0, atol=1e-12, err_msg=where
            )
            # the same chunk through both protocols
            np.testing.assert_allclose(
                theirs["chunks"][q], ours["chunks"][q], rtol=0, atol=1e-6, err_msg=where
            )
        # executed alike: the first REPLAN_STEPS of each chunk, the same simulator states
        np.testing.assert_allclose(theirs["actions"], ours["actions"], rtol=0, atol=1e-6)
        planned = ours["chunks"][:, :REPLAN_STEPS].reshape(-1, 7)[:MAX_STEPS]
        np.testing.assert_array_equal(ours["actions"], planned.astype(np.float64))
        np.testing.assert_allclose(theirs["sim_states"], ours["sim_states"], rtol=0, atol=1e-9)
        # not vacuous: the policy's actions vary and the arm moved
        assert np.ptp(ours["actions"][:, :6], axis=0).min() > 0
        assert np.abs(ours["states"][-1, :3] - ours["states"][0, :3]).max() > 1e-3
    # the two episodes start from different init states
    assert not np.allclose(native[0]["states"][0], native[1]["states"][0])
    print(f"{EPISODES} episodes of {MAX_STEPS} steps each way: {time.perf_counter() - start:.0f} s")
