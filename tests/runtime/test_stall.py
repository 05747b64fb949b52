"""Call deadlines: a worker that stops answering is named, with its process, instead of a hang."""

import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from rlinf_vla.config import ConfigError
from rlinf_vla.runtime import Worker, WorkerGroup, WorkerStalled, wait_all
from rlinf_vla.runtime.cluster import ClusterConfig
from rlinf_vla.runtime.stall import Process, StallPolicy


class Sleeper(Worker):
    def __init__(self, start_s: float = 0.0):
        time.sleep(start_s)

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def pid(self) -> int:
        return os.getpid()


def test_a_call_past_its_measured_deadline_is_stalled_and_a_first_call_has_none(cluster):
    cluster.stall = StallPolicy(factor=2, min_s=0.5)
    group = WorkerGroup(cluster, Sleeper, "sleeper", devices=[0])
    try:
        assert group.sleep(1.5).wait() == [1.5]  # the first call sets the scale: no deadline
        assert group.sleep(0.1).wait() == [0.1]  # within 2 x 1.5 s
        start = time.monotonic()
        with pytest.raises(WorkerStalled) as caught:
            group.sleep(30).wait()
        seconds = time.monotonic() - start
    finally:
        group.shutdown()
    error = caught.value
    assert (error.group, error.rank, error.method) == ("sleeper", 0, "sleep")
    assert error.waiting == ["sleeper[0].sleep"]
    pid = group.process(0).pid
    assert f"sleeper[0].sleep() (pid {pid} on {socket.gethostname()})" in str(error)
    # The first call's time as the driver saw it: 1.5 s and the call's overhead.
    longest = re.search(
        r"2 x the longest earlier sleep\(\) \(([\d.]+) s\), at least 0.5 s", str(error)
    )
    assert longest and 1.5 <= float(longest.group(1)) < 5, str(error)
    assert error.limit_s == pytest.approx(2 * float(longest.group(1)), abs=0.15)
    assert error.waited_s >= error.limit_s and seconds < error.limit_s + 3, seconds
    assert "cluster.stall_factor, cluster.stall_min_s" in str(error)


def test_a_stopped_worker_is_named_first_and_killed_at_shutdown(cluster):
    cluster.stall = StallPolicy(factor=3, min_s=2)
    group = WorkerGroup(cluster, Sleeper, "sleeper", devices=[0, 0])
    pids = group.pid().wait()
    assert [group.process(r).pid for r in (0, 1)] == pids
    try:
        group.sleep(0.1).wait()
        os.kill(pids[1], signal.SIGSTOP)
        calls = [group.sleep(0.1, ranks=[1]), group.sleep(60, ranks=[0])]
        with pytest.raises(WorkerStalled) as caught:
            wait_all(calls)
    finally:
        group.shutdown()
    error = caught.value
    # Both calls are late; the stopped process comes first, the other is named too.
    assert (error.group, error.rank) == ("sleeper", 1)
    assert error.waiting == ["sleeper[1].sleep", "sleeper[0].sleep"]
    lines = str(error).splitlines()
    assert f"sleeper[1].sleep() (pid {pids[1]} on " in lines[1]
    assert "the process is stopped (SIGSTOP" in lines[1]
    assert f"sleeper[0].sleep() (pid {pids[0]} on " in lines[2]
    assert "stopped" not in lines[2]
    # Ray cannot kill a stopped process by asking it: shutdown() sends it SIGKILL.
    deadline = time.monotonic() + 10
    while "stopped" in (Process(pids[1], socket.gethostname()).state() or ""):
        assert time.monotonic() < deadline, "the stopped worker was left behind"
        time.sleep(0.1)
    # A stalled error crosses processes intact.
    again = pickle.loads(pickle.dumps(error))
    assert (again.group, again.rank, again.waiting, str(again)) == (
        error.group,
        error.rank,
        error.waiting,
        str(error),
    )


def test_a_worker_slower_to_start_than_the_start_timeout_is_named(cluster):
    cluster.stall = StallPolicy(start_timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(WorkerStalled) as caught:
        WorkerGroup(cluster, Sleeper, "slow_start", devices=[0], args=(60,))
    assert time.monotonic() - start < 30
    error = caught.value
    assert (error.group, error.method) == ("slow_start", "__init__")
    assert "slow_start[0].__init__()" in str(error)
    assert "cluster.start_timeout_s" in str(error)


def test_deadlines_follow_the_config():
    policy = StallPolicy(factor=5, min_s=120)
    assert policy.limit(None) is None  # nothing measured yet
    assert policy.limit(1.0) == 120
    assert policy.limit(60.0) == 300
    assert StallPolicy(factor=None).limit(60.0) is None
    config = ClusterConfig()
    assert (config.stall_factor, config.stall_min_s, config.start_timeout_s) == (5.0, 120.0, 600.0)


@pytest.mark.parametrize(
    "values, key",
    [
        ({"stall_factor": 0.5}, "cluster.stall_factor must be >= 1"),
        ({"stall_min_s": 0}, "cluster.stall_min_s must be > 0"),
        ({"start_timeout_s": -1}, "cluster.start_timeout_s must be > 0"),
    ],
)
def test_bad_deadline_settings_are_refused_naming_the_key(values, key):
    with pytest.raises(ConfigError, match=key):
        ClusterConfig(**values)


def test_the_process_state_names_a_stopped_subprocess():
    me = Process.this()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert me.state() is None and me.stopped_pids() == []
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while me.state() is None:
            assert time.monotonic() < deadline, "the stopped subprocess is not seen"
            time.sleep(0.05)
        assert me.state() == (
            f"its subprocess {child.pid} is stopped (SIGSTOP / SIGTSTP; SIGCONT resumes it)"
        )
        assert me.stopped_pids() == [child.pid]
        assert Process(child.pid, me.host).state().startswith("the process is stopped")
        assert Process(child.pid, "another-host").state() is None  # /proc is this host's
    finally:
        child.kill()
        child.wait()
    assert Process(child.pid, me.host).state() == "the process is gone"
