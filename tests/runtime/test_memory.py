"""Worker memory: resident RAM of a process tree, peak GPU memory, the memory/* metrics."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlinf_vla.runtime import Worker, WorkerGroup
from rlinf_vla.runtime.memory import group_memory_metrics, process_tree_rss

linux = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc")


def _status_gib(pid: int, field: str = "VmRSS") -> float:
    """A kB field of /proc/<pid>/status (VmRSS: resident pages; RssAnon: the anonymous ones
    among them, private to a process that did not fork)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 2**20
    raise AssertionError(f"no {field} line")


def _vm_rss_gib(pid: int) -> float:
    return _status_gib(pid, "VmRSS")


def _between_private_and_resident(value: float, pid: int) -> bool:
    """A process's share of its resident pages lies between its private anonymous memory
    and all of its resident pages (shared library pages counting whole)."""
    return _status_gib(pid, "RssAnon") * 0.99 <= value <= _vm_rss_gib(pid) * 1.01


@linux
def test_the_tree_of_a_childless_process_is_its_own_resident_memory():
    code = "import time; x = b'\\x01' * (200 * 2**20); print('ready', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        tree = process_tree_rss(child.pid)
        assert tree > 200 / 1024
        assert _between_private_and_resident(tree, child.pid)
    finally:
        child.kill()


@linux
def test_pages_a_forked_child_shares_count_once():
    """After a fork, parent and child share the parent's 300 MiB copy-on-write: each one's
    resident set holds it, the tree counts it once."""
    code = (
        "import os, time; x = b'\\x01' * (300 * 2**20); pid = os.fork()\n"
        "if pid:\n    print(pid, flush=True)\n"
        "time.sleep(30)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        time.sleep(0.2)
        each = _vm_rss_gib(parent.pid), _vm_rss_gib(child)
        assert min(each) > 300 / 1024  # both resident sets hold the buffer
        tree = process_tree_rss(parent.pid)
        assert 300 / 1024 < tree < sum(each) - 250 / 1024
    finally:
        parent.kill()
        os.kill(child, signal.SIGKILL)


@linux
def test_the_memory_of_subprocesses_counts_towards_their_parent():
    """A bare interpreter starts a subprocess that holds 300 MiB: the parent's own resident
    set stays small, its tree holds the 300 MiB. (A parent of its own, not this test process,
    whose other children and heap move while the test runs.)"""
    holder = "import time; x = b'\\x01' * (300 * 2**20); print('ready', flush=True); time.sleep(30)"
    code = (
        "import subprocess, sys, time\n"
        f"c = subprocess.Popen([sys.executable, '-c', {holder!r}], stdout=subprocess.PIPE, text=True)\n"
        "assert c.stdout.readline().strip() == 'ready'\n"
        "print(c.pid, flush=True); time.sleep(30)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert _vm_rss_gib(parent.pid) < 100 / 1024
        assert _vm_rss_gib(child) > 300 / 1024  # the 300 MiB it wrote, and the interpreter
        own = process_tree_rss(parent.pid) - process_tree_rss(child)
        assert 0 < own < 100 / 1024  # the parent's share of its own pages
        assert process_tree_rss(parent.pid) > 300 / 1024
    finally:
        parent.kill()
        os.kill(child, signal.SIGKILL)


@linux
def test_a_workers_resident_memory_is_read_again_only_after_the_refresh_time(monkeypatch):
    """Each reading walks the process tree's page tables, so a worker reuses its reading for
    ``refresh_s``; the GPU figures are not affected (none on a CPU device)."""
    from rlinf_vla.runtime import memory

    reads = []
    monkeypatch.setattr(memory, "_last_rss", [])
    monkeypatch.setattr(memory, "process_tree_rss", lambda: reads.append(1) or float(len(reads)))
    cpu = torch.device("cpu")
    assert memory.worker_memory(cpu, refresh_s=60) == {"rss": 1.0}
    assert memory.worker_memory(cpu, refresh_s=60) == {"rss": 1.0}  # reused, not read
    assert len(reads) == 1
    assert memory.worker_memory(cpu, refresh_s=0) == {"rss": 2.0}  # stale: read again
    assert len(reads) == 2


def test_the_metrics_take_the_largest_value_of_each_groups_ranks_and_the_sum_of_all():
    groups = {
        "env": [{"rss": 1.0}, {"rss": 3.0}],
        "actor": [{"rss": 2.0, "gpu_peak": 5.0}, {"rss": 2.5, "gpu_peak": 4.0}],
    }
    assert group_memory_metrics(groups) == {
        "memory/env_rss_gib": 3.0,
        "memory/actor_gpu_peak_gib": 5.0,
        "memory/actor_rss_gib": 2.5,
        "memory/total_rss_gib": 8.5,  # 1 + 3 + 2 + 2.5
    }


def test_a_process_that_several_ranks_share_counts_once_in_the_total():
    """``placement=local``: every group's ranks live in one process and share its reading; two
    processes that happen to read the same amount are still two."""
    shared = {"rss": 4.0}
    groups = {"env": [shared], "rollout": [shared], "actor": [shared, {"rss": 4.0}]}
    metrics = group_memory_metrics(groups)
    assert metrics["memory/total_rss_gib"] == 8.0
    assert metrics["memory/env_rss_gib"] == metrics["memory/actor_rss_gib"] == 4.0
    assert "memory/total_rss_gib" not in group_memory_metrics({"actor": [{"gpu": 1.0}]})


class Holder(Worker):
    def __init__(self):
        self.held = None

    def hold(self, mib):
        self.held = torch.ones(mib * 2**18, device=self.device)  # float32: 4 bytes each
        return os.getpid()

    def drop(self):
        self.held = None


@linux
def test_a_worker_reports_its_resident_memory(cluster):
    group = WorkerGroup(cluster, Holder, "holder", devices=[0])
    try:
        [pid] = group.hold(256).wait()
        [memory] = group.memory().wait()
        assert _between_private_and_resident(memory["rss"], pid)
        assert memory["rss"] > 0.25
        if cluster.devices[0].kind == "cpu":
            assert "gpu_peak" not in memory
    finally:
        group.shutdown()


@pytest.mark.gpu
def test_a_gpu_worker_reports_its_peak_since_the_last_call(cluster):
    if cluster.devices[0].kind != "cuda":
        pytest.skip("the cluster has no GPU device")
    group = WorkerGroup(cluster, Holder, "gpu-holder", devices=[0])
    try:
        group.hold(512).wait()
        [held] = group.memory().wait()
        assert held["gpu"] == pytest.approx(0.5, abs=0.01)
        group.drop().wait()
        group.hold(256).wait()
        [first] = group.memory().wait()
        assert first["gpu"] == pytest.approx(0.25, abs=0.01)  # the 512 MiB were freed
        assert first["gpu_peak"] == pytest.approx(0.5, abs=0.01)  # but they were the peak
        group.drop().wait()
        [second] = group.memory().wait()
        # the previous call reset the peak to the 256 MiB then held; now nothing is
        assert second["gpu_peak"] == pytest.approx(0.25, abs=0.01)
        assert second["gpu"] < 0.01
    finally:
        group.shutdown()


def test_a_dead_workers_error_gets_its_last_memory_reading():
    from rlinf_vla.runtime import WorkerError
    from rlinf_vla.runtime.memory import with_memory_hint

    memory = {"actor": [{"rss": 1.0}, {"rss": 7.54, "gpu_peak": 30.0}]}
    died = WorkerError("actor", 1, "10.0.0.2", "train", "Ray: actor died (exit code 9)", died=True)
    hinted = with_memory_hint(died, memory, 3)
    assert isinstance(hinted, WorkerError) and (hinted.group, hinted.rank) == ("actor", 1)
    assert hinted.died
    assert "after iteration 3 this worker held 7.5 GiB resident, 30.0 GiB GPU peak" in str(hinted)
    assert str(hinted).startswith("worker actor[1] on node 10.0.0.2 failed in train():")
    # an exception inside a worker (whatever its text says), or a worker without a reading:
    # unchanged
    raised = WorkerError("actor", 1, "10.0.0.2", "train", "ValueError: the process died")
    assert with_memory_hint(raised, memory, 3) is raised
    env_died = WorkerError("env", 0, "10.0.0.2", "interact", "...", died=True)
    assert with_memory_hint(env_died, memory, 3) is env_died
    assert with_memory_hint(died, {}, 0) is died  # before the first iteration's reading


class CountedReadings(Worker):
    """Its ``memory`` answers the process id, how many readings the workers of this class in
    this process have made, and how many this worker has."""

    readings = 0

    def __init__(self):
        self.calls = 0

    def memory(self):
        CountedReadings.readings += 1
        self.calls += 1
        return {"pid": os.getpid(), "reading": CountedReadings.readings, "calls": self.calls}


def test_groups_that_share_a_process_read_its_memory_once():
    """placement=local: every group in one process, so one reading (a second one would reset
    the GPU peak the first reported and read the same process tree again); each rank of each
    group gets it."""
    from rlinf_vla.runtime import ClusterConfig
    from rlinf_vla.runtime.local import LocalCluster, LocalGroup
    from rlinf_vla.runtime.memory import read_memory

    cluster = LocalCluster(ClusterConfig(devices_per_node=2))
    groups = {
        name: LocalGroup(cluster, CountedReadings, name, devices)
        for name, devices in (("env", [0, 1]), ("rollout", [1]), ("actor", [0, 1]))
    }
    try:
        before = CountedReadings.readings
        memory = read_memory(groups)
        assert CountedReadings.readings == before + 1
        one = {"pid": os.getpid(), "reading": before + 1, "calls": 1}
        assert memory == {"env": [one, one], "rollout": [one], "actor": [one, one]}
        # the one reading itself, which memory/total_rss_gib then counts once
        assert len({id(r) for readings in memory.values() for r in readings}) == 1
    finally:
        for group in groups.values():
            group.shutdown()


def test_groups_in_processes_of_their_own_read_each_process(cluster):
    from rlinf_vla.runtime.memory import read_memory

    groups = {
        name: WorkerGroup(cluster, CountedReadings, f"counted-{name}", devices=[0])
        for name in ("env", "actor")
    }
    try:
        memory = read_memory(groups)
        pids = {name: [r["pid"] for r in readings] for name, readings in memory.items()}
        assert len({pids["env"][0], pids["actor"][0], os.getpid()}) == 3
        assert [r["calls"] for rs in memory.values() for r in rs] == [1, 1]  # none skipped
    finally:
        for group in groups.values():
            group.shutdown()


def test_a_worker_killed_by_rays_memory_monitor_is_named_as_such(cluster, monkeypatch):
    """Ray's memory monitor kills a process with an OutOfMemoryError from ``ray.get``, not the
    died-actor error: the driver names the worker, says what killed it and, with a reading,
    adds its last memory."""
    import ray

    from rlinf_vla.runtime import WorkerError, wait_all
    from rlinf_vla.runtime.memory import with_memory_hint

    group = WorkerGroup(cluster, Holder, "oom-holder", devices=[0])
    try:
        said = (
            "1 worker(s) were killed due to the node running low on memory. Memory on the node "
            "was 22.41GB used / 23.59GB limit (0.950238)\nTop 10 memory users: ..."
        )

        def killed(*args, **kwargs):
            raise ray.exceptions.OutOfMemoryError(said)

        call = group.hold(1)
        monkeypatch.setattr(ray, "get", killed)
        with pytest.raises(WorkerError) as raised:
            wait_all([call])
        monkeypatch.undo()
        e = raised.value
        assert (e.group, e.rank, e.method, e.died) == ("oom-holder", 0, "hold", True)
        assert str(e).startswith("worker oom-holder[0] on node")
        assert "killed for lack of memory on its node: 1 worker(s) were killed" in str(e)
        assert "22.41GB used / 23.59GB limit" in str(e) and "Top 10" not in str(e)
        hinted = with_memory_hint(e, {"oom-holder": [{"rss": 21.5}]}, 4)
        assert "after iteration 4 this worker held 21.5 GiB resident" in str(hinted)
    finally:
        group.shutdown()
