"""Run PyPI's openpi-client, unmodified, against a running ``rlinf-vla serve
server.protocol=openpi`` (run in .venv-openpi by tests/interop/test_openpi_client.py; it starts
nothing itself)::

    .venv-openpi/bin/python tests/interop/openpi_client_check.py --port 8000 --api-key KEY --out DIR

Checks, each raising AssertionError on failure: the metadata arrives; LIBERO-layout
observations (HWC and channels-first images, float64 state, as openpi's LIBERO example sends)
come back as ``{"actions": [K, A]}``; a bad observation makes ``infer`` raise; the server then
serves a new client; a wrong API key is refused. Writes ``DIR/exchanges.npz`` (the observations
and the actions received) and prints a JSON summary on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from openpi_client import websocket_client_policy


def libero_observation(rng: np.random.RandomState, size: int, channels_first: bool) -> dict:
    shape = (3, size, size) if channels_first else (size, size, 3)
    return {
        "observation/image": rng.randint(0, 256, shape).astype(np.uint8),
        "observation/wrist_image": rng.randint(0, 256, shape).astype(np.uint8),
        "observation/state": rng.uniform(-1, 1, 8),
        "prompt": "pick up the black bowl and place it on the plate",
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    summary: dict = {}

    client = websocket_client_policy.WebsocketClientPolicy(args.host, args.port, args.api_key)
    meta = client.get_server_metadata()
    assert isinstance(meta, dict), meta
    chunk, action_dim = meta["chunk_size"], meta["action_dim"]
    summary["metadata"] = {k: meta[k] for k in ("protocol", "policy", "chunk_size", "action_dim")}

    rng = np.random.RandomState(0)
    saved: dict[str, np.ndarray] = {}
    for i, channels_first in enumerate((False, True)):
        obs = libero_observation(rng, 32, channels_first)
        result = client.infer(obs)
        actions = result["actions"]
        assert isinstance(actions, np.ndarray), type(actions)
        assert actions.shape == (chunk, action_dim), actions.shape
        assert actions.dtype.kind == "f" and np.isfinite(actions).all()
        assert "server_timing" in result, sorted(result)
        for key, value in obs.items():
            saved[f"{i}/{key}"] = np.asarray(value)
        saved[f"{i}/actions"] = actions
    summary["infer"] = {"shape": list(actions.shape), "dtype": str(actions.dtype)}

    bad = libero_observation(rng, 32, False)
    bad["observation/state"] = np.zeros(5)
    try:
        client.infer(bad)
    except RuntimeError as e:
        summary["bad_observation_error"] = str(e)
    else:
        raise AssertionError("a 5-value state was answered instead of raising")

    again = websocket_client_policy.WebsocketClientPolicy(args.host, args.port, args.api_key)
    assert again.infer(libero_observation(rng, 32, False))["actions"].shape == (chunk, action_dim)
    summary["new_client_after_error"] = "ok"

    if args.api_key:  # last: a failed key throttles this address for a while
        try:
            websocket_client_policy.WebsocketClientPolicy(args.host, args.port, "wrong-key-0000")
        except Exception as e:
            summary["wrong_key_error"] = f"{type(e).__name__}: {e}"
        else:
            raise AssertionError("a wrong API key was accepted")

    args.out.mkdir(parents=True, exist_ok=True)
    np.savez(args.out / "exchanges.npz", **saved)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
