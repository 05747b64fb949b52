"""A channel whose queues live in a worker's process (``Channel.create(..., host=...)``)."""

import time

import pytest
import torch

from rlinf_vla.runtime import Channel, Worker, WorkerGroup, wait_all
from rlinf_vla.runtime.channel import ChannelHostLost


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
        return out, channel._pipe() is not None

    def exchange_forever(self, channel):
        """Wait for an answer that never comes (the host is killed meanwhile)."""
        try:
            channel.exchange("obs", {"step": 0, "x": torch.zeros(3)}, "never")
        except ChannelHostLost as e:
            return f"lost: {e}"
        return "answered"


@pytest.mark.parametrize("pipes", [True, False])
def test_a_hosted_channel_serves_its_host_directly_and_others_through_calls(cluster, pipes):
    """The same behaviour whether the other processes on the host's node talk to it over
    their pipes or through Ray calls."""
    hosts = WorkerGroup(cluster, Host, "hosts", devices=[0], channels=True)
    envs = WorkerGroup(cluster, Env, "envs", devices=[1])
    try:
        channel = Channel.create("hosted", host=hosts.actor(0), pipes=pipes)
        served, interacted = hosts.serve(channel, 5), envs.interact(channel, 5)
        [seen], [(actions, piped)] = wait_all([served, interacted], timeout=120)
        assert piped is pipes  # one node: the env worker took its pipe where there are pipes
        assert seen == [0, 1, 2, 3, 4]
        assert actions == [[3.0 * i] * 3 for i in range(5)]  # 2 i + i
        assert channel.sizes() == {}
        # A big item put by the host reaches another process (through the object store).
        hosts.put_big(channel, "big").wait(timeout=60)
        assert channel.qsize("big") == 1
        got = channel.get("big")
        torch.testing.assert_close(got["x"], torch.arange(64 * 1024, dtype=torch.float32))
        # A big item from another process reaches the host and comes back whole.
        big = {"x": torch.randn(300, 256), "mask": torch.rand(300) > 0.5, "step": 3}
        channel.put("big-in", big)
        back = hosts.get_with_timeout(channel, "big-in", 10).wait(timeout=60)[0]
        torch.testing.assert_close(back["x"], big["x"])
        assert torch.equal(back["mask"], big["mask"]) and back["step"] == 3
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


def test_a_producer_waiting_on_its_pipe_learns_that_the_host_ended(cluster):
    import ray

    hosts = WorkerGroup(cluster, Host, "hosts", devices=[0], channels=True)
    envs = WorkerGroup(cluster, Env, "envs", devices=[1])
    try:
        channel = Channel.create("lost", host=hosts.actor(0))
        waiting = envs.exchange_forever(channel)
        deadline = time.monotonic() + 30
        while channel.qsize("obs") == 0 and time.monotonic() < deadline:
            time.sleep(0.1)  # the env worker's observation arrived: it waits for "never"
        assert channel.qsize("obs") == 1
        ray.kill(hosts.actor(0), no_restart=True)
        [said] = waiting.wait(timeout=60)
        assert said.startswith("lost: channel 'lost': the process hosting it ended")
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
