"""PyPI's openpi-client (in .venv-openpi, made by scripts/install_openpi_client.sh) against a
real ``rlinf-vla serve server.protocol=openpi`` process on loopback.

The client side is tests/interop/openpi_client_check.py, run with .venv-openpi's interpreter;
this side starts the server (tiny OpenVLA-OFT, a free port, an API key), runs the check and
compares the actions openpi's client received with what the native protocol returns for the
same observations from the same server.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.interop.serving import ROOT, ServeProcess

OPENPI_PYTHON = ROOT / ".venv-openpi" / "bin" / "python"
CHECK = Path(__file__).with_name("openpi_client_check.py")
KEY = "interop-key-1234"

# scripts/test.sh's openpi stage sets RLINF_REQUIRE_OPENPI=1 after installing: no silent skip.
pytestmark = pytest.mark.skipif(
    not OPENPI_PYTHON.exists() and os.environ.get("RLINF_REQUIRE_OPENPI") != "1",
    reason=f"{OPENPI_PYTHON} is missing: run scripts/install_openpi_client.sh to test against "
    "the real openpi-client",
)


@pytest.fixture(scope="module")
def serve_openpi():
    """``rlinf-vla serve server.protocol=openpi`` in a subprocess; yields its port."""
    server = ServeProcess(
        "policy=openvla_oft",
        "policy.preset=tiny",
        "policy.seed=0",
        "server.protocol=openpi",
        "server.openpi_layout=libero",
        f"server.token={KEY}",
        "server.auth_failure_delay_s=0",  # the check's wrong key must not lock out the rest
    )
    try:
        yield server.wait_port(), server.lines
    finally:
        server.stop()


def test_stock_openpi_client_against_rlinf_vla_serve(serve_openpi, tmp_path):
    port, _ = serve_openpi
    start = time.perf_counter()
    run = subprocess.run(
        [
            str(OPENPI_PYTHON),
            str(CHECK),
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 0, f"openpi client check failed:\n{run.stdout}\n{run.stderr}"
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["metadata"] == {
        "protocol": "openpi",
        "policy": "openvla_oft",
        "chunk_size": 8,
        "action_dim": 7,
    }
    assert summary["infer"] == {"shape": [8, 7], "dtype": "float32"}
    # openpi's client raised, showing the server's reason (and the layout's mapping)
    err = summary["bad_observation_error"]
    assert "Error in inference server" in err and "obs.state has 5 values" in err, err
    assert "observation/state -> state" in err
    assert summary["new_client_after_error"] == "ok"
    assert "401" in summary["wrong_key_error"], summary["wrong_key_error"]
    assert time.perf_counter() - start < 120

    # What openpi's client received equals the policy's own greedy answer (the server loads
    # the tiny OpenVLA-OFT with seed 0; channels-first images were transposed by the server).
    import torch

    from rlinf_vla.policies import make_policy
    from rlinf_vla.types import Observation

    policy = make_policy("openvla_oft", preset="tiny", seed=0).eval()
    data = np.load(tmp_path / "exchanges.npz")
    for i in range(2):
        images = {}
        for ours, theirs in (("main", "observation/image"), ("wrist", "observation/wrist_image")):
            img = data[f"{i}/{theirs}"]
            images[ours] = torch.from_numpy(
                np.ascontiguousarray(img.transpose(1, 2, 0) if img.shape[0] == 3 else img)
            )[None]
        obs = Observation(
            images=images,
            state=torch.from_numpy(data[f"{i}/observation/state"].astype(np.float32))[None],
            instruction=[str(data[f"{i}/prompt"])],
        )
        with torch.inference_mode():
            want = policy.act(obs, greedy=True).actions[0].float().numpy()
        np.testing.assert_allclose(data[f"{i}/actions"], want, atol=1e-5)
