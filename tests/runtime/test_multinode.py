"""Placement across nodes, on a simulated multi-node Ray cluster (several raylets, one machine)."""

import pytest

from rlinf_vla.runtime import Cluster, Worker, WorkerGroup


class WhereAmI(Worker):
    def where(self):
        import ray

        return self.rank, ray.get_runtime_context().get_node_id(), self.node_id

    def on_my_node(self):
        return self.node_world_size


@pytest.fixture(scope="module")
def two_node_cluster():
    import ray
    from ray.cluster_utils import Cluster as RayTestCluster

    if ray.is_initialized():
        ray.shutdown()
    fake = RayTestCluster(initialize_head=True, head_node_args={"num_cpus": 1})
    fake.add_node(num_cpus=1)
    fake.wait_for_nodes()
    try:
        with Cluster(address=fake.address, num_nodes=2, devices_per_node=1) as cluster:
            yield cluster
    finally:
        fake.shutdown()


def test_devices_span_both_nodes(two_node_cluster):
    devices = two_node_cluster.devices
    assert two_node_cluster.num_nodes == 2
    assert [d.node_rank for d in devices] == [0, 1]
    assert devices[0].node_id != devices[1].node_id
    assert {d.kind for d in devices} == {"cpu"}


def test_workers_are_placed_on_their_device_node(two_node_cluster):
    group = WorkerGroup(two_node_cluster, WhereAmI, "where", devices=[1, 0, 1])
    try:
        placed = group.where().wait(timeout=120)
        on_node = group.on_my_node().wait(timeout=60)
    finally:
        group.shutdown()
    devices = two_node_cluster.devices
    expected = [devices[1].node_id, devices[0].node_id, devices[1].node_id]
    assert [actual for _, actual, _ in placed] == expected
    assert [declared for _, _, declared in placed] == expected
    # ranks 0 and 2 share node 1; rank 1 is alone on node 0
    assert on_node == [2, 1, 2]
