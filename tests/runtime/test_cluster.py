"""A local Ray instance started by ``Cluster``: token authentication on, without Ray's notice."""

import os
import subprocess
import sys

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
