"""A local Ray instance started by ``Cluster``: token authentication on, without Ray's notice."""

import json
import os
import subprocess
import sys

import pytest

CODE = """
import os
from rlinf_vla.runtime import Cluster, Worker, WorkerGroup

class Env(Worker):
    def mode(self):
        return os.environ.get("RAY_AUTH_MODE")

with Cluster(num_cpus=1) as cluster:
    group = WorkerGroup(cluster, Env, "env", devices=[0])
    print("driver", os.environ.get("RAY_AUTH_MODE"), "worker", group.mode().wait()[0])
"""


#: Another Ray instance on the same machine, started as ``ray start`` starts one (it records
#: its address for drivers to find), up until its stdin closes.
BYSTANDER = """
import sys
from ray.cluster_utils import Cluster
head = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
print("up", flush=True)
sys.stdin.read()
head.shutdown()
"""


def test_a_new_local_instance_uses_token_auth_without_the_warning():
    """... and is the run's own although another Ray instance runs on the machine (``ray.init()``
    without an address would join the one ``ray start`` recorded, and refuse the CPU count)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    other = subprocess.Popen(
        [sys.executable, "-c", BYSTANDER],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert other.stdout.readline().strip() == "up"
        out = subprocess.run(
            [sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=180
        )
    finally:
        other.stdin.close()
        other.wait(timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "driver token worker token" in out.stdout
    assert "Token authentication is" not in out.stderr
    assert "Connecting to existing Ray cluster" not in out.stderr


def test_ray_failing_to_start_is_one_line_with_what_to_try(monkeypatch, capsys, tmp_path):
    import ray

    from rlinf_vla import cli

    def times_out(**kwargs):  # what Ray raises when its raylet does not register in 30 s
        raise Exception(
            "The current node timed out during startup. This could happen because some of "
            "the raylet failed to startup or the GCS has become overloaded."
        )

    monkeypatch.setattr(ray, "init", times_out)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    code = cli.main(["train", "env=toy", f"runner.output_dir={tmp_path / 'run'}"])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "rlinf-vla train: RunAborted: a local Ray instance did not start (Exception: The current "
        "node timed out during startup. This could happen because some of the raylet failed to "
        "startup or the GCS has become overloaded.); Ray gives its processes 30 s to start: on a "
        "loaded machine try again, and stop stale Ray processes (`ray stop`)"
    ]


PRIORITIES = """
import json, os, subprocess, sys
from rlinf_vla.runtime import Cluster, ClusterConfig, Worker, WorkerGroup
from rlinf_vla.runtime.cluster import LEAN_RAY_ENV
from rlinf_vla.runtime.reaper import node_pids

def comm(pid):
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()

def threads_nice(pid):
    return sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")})

class Env(Worker):
    def priorities(self):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            return os.getpriority(os.PRIO_PROCESS, os.getpid()), threads_nice(child.pid)
        finally:
            child.kill()

with Cluster(ClusterConfig(num_cpus=1, lean=sys.argv[1] == "1")) as cluster:
    group = WorkerGroup(cluster, Env, "env", devices=[0])
    worker, simulator = group.priorities().wait()[0]
    daemons = {comm(pid): threads_nice(pid) for pid in node_pids()}
    idle = [p for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{p}/cmdline")
            and open(f"/proc/{p}/cmdline", "rb").read().startswith(b"ray::IDLE")]
    print(json.dumps({
        "driver": os.getpriority(os.PRIO_PROCESS, os.getpid()), "worker": worker,
        "simulator": simulator, "daemons": daemons, "idle_workers": len(idle),
        "env_left": [k for k in LEAN_RAY_ENV if k in os.environ],
    }))
"""


def _priorities(lean: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") or k == "RAY_AUTH_MODE"}
    out = subprocess.run(
        [sys.executable, "-c", PRIORITIES, "1" if lean else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU priorities via /proc")
def test_a_lean_instance_gives_the_cores_to_the_workers_and_their_simulators_first():
    """``cluster.lean`` (the default): a worker and the simulator process it starts at the
    driver's niceness, Ray's daemons but the raylet at 19 in every thread, no idle worker
    started ahead of demand, and the driver's environment as it was. Without it, Ray's own
    defaults: the worker's main thread (and so its simulators) at niceness 15, below daemons
    that run at the driver's."""
    lean, plain = _priorities(True), _priorities(False)
    base = lean["driver"]
    assert lean["worker"] == base and lean["simulator"] == [base]
    assert lean["daemons"]["raylet"] == [base]
    assert lean["daemons"]["gcs_server"] == [19]
    others = {k: v for k, v in lean["daemons"].items() if k not in ("raylet", "gcs_server")}
    assert others and all(v == [19] for v in others.values()), lean["daemons"]
    assert lean["idle_workers"] == 0
    assert lean["env_left"] == []

    assert plain["worker"] == min(base + 15, 19) and plain["simulator"] == [min(base + 15, 19)]
    assert all(v == [plain["driver"]] for v in plain["daemons"].values()), plain["daemons"]
