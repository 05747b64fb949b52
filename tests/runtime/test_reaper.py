"""A driver killed outright leaves no Ray process behind (the watcher of runtime.reaper)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the watcher reads /proc (Linux)"
)

#: A driver that starts a local Ray instance with a worker, prints the process ids of Ray's
#: processes and their descendants (the agents the raylet starts among them), then waits.
_DRIVER = textwrap.dedent(
    """
    import os, time
    import ray
    from rlinf_vla.runtime import Cluster
    from rlinf_vla.runtime.reaper import node_pids

    cluster = Cluster(num_cpus=1)

    @ray.remote(num_cpus=0)
    def ping():
        return os.getpid()

    worker = ray.get(ping.remote())

    def children():
        out = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    stat = open(f"/proc/{d}/stat").read()
                except OSError:
                    continue
                out.setdefault(int(stat.rsplit(") ", 1)[1].split()[1]), []).append(int(d))
        return out

    time.sleep(3)  # the raylet's agents are up
    kids, stack, seen = children(), list(node_pids()), set()
    while stack:
        p = stack.pop()
        if p not in seen:
            seen.add(p)
            stack.extend(kids.get(p, []))
    print("pids", *sorted(seen | {worker}), flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def test_a_killed_driver_leaves_no_ray_process(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = driver.stdout.readline()
        assert line.startswith("pids "), line
        pids = [int(p) for p in line.split()[1:]]
        names = {}
        for pid in pids:
            with contextlib.suppress(OSError):
                names[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()[:60]
        # the raylet's agents, which outlived a killed driver before
        assert any(b"DashboardAgent" in n or b"RuntimeEnvAgent" in n for n in names.values())
        assert all(_alive(p) for p in pids if p in names)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.5)
        left = {p: names.get(p) for p in pids if _alive(p)}
        assert not left, f"still running 20 s after the driver was killed: {left}"
    finally:
        if driver.poll() is None:
            driver.kill()
