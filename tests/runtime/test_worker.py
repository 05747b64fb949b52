import os
import pickle
import time

import pytest

from rlinf_vla.runtime import (
    Channel,
    Worker,
    WorkerError,
    WorkerGroup,
    split_evenly,
    wait_all,
    wait_started,
)


class Scaler(Worker):
    def __init__(self, factor):
        self.factor = factor
        self.calls = 0

    def scale(self, x):
        self.calls += 1
        return self.factor * x + self.rank

    def context(self):
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "group": self.group_name,
            "node_id": self.node_id,
            "device": str(self.device),
            "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "env_rank": os.environ.get("RLINF_VLA_RANK"),
            "omp_wait": os.environ.get("OMP_WAIT_POLICY"),
            "pid": os.getpid(),
        }

    def count(self):
        return self.calls

    def threads(self):
        import torch

        return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")

    async def async_scale(self, x):
        return self.factor * x

    def fail(self, message):
        if self.rank == 1:
            raise ValueError(message)
        return "ok"

    def weigh(self, xs, ys, offset):
        return [(self.rank, x * y + offset) for x, y in zip(xs, ys, strict=True)]

    def die(self):
        os._exit(3)

    def sleep(self, seconds):
        time.sleep(seconds)
        return seconds

    def wait_on(self, channel):
        return channel.get("never")


class BrokenInit(Worker):
    def __init__(self):
        if self.rank == 0:
            raise RuntimeError("no simulator here")

    def ping(self):
        return "pong"


def test_group_calls_return_futures_in_rank_order(cluster):
    group = WorkerGroup(cluster, Scaler, "scaler", devices=[0, 1, 1], args=(10,))
    try:
        result = group.scale(2)
        assert result.wait() == [20, 21, 22]
        assert result.done()
        assert group.scale(1, ranks=[2, 0]).wait() == [12, 10]
        assert group.call("scale", x=3).wait() == [30, 31, 32]
        # ranks 0 and 2 were called three times, rank 1 twice: state lives in each worker.
        assert group.count().wait() == [3, 2, 3]
        assert group.async_scale(4).wait() == [40, 40, 40]
    finally:
        group.shutdown()


def test_workers_know_their_place(cluster):
    group = WorkerGroup(cluster, Scaler, "ctx", devices=[0, 1], args=(1,))
    try:
        contexts = group.context().wait()
    finally:
        group.shutdown()
    assert [c["rank"] for c in contexts] == [0, 1]
    assert {c["world_size"] for c in contexts} == {2}
    assert {c["group"] for c in contexts} == {"ctx"}
    assert [c["env_rank"] for c in contexts] == ["0", "1"]
    assert contexts[0]["node_id"] == cluster.devices[0].node_id
    assert {c["device"] for c in contexts} == {"cpu"}
    # CPU devices: the runtime leaves GPU visibility alone (there is no GPU on such a node).
    assert {c["cuda_visible"] for c in contexts} == {os.environ.get("CUDA_VISIBLE_DEVICES")}
    assert contexts[0]["pid"] != contexts[1]["pid"] != os.getpid()
    # OpenMP threads sleep between parallel regions: workers sharing cores do not starve.
    assert {c["omp_wait"] for c in contexts} == {os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def test_the_callers_openmp_wait_policy_wins(cluster, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    group = WorkerGroup(cluster, Scaler, "omp", devices=[0], args=(1,))
    try:
        [context] = group.context().wait()
    finally:
        group.shutdown()
    assert context["omp_wait"] == "ACTIVE"


@pytest.mark.parametrize(
    ("slots", "omp", "threads"), [(None, None, 1), (2, None, 1), (1, None, 2), (1, "1", 1)]
)
def test_a_cpu_worker_computes_with_its_slots_share_of_the_cores(
    cluster, monkeypatch, slots, omp, threads
):
    """The shared Ray instance has 2 CPUs: one slot per core (the default) or 2 slots give one
    thread each; a single slot holds both cores, unless ``OMP_NUM_THREADS`` where the cluster is
    made asks for fewer."""
    from rlinf_vla.runtime import Cluster, ClusterConfig

    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    on_ray = Cluster(ClusterConfig(devices_per_node=slots))  # uses the running instance
    assert [d.threads for d in on_ray.devices] == [threads] * (slots or 2)
    group = WorkerGroup(on_ray, Scaler, "threads", devices=[0], args=(1,))
    try:
        [(torch_threads, omp)] = group.threads().wait()
    finally:
        group.shutdown()
    assert torch_threads == threads
    assert omp == "1"  # what subprocesses of the worker inherit


def test_unknown_method_and_bad_ranks(cluster):
    group = WorkerGroup(cluster, Scaler, "bad-calls", devices=[0], args=(1,))
    try:
        with pytest.raises(AttributeError, match="Scaler has no public method 'scael'"):
            group.scael(1)
        with pytest.raises(IndexError, match="ranks 0-0, not \\[3\\]"):
            group.scale(1, ranks=[3])
    finally:
        group.shutdown()


def test_worker_exception_surfaces_with_group_rank_node_and_traceback(cluster):
    group = WorkerGroup(cluster, Scaler, "failing", devices=[0, 1], args=(1,))
    try:
        with pytest.raises(WorkerError) as info:
            group.fail("the gripper is on fire").wait()
    finally:
        group.shutdown()
    err = info.value
    assert (err.group, err.rank, err.method) == ("failing", 1, "fail")
    assert err.node == cluster.devices[1].node_ip
    assert "ValueError: the gripper is on fire" in err.remote_traceback
    assert "in fail" in err.remote_traceback  # the user's frame is in the traceback
    assert "worker failing[1] on node" in str(err)
    assert not err.died  # it raised; its process lives on


def test_constructor_failure_is_reported(cluster):
    with pytest.raises(WorkerError) as info:
        WorkerGroup(cluster, BrokenInit, "broken", devices=[0, 1])
    assert info.value.rank == 0
    assert info.value.method == "BrokenInit.__init__"
    assert "RuntimeError: no simulator here" in info.value.remote_traceback


class Knock(Worker):
    """Leaves a file, for :class:`AwaitKnock`."""

    def __init__(self, path):
        # Written aside, then renamed: the waiter must never see the file before its text.
        with open(path + ".part", "w") as f:
            f.write(f"knock from rank {self.rank}")
        os.replace(path + ".part", path)

    def pid(self):
        return os.getpid()


class AwaitKnock(Worker):
    """Starts only once a :class:`Knock` worker has started: its ``__init__`` fails unless the
    file appears within ``patience`` seconds."""

    def __init__(self, path, patience):
        deadline = time.monotonic() + patience
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"nobody knocked within {patience} s")
            time.sleep(0.05)
        with open(path) as f:
            self.heard = f.read()

    def heard_knock(self):
        return self.heard


def test_groups_launched_without_waiting_start_together(cluster, tmp_path):
    knock = str(tmp_path / "knock")
    # Waiting for the first group's start before launching the second would fail it: its
    # __init__ waits for the second group's.
    waiter = WorkerGroup(cluster, AwaitKnock, "waiter", [0], args=(knock, 60), wait=False)
    knocker = WorkerGroup(cluster, Knock, "knocker", [1], args=(knock,), wait=False)
    try:
        wait_started([waiter, knocker])
        assert waiter.heard_knock().wait() == ["knock from rank 0"]
    finally:
        waiter.shutdown()
        knocker.shutdown()


def test_a_call_on_a_group_that_was_not_waited_for_reports_its_failed_start(cluster):
    broken = WorkerGroup(cluster, BrokenInit, "broken-lazy", [0, 1], wait=False)
    with pytest.raises(WorkerError) as info:
        broken.ping()
    # the start's failure, not the call's (which would find no worker object)
    assert (info.value.method, info.value.rank) == ("BrokenInit.__init__", 0)


def test_a_failed_start_shuts_down_every_group_started_with_it(cluster, tmp_path):
    import ray

    fine = WorkerGroup(cluster, Knock, "fine", [0], args=(str(tmp_path / "k"),), wait=False)
    handle = fine.actor(0)  # waits for its start: the worker is up
    broken = WorkerGroup(cluster, BrokenInit, "broken-together", [1, 0], wait=False)
    with pytest.raises(WorkerError) as info:
        wait_started([fine, broken])
    assert (info.value.group, info.value.rank) == ("broken-together", 0)
    # Ray's kill is asynchronous: a call sent just after it may still be served, so keep
    # calling until the worker is gone (it never is if the group was left running).
    deadline = time.monotonic() + 60
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(handle.free_port.remote(), timeout=60)
            time.sleep(0.2)


def test_dead_worker_is_reported_not_a_hang(cluster):
    group = WorkerGroup(cluster, Scaler, "dying", devices=[0, 1], args=(1,))
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError, match="the worker process died") as info:
            group.die(ranks=[1]).wait(timeout=60)
        assert info.value.rank == 1 and info.value.died
        assert pickle.loads(pickle.dumps(info.value)).died
        assert time.monotonic() - start < 60
    finally:
        group.shutdown()


def test_first_failure_wins_over_a_blocked_peer(cluster):
    """A consumer blocked on a channel must not hide the producer's crash."""
    channel = Channel.create("blocked-peer")
    waiting = WorkerGroup(cluster, Scaler, "waiting", devices=[0], args=(1,))
    failing = WorkerGroup(cluster, Scaler, "crashing", devices=[1, 1], args=(1,))
    try:
        blocked = waiting.wait_on(channel)
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            wait_all([blocked, failing.fail("boom")], timeout=60)
        assert info.value.group == "crashing"
        assert time.monotonic() - start < 30
    finally:
        waiting.shutdown()
        failing.shutdown()
        channel.close()


def test_wait_timeout_names_the_pending_ranks(cluster):
    group = WorkerGroup(cluster, Scaler, "slow", devices=[0, 1], args=(1,))
    try:
        with pytest.raises(TimeoutError, match=r"slow\[1\].sleep"):
            group.call("sleep", 3, ranks=[1]).wait(timeout=0.5)
    finally:
        group.shutdown()


def test_split_evenly_keeps_order_and_sizes_differ_by_at_most_one():
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_evenly("ab", 3) == [["a"], ["b"], []]
    assert split_evenly([], 2) == [[], []]


def test_scatter_shares_items_over_the_ranks_and_skips_idle_ones(cluster):
    group = WorkerGroup(cluster, Scaler, "scatter", devices=[0, 1, 1], args=(1,))
    try:
        # 5 items over 3 ranks: 2, 2, 1, each rank computing its contiguous share
        out = group.scatter("weigh", [1, 2, 3, 4, 5], [10, 20, 30, 40, 50], args=(7,))
        assert out == [
            [(0, 17), (0, 47)],
            [(1, 97), (1, 167)],
            [(2, 257)],
        ]
        # 2 items: rank 2 has nothing to do and is not called
        assert group.scatter("weigh", [1, 2], [3, 4], offset=0) == [[(0, 3)], [(1, 8)]]
        with pytest.raises(ValueError, match="differ in length"):
            group.scatter("weigh", [1, 2], [3], args=(0,))
    finally:
        group.shutdown()
