"""A channel whose queues live in a worker's process (``Channel.create(..., host=...)``)."""

import pytest
import torch

from rlinf_vla.runtime import Channel, Worker, WorkerGroup, wait_all


class Host(Worker):
    """Consumes observations and answers with actions from the channel it hosts."""

    def serve(self, channel, n):
        # In the host the handle uses the queues directly: no Ray call.
        assert channel._local is not None
        seen = []
        for i in range(n):
            obs = channel.get("obs")
            seen.append(obs["step"])
            channel.put("act", obs["x"] * 2 + i)
        return seen

    def is_local(self, channel):
        return channel._local is not None

    def put_big(self, channel, key):
        channel.put(key, {"x": torch.arange(64 * 1024, dtype=torch.float32)})  # 256 KB

    def get_with_timeout(self, channel, key, timeout):
        try:
            return channel.get(key, timeout=timeout)
        except TimeoutError as e:
            return str(e)


class Env(Worker):
    def interact(self, channel, n):
        assert channel._local is None  # another process calls the host
        out = []
        for i in range(n):
            x = torch.full((3,), float(i))
            out.append(channel.exchange("obs", {"step": i, "x": x}, "act").tolist())
        return out


def test_a_hosted_channel_serves_its_host_directly_and_others_through_calls(cluster):
    hosts = WorkerGroup(cluster, Host, "hosts", devices=[0], channels=True)
    envs = WorkerGroup(cluster, Env, "envs", devices=[1])
    try:
        channel = Channel.create("hosted", host=hosts.actor(0))
        served, interacted = hosts.serve(channel, 5), envs.interact(channel, 5)
        [seen], [actions] = wait_all([served, interacted], timeout=120)
        assert seen == [0, 1, 2, 3, 4]
        assert actions == [[3.0 * i] * 3 for i in range(5)]  # 2 i + i
        assert channel.sizes() == {}
        # A big item put by the host reaches another process (through the object store).
        hosts.put_big(channel, "big").wait(timeout=60)
        assert channel.qsize("big") == 1
        got = channel.get("big")
        torch.testing.assert_close(got["x"], torch.arange(64 * 1024, dtype=torch.float32))
        # The driver's puts reach the host's gets, in order; a get that times out loses nothing.
        for i in range(3):
            channel.put("k", i)
        assert [hosts.get_with_timeout(channel, "k", 10).wait(timeout=60)[0] for _ in range(3)] == [
            0,
            1,
            2,
        ]
        [message] = hosts.get_with_timeout(channel, "k", 0.2).wait(timeout=60)
        assert "nothing under key 'k'" in message
        channel.put("k", 7)
        assert channel.get("k") == 7
        assert hosts.is_local(channel).wait(timeout=60) == [True]
        channel.close()
        with pytest.raises(Exception, match="no channel named 'hosted' is hosted here"):
            channel.get("k", timeout=1)  # the queues are gone
    finally:
        hosts.shutdown()
        envs.shutdown()


def test_a_hosted_channel_name_is_unique_in_its_host(cluster):
    hosts = WorkerGroup(cluster, Host, "hosts", devices=[0], channels=True)
    try:
        Channel.create("twice", host=hosts.actor(0))
        with pytest.raises(Exception, match="already hosted"):
            Channel.create("twice", host=hosts.actor(0))
    finally:
        hosts.shutdown()
