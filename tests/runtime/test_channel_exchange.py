"""Channel.exchange: a put and a get in one call, with the put keeping its place in order."""

import pytest

from rlinf_vla.runtime import Channel, Cluster, Worker, WorkerGroup
from rlinf_vla.runtime.cluster import ClusterConfig


class _Responder(Worker):
    """Answers each request on "req" with its double on "resp", then stops after n."""

    def serve(self, channel: Channel, n: int) -> int:
        pending = None
        for _ in range(n):
            x = channel.get("req") if pending is None else channel.exchange(*pending, "req")
            pending = ("resp", 2 * x)
        channel.put(*pending)
        return n


@pytest.fixture(scope="module")
def cluster():
    with Cluster(ClusterConfig(devices_per_node=1)) as c:
        yield c


def test_exchange_is_a_request_response_round_trip(cluster):
    channel = Channel.create("exchange-test")
    try:
        group = WorkerGroup(cluster, _Responder, "responder", [0])
        served = group.serve(channel, 5)
        channel.put("req", 0)
        answers = [channel.exchange("req", i, "resp") for i in range(1, 5)]
        answers.append(channel.get("resp"))
        assert answers == [0, 2, 4, 6, 8]
        assert served.wait() == [5]
        group.shutdown()
    finally:
        channel.close()


def test_exchange_keeps_the_order_of_earlier_puts_and_times_out_cleanly(cluster):
    channel = Channel.create("exchange-order", maxsize=4)
    try:
        channel.put("k", "a")
        channel.put("k", "b")
        # the exchange's put lands after a and b; its get takes the oldest item
        assert channel.exchange("k", "c", "k") == "a"
        assert [channel.get("k"), channel.get("k")] == ["b", "c"]
        with pytest.raises(TimeoutError, match="nothing under key 'empty'"):
            channel.exchange("k", "d", "empty", timeout=0.2)
        assert channel.get("k") == "d"  # the put happened although the get timed out
    finally:
        channel.close()
