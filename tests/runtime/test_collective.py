import pytest
import torch

from rlinf_vla.runtime import Device, Worker, WorkerError, WorkerGroup, create_collective
from rlinf_vla.runtime.collective import auto_backend


class Peer(Worker):
    def broadcast(self, name):
        coll = self.collective(name)
        t = (
            torch.arange(6, dtype=torch.float32).reshape(2, 3) * 10
            if coll.rank == 0
            else torch.zeros(2, 3)
        )
        coll.broadcast(t, src=0)
        return coll.rank, t

    def send_recv(self, name):
        coll = self.collective(name)
        if coll.rank == 0:
            coll.send(torch.tensor([1.5, -2.0, 3.25]), dst=1)
            return None
        return coll.recv(torch.empty(3), src=0)

    def sync_weights(self, name):
        coll = self.collective(name)
        state = None
        if coll.rank == 0:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
            state = model.state_dict()
        received = coll.broadcast_tensors(state, src=0)
        return {k: v.clone() for k, v in received.items()}

    def sync_on_device(self, name):
        coll = self.collective(name)
        state = {"w": torch.arange(4.0, device=self.device)} if coll.rank == 0 else None
        received = coll.broadcast_tensors(state, src=0)
        return coll.backend, {k: v.cpu() for k, v in received.items()}

    def objects(self, name):
        coll = self.collective(name)
        return coll.broadcast_object({"version": 7, "names": ["a"]} if coll.rank == 0 else None)

    def unknown(self):
        return self.collective("nope")


def test_gloo_broadcast_and_point_to_point(cluster):
    group = WorkerGroup(cluster, Peer, "peers", devices=[0, 1])
    try:
        create_collective("pair", [(group, None)])
        results = group.broadcast("pair").wait(timeout=120)
        expected = torch.tensor([[0.0, 10.0, 20.0], [30.0, 40.0, 50.0]])
        assert [r for r, _ in results] == [0, 1]
        for _, t in results:
            assert torch.equal(t, expected)
        _, received = group.send_recv("pair").wait(timeout=120)
        assert torch.equal(received, torch.tensor([1.5, -2.0, 3.25]))
        assert group.objects("pair").wait(timeout=120) == [{"version": 7, "names": ["a"]}] * 2
        with pytest.raises(
            WorkerError, match="not in a collective named 'nope' \\(joined: pair\\)"
        ):
            group.unknown().wait()
    finally:
        group.shutdown()


def test_weight_sync_from_one_group_to_another(cluster):
    """Actor rank 0 broadcasts a state dict (two dtypes) to every rollout worker."""
    actor = WorkerGroup(cluster, Peer, "actor", devices=[0, 1])
    rollout = WorkerGroup(cluster, Peer, "rollout", devices=[0, 1])
    try:
        create_collective("weights", [(actor, [0]), (rollout, None)])
        from rlinf_vla.runtime.worker import wait_all

        [[src], received] = wait_all(
            [actor.sync_weights("weights", ranks=[0]), rollout.sync_weights("weights")], 120
        )
    finally:
        actor.shutdown()
        rollout.shutdown()
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).state_dict()
    assert set(src) == set(reference)
    for state in received:
        assert set(state) == set(reference)
        for key, value in reference.items():
            assert state[key].dtype == value.dtype  # num_batches_tracked stays int64
            assert torch.equal(state[key], value)


def test_collective_needs_two_distinct_members(cluster):
    group = WorkerGroup(cluster, Peer, "lonely", devices=[0])
    try:
        with pytest.raises(ValueError, match="at least two members"):
            create_collective("solo", [(group, None)])
        with pytest.raises(ValueError, match="lists a worker twice"):
            create_collective("twice", [(group, [0]), (group, [0])])
    finally:
        group.shutdown()


def test_auto_picks_nccl_only_when_every_member_has_a_gpu_of_its_own():
    def gpu(node, index):
        return Device(0, 0, node, "10.0.0.1", index, "cuda")

    cpu = Device(0, 0, "n0", "10.0.0.1", 0, "cpu", threads=1)
    assert auto_backend([gpu("n0", 0), gpu("n0", 1)]) == "nccl"
    assert auto_backend([gpu("n0", 0), gpu("n1", 0)]) == "nccl"  # GPU 0 of two nodes
    # collocated: actor and rollout on one GPU, which NCCL refuses ("Duplicate GPU detected")
    assert auto_backend([gpu("n0", 0), gpu("n0", 0)]) == "gloo"
    assert auto_backend([gpu("n0", 0), gpu("n0", 1), gpu("n0", 1)]) == "gloo"
    assert auto_backend([gpu("n0", 0), cpu]) == "gloo"
    assert auto_backend([cpu, cpu]) == "gloo"


@pytest.mark.gpu
def test_nccl_broadcast_between_gpu_workers(cluster):
    if sum(d.kind == "cuda" for d in cluster.devices) < 2:
        pytest.skip("NCCL needs two GPUs: it refuses two ranks on one")
    group = WorkerGroup(cluster, Peer, "gpu-peers", devices=[0, 1])
    try:
        create_collective("gpu-pair", [(group, None)], backend="nccl")
        results = group.broadcast("gpu-pair").wait(timeout=120)
    finally:
        group.shutdown()
    for _, t in results:
        assert t.device.type == "cpu" or t.is_cuda
        assert torch.equal(t.cpu(), torch.arange(6, dtype=torch.float32).reshape(2, 3) * 10)


@pytest.mark.gpu
def test_collocated_gpu_workers_share_weights_over_gloo(cluster):
    # The collocated layout on one GPU: the weight sync must not ask NCCL for two ranks there.
    if cluster.devices[0].kind != "cuda":
        pytest.skip("the cluster has no GPU device")
    group = WorkerGroup(cluster, Peer, "gpu-collocated", devices=[0, 0])
    try:
        create_collective("gpu-shared", [(group, None)])
        results = group.sync_on_device("gpu-shared").wait(timeout=120)
    finally:
        group.shutdown()
    for backend, state in results:
        assert backend == "gloo"
        assert torch.equal(state["w"], torch.arange(4.0))
