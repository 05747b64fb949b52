import asyncio
import time

import numpy as np
import pytest
import torch

from rlinf_vla.runtime import Channel, Worker, WorkerGroup, wait_all
from rlinf_vla.types import Observation


class Producer(Worker):
    def produce(self, channel, keys, n):
        for i in range(n):
            for key in keys:
                channel.put(key, (self.rank, key, i))
        channel.flush()
        return n

    def produce_one_by_one(self, channel, n):
        for i in range(n):
            channel.put("bp", i)
        return n

    async def produce_async(self, channel, n):
        for i in range(n):
            await channel.async_put("async", i)
        return n


class Consumer(Worker):
    def consume(self, channel, key, n):
        return [channel.get(key) for _ in range(n)]

    async def consume_async(self, channel, key, n):
        return await channel.async_get_batch(key, n)


def test_fifo_per_key_across_actors(cluster):
    channel = Channel.create("fifo")
    producers = WorkerGroup(cluster, Producer, "producers", devices=[0, 1])
    consumers = WorkerGroup(cluster, Consumer, "consumers", devices=[0, 1])
    try:
        made = producers.produce(channel, ["a", "b"], 20)
        got_a = consumers.consume(channel, "a", 40, ranks=[0])
        got_b = consumers.consume(channel, "b", 40, ranks=[1])
        _, [items_a], [items_b] = wait_all([made, got_a, got_b], timeout=120)
    finally:
        producers.shutdown()
        consumers.shutdown()
    for key, items in (("a", items_a), ("b", items_b)):
        assert {item[1] for item in items} == {key}
        for rank in (0, 1):
            # Each producer's items arrive in the order it put them.
            assert [i for r, _, i in items if r == rank] == list(range(20))
    assert channel.sizes() == {}
    channel.close()


@pytest.mark.ray
def test_batched_get_and_driver_use():
    channel = Channel.create("batched")
    for i in range(7):
        channel.put("k", {"step": i})
    assert channel.get_batch("k", 3) == [{"step": 0}, {"step": 1}, {"step": 2}]
    assert channel.get("k") == {"step": 3}
    channel.flush()
    assert channel.qsize("k") == 3
    assert channel.qsize("other") == 0
    with pytest.raises(ValueError, match="batch size must be >= 1"):
        channel.get_batch("k", 0)
    channel.close()


def test_get_timeout_loses_nothing(cluster):
    channel = Channel.create("timeouts")
    channel.put("k", 1)
    # The channel's actor is up and holds the item before the clock starts: on a loaded
    # machine starting its process can take longer than any bound on the timeout itself.
    channel.flush()
    assert channel.qsize("k") == 1
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="nothing under key 'k'"):
        channel.get_batch("k", 2, timeout=0.5)
    assert 0.4 < time.monotonic() - start < 30  # a 0.5 s timeout, not a hang (slack for load)
    channel.put("k", 2)
    assert channel.get_batch("k", 2) == [1, 2]
    channel.close()


def test_back_pressure_blocks_the_producer(cluster):
    channel = Channel.create("bounded", maxsize=2)
    producer = WorkerGroup(cluster, Producer, "bp-producer", devices=[0])
    try:
        made = producer.produce_one_by_one(channel, 8)
        # Wait for the first two items (a loaded machine may take seconds to run the call),
        # then give the producer time to put a third one, were it not blocked.
        deadline = time.monotonic() + 60
        while channel.qsize("bp") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2)
        assert not made.done(), "the producer should block on the full channel"
        assert channel.qsize("bp") == 2
        items = [channel.get("bp") for _ in range(8)]
        assert made.wait(timeout=60) == [8]
    finally:
        producer.shutdown()
    assert items == list(range(8))
    with pytest.raises(ValueError, match="bounded to 2"):
        channel.get_batch("bp", 3)
    channel.close()


def test_async_variants(cluster):
    channel = Channel.create("async")
    producer = WorkerGroup(cluster, Producer, "async-producer", devices=[0])
    consumer = WorkerGroup(cluster, Consumer, "async-consumer", devices=[1])
    try:
        made = producer.produce_async(channel, 5)
        got = consumer.consume_async(channel, "async", 5)
        [[n], [items]] = wait_all([made, got], timeout=60)
    finally:
        producer.shutdown()
        consumer.shutdown()
    assert n == 5
    assert items == [0, 1, 2, 3, 4]

    async def driver_side():
        await channel.async_put("d", "x")
        return await channel.async_get("d")

    assert asyncio.run(driver_side()) == "x"
    channel.close()


def test_large_tensors_and_observations_pass_through_the_object_store(cluster):
    channel = Channel.create("large", inline_max_bytes=1024)
    consumer = WorkerGroup(cluster, Consumer, "large-consumer", devices=[1])
    big = torch.arange(2**20, dtype=torch.float32)
    obs = Observation(
        images={"main": torch.randint(0, 255, (4, 64, 64, 3), dtype=torch.uint8)},
        state=torch.randn(4, 8),
        instruction=["pick up the cube"] * 4,
    )
    half = {"w": torch.ones(2**16, dtype=torch.bfloat16), "steps": [torch.arange(2**16)]}
    try:
        channel.put("t", big)
        channel.put("t", obs)
        channel.put("t", np.ones(3))
        channel.put("t", half)
        [[got_big, got_obs, got_small, got_half]] = consumer.consume(channel, "t", 4).wait(
            timeout=60
        )
    finally:
        consumer.shutdown()
    # tensors travel as arrays and arrive as tensors of their own dtype, writable, and the
    # producer's items are left as they were
    assert isinstance(got_big, torch.Tensor) and torch.equal(got_big, big)
    got_big += 1
    assert isinstance(obs.images["main"], torch.Tensor)
    assert got_half["w"].dtype == torch.bfloat16 and torch.equal(got_half["w"], half["w"])
    assert torch.equal(got_half["steps"][0], half["steps"][0])
    assert got_obs.images["main"].dtype == torch.uint8
    assert torch.equal(got_obs.images["main"], obs.images["main"])
    assert torch.equal(got_obs.state, obs.state)
    assert got_obs.instruction == obs.instruction
    np.testing.assert_array_equal(got_small, np.ones(3))
    channel.close()


def test_connect_by_name(cluster):
    channel = Channel.create("named", maxsize=5)
    other = Channel.connect("named")
    assert other.maxsize == 5
    other.put("k", "hello")
    assert channel.get("k") == "hello"
    with pytest.raises(KeyError, match="no channel named 'missing'"):
        Channel.connect("missing")
    channel.close()
