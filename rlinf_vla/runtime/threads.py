"""CPU thread count of torch in this process, set for a block and restored after it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)`` (``None``: leave it), then restore it.

    ``torch.set_num_threads`` is process-wide: a caller that sets it and returns leaves every
    later computation in the process (a second run, the next test) at that count, which changes
    both its speed and its floating-point results.

    Example::

        with torch_threads(1):
            policy.act(obs)  # timed the way a one-thread worker runs it
    """
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(max(1, int(n)))
    try:
        yield
    finally:
        torch.set_num_threads(before)
