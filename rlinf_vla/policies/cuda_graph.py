"""A step function captured once as a CUDA graph and replayed: for loops whose every step runs
the same kernels on tensors of the same shapes (π0's denoising steps), where launching the
kernels one by one from Python costs more than running them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["GraphedStep"]


class GraphedStep:
    """``fn(*inputs) -> tuple[Tensor, ...]`` as a CUDA graph.

    ``fn`` must run only kernels on CUDA tensors: no copies from host memory, no ``.item()`` or
    other synchronisation, no shapes that depend on values. The example inputs fix the shapes,
    dtypes and device. A call copies its arguments into the graph's static inputs, replays the
    graph and returns copies of its outputs (the next replay overwrites the graph's own). Other
    tensors ``fn`` reads (a KV cache, the model weights) must stay alive and unchanged while the
    graph is in use; the graph's intermediate buffers live as long as this object.

    >>> step = GraphedStep(lambda x, k: (model(x, k),), x0, k0)
    >>> for k in range(10):
    ...     (x,) = step(x, torch.full_like(k0, k))
    """

    def __init__(self, fn: Callable[..., tuple[Tensor, ...]], *example: Tensor) -> None:
        self._inputs = [t.clone() for t in example]
        # Warm up on a side stream (lazy initialisation, cuBLAS handles), as torch's graph
        # capture requires; the result is discarded.
        stream = torch.cuda.Stream(device=self._inputs[0].device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(*self._inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._outputs = tuple(fn(*self._inputs))

    def __call__(self, *args: Tensor) -> tuple[Tensor, ...]:
        for static, value in zip(self._inputs, args, strict=True):
            static.copy_(value)
        self.graph.replay()
        return tuple(t.clone() for t in self._outputs)
