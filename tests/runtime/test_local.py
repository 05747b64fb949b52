"""The single-process executor: worker groups, channel and collective in threads, no Ray."""

import os
import threading
import time

import pytest
import torch

from rlinf_vla.config import ConfigError
from rlinf_vla.runtime import (
    ClusterConfig,
    PlacementConfig,
    Worker,
    WorkerError,
    create_collective,
    resolve_placement,
    wait_all,
)
from rlinf_vla.runtime.local import ChannelClosed, LocalChannel, LocalCluster, LocalGroup


class Echo(Worker):
    def __init__(self, factor):
        self.factor = factor
        self.log = []

    def scale(self, x):
        return self.factor * x + self.rank

    def where(self):
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "group": self.group_name,
            "device": str(self.device),
            "pid": os.getpid(),
            "thread": threading.current_thread().name,
        }

    def nap(self, seconds, tag):
        self.log.append(("start", tag))
        time.sleep(seconds)
        self.log.append(("end", tag))
        return tag

    def history(self):
        return list(self.log)

    def fail(self):
        raise ValueError(f"rank {self.rank} refuses")

    async def coroutine(self, x):
        return -x

    def take(self, channel, key):
        return channel.get(key)

    def send_weights(self, name):
        weights = {"w": torch.arange(4.0) * self.factor}
        self.collective(name).broadcast_tensors(weights, src=0)
        return weights["w"].sum().item()

    def receive_weights(self, name):
        got = self.collective(name).broadcast_tensors(None, src=0)
        return got["w"].tolist()


@pytest.fixture
def cluster():
    return LocalCluster(ClusterConfig(devices_per_node=2))


def test_the_cluster_lists_this_machines_cpu_slots(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cluster = LocalCluster(ClusterConfig(devices_per_node=2, num_cpus=4))
    assert [(d.rank, d.kind, d.threads) for d in cluster.devices] == [(0, "cpu", 2), (1, "cpu", 2)]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # caps a slot's threads, as for a Ray cluster
    cluster = LocalCluster(ClusterConfig(devices_per_node=2, num_cpus=4))
    assert [d.threads for d in cluster.devices] == [1, 1]
    with pytest.raises(ValueError, match="this machine only"):
        LocalCluster(ClusterConfig(address="auto"))


def test_calls_run_in_this_process_one_thread_per_worker(cluster):
    group = LocalGroup(cluster, Echo, "echo", [0, 1], args=(10,))
    try:
        assert group.scale(3).wait() == [30, 31]
        assert group.scale(3, ranks=[1]).wait() == [31]
        assert group.coroutine(5).wait() == [-5, -5]
        where = group.where().wait()
        assert [w["rank"] for w in where] == [0, 1]
        assert {w["world_size"] for w in where} == {2}
        assert {w["pid"] for w in where} == {os.getpid()}
        assert [w["thread"] for w in where] == ["echo[0]", "echo[1]"]
        assert {w["device"] for w in where} == {"cpu"}
    finally:
        group.shutdown()


def test_a_workers_calls_run_in_order_and_workers_run_at_once(cluster):
    group = LocalGroup(cluster, Echo, "echo", [0, 1], args=(1,))
    try:
        t0 = time.monotonic()
        first = group.nap(0.3, "a")
        second = group.nap(0.01, "b", ranks=[0])
        assert wait_all([first, second]) == [["a", "a"], ["b"]]
        elapsed = time.monotonic() - t0
        # the two workers napped at the same time: 0.3 s, not 0.6 s
        assert 0.3 <= elapsed < 0.55
        # worker 0 ran "b" only after "a" had ended
        assert group.history(ranks=[0]).wait()[0] == [
            ("start", "a"),
            ("end", "a"),
            ("start", "b"),
            ("end", "b"),
        ]
    finally:
        group.shutdown()


def test_an_exception_names_the_worker_and_carries_its_traceback(cluster):
    group = LocalGroup(cluster, Echo, "echo", [0, 1], args=(1,))
    try:
        with pytest.raises(WorkerError) as info:
            group.fail().wait()
        assert info.value.group == "echo"
        assert info.value.rank in (0, 1)
        assert info.value.method == "fail"
        assert "refuses" in info.value.remote_traceback
        assert "def fail" in info.value.remote_traceback or "in fail" in info.value.remote_traceback
        with pytest.raises(AttributeError, match="no public method 'missing'"):
            group.missing()
        with pytest.raises(ValueError, match="one call at a time"):
            LocalGroup(cluster, Echo, "many", [0], args=(1,), max_concurrency=2)
    finally:
        group.shutdown()


def test_a_failing_init_is_reported_with_the_workers_name(cluster):
    class Broken(Worker):
        def __init__(self):
            raise RuntimeError("no simulator here")

    with pytest.raises(WorkerError, match="no simulator here") as info:
        LocalGroup(cluster, Broken, "env", [0])
    assert info.value.group == "env" and info.value.method == "Broken.__init__"


def test_a_failure_surfaces_while_another_worker_waits_on_a_channel(cluster):
    """The env fails while the rollout blocks on the channel: the failure is raised (no hang),
    and closing the channel ends the blocked call."""
    channel = LocalChannel("c")
    waiter = LocalGroup(cluster, Echo, "rollout", [0], args=(1,))
    failer = LocalGroup(cluster, Echo, "env", [1], args=(1,))
    blocked = waiter.take(channel, "obs")
    with pytest.raises(WorkerError) as info:
        wait_all([blocked, failer.fail()], timeout=10)
    assert info.value.group == "env"
    channel.close()
    with pytest.raises(WorkerError, match="ChannelClosed"):
        blocked.wait(timeout=10)
    waiter.shutdown()
    failer.shutdown()


def test_the_channel_is_a_fifo_per_key_that_hands_over_the_object_itself():
    channel = LocalChannel("c")
    item = {"obs": torch.zeros(3)}
    channel.put("a", item)
    channel.put("b", 2)
    channel.put("a", 3)
    assert channel.sizes() == {"a": 2, "b": 1}
    assert channel.get("a") is item  # by reference: nothing copied
    assert channel.exchange("b", 4, "b") == 2
    assert channel.get_batch("a", 1) == [3]
    assert channel.get("b") == 4
    with pytest.raises(TimeoutError, match="nothing under key 'a'"):
        channel.get("a", timeout=0.05)
    assert channel.take_timers() == {"send_s": 0.0, "fetch_s": 0.0}


def test_a_bounded_channel_blocks_a_put_until_there_is_room():
    channel = LocalChannel("c", maxsize=1)
    channel.put("k", 1)
    with pytest.raises(TimeoutError, match="stayed full"):
        channel.put("k", 2, timeout=0.05)
    threading.Timer(0.1, channel.get, args=("k",)).start()
    channel.put("k", 3, timeout=5)  # room made by the getter
    assert channel.get("k") == 3
    with pytest.raises(ValueError, match="bounded to 1"):
        channel.get_batch("k", 2)


def test_closing_the_channel_wakes_a_waiting_get():
    channel = LocalChannel("c")
    errors = []

    def wait() -> None:
        try:
            channel.get("k")
        except ChannelClosed as e:
            errors.append(e)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.05)
    channel.close()
    thread.join(timeout=5)
    assert not thread.is_alive() and len(errors) == 1


def test_a_local_collective_broadcasts_the_sources_tensors(cluster):
    actor = LocalGroup(cluster, Echo, "actor", [0], args=(2,))
    rollout = LocalGroup(cluster, Echo, "rollout", [0, 1], args=(1,))
    try:
        create_collective("weights", [(actor, [0]), (rollout, None)])
        sent, received = wait_all(
            [actor.send_weights("weights"), rollout.receive_weights("weights")]
        )
        assert sent == [12.0]  # (0 + 1 + 2 + 3) * 2
        assert received == [[0.0, 2.0, 4.0, 6.0]] * 2
        # a second broadcast over the same collective
        _, again = wait_all([actor.send_weights("weights"), rollout.receive_weights("weights")])
        assert again == received
        with pytest.raises(WorkerError, match="not in a collective named 'other'"):
            rollout.receive_weights("other").wait()
    finally:
        actor.shutdown()
        rollout.shutdown()


def test_the_local_mode_places_every_component_on_one_device():
    ok = resolve_placement(
        PlacementConfig("local", {"actor": 0, "env": 0, "rollout": 0}), num_devices=2
    )
    assert ok.of("env") == [0] and ok.of("actor") == [0]
    for components in ({"actor": 0, "env": 1, "rollout": 0}, {"actor": "all", "env": "all"}):
        with pytest.raises(ConfigError, match="mode 'local' runs every component in one process"):
            resolve_placement(PlacementConfig("local", components), num_devices=2)


def test_simulators_started_in_the_worker_environment_get_one_sleeping_thread(monkeypatch):
    """Subprocesses inherit what a Ray worker has (one OpenMP thread, sleeping when idle);
    a variable the user set wins, and the process's environment is restored afterwards."""
    import subprocess
    import sys

    from rlinf_vla.runtime.local import worker_environment

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    child = [
        sys.executable,
        "-c",
        "import os; print(os.environ['OMP_NUM_THREADS'], os.environ['OMP_WAIT_POLICY'])",
    ]
    with worker_environment():
        seen = subprocess.run(child, capture_output=True, text=True, check=True).stdout.split()
    assert seen == ["1", "ACTIVE"]
    assert "OMP_NUM_THREADS" not in os.environ and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
