"""Move a module and its optimizer state between a device and host memory.

Collocated placement lets the env, rollout and actor workers take turns on one device: the
idle ones offload. Offloading moves parameters, buffers, gradients and every tensor in the
optimizer state to CPU (pinned memory when CUDA is present, so the way back is fast); onload
moves them to ``device``. Tensors keep their identity (``param.data`` is swapped), so an
optimizer keeps working on the same parameter objects.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


def _move(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    if t.device == device:
        return t
    out = t.to(device, non_blocking=True)
    if pin and device.type == "cpu":
        out = out.pin_memory()
    return out


def _target(device: torch.device | str | None) -> tuple[torch.device, bool]:
    device = torch.device("cpu" if device is None else device)
    return device, device.type == "cpu" and torch.cuda.is_available()


def offload_module(module: torch.nn.Module, device: torch.device | str | None = None) -> None:
    """Move ``module``'s parameters, gradients and buffers to ``device`` (default: CPU).

    Moving to the CPU also hands the process's cached GPU memory back to the driver (see
    :func:`release_cuda_memory`), so another process on the same GPU can use it."""
    device, pin = _target(device)
    for p in module.parameters():
        p.data = _move(p.data, device, pin)
        if p.grad is not None:
            p.grad = _move(p.grad, device, pin)
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = _move(b, device, pin)
    _synchronize()
    if device.type == "cpu":
        release_cuda_memory()


def onload_module(module: torch.nn.Module, device: torch.device | str) -> None:
    """Move ``module`` back onto ``device`` (the inverse of :func:`offload_module`)."""
    offload_module(module, device)


def offload_optimizer(
    optimizer: torch.optim.Optimizer, device: torch.device | str | None = None
) -> None:
    """Move every tensor of ``optimizer``'s state (moments, steps) to ``device`` (default: CPU)."""
    device, pin = _target(device)
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                # Adam keeps a scalar 'step' on CPU unless capturable; leave scalars where they are.
                if value.dim() == 0 and key == "step":
                    continue
                state[key] = _move(value, device, pin)
    _synchronize()
    if device.type == "cpu":
        release_cuda_memory()


def onload_optimizer(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move ``optimizer``'s state back onto ``device``."""
    offload_optimizer(optimizer, device)


@contextlib.contextmanager
def resident(
    module: torch.nn.Module,
    device: torch.device | str,
    optimizer: torch.optim.Optimizer | None = None,
    enabled: bool = True,
    seconds: dict[str, float] | None = None,
) -> Iterator[None]:
    """Within the block ``module`` (and ``optimizer``'s state) is on ``device``; after it,
    also when the block raises, both are back in host memory. ``enabled=False``: a no-op
    (everything stays where it is). ``seconds``: the two moves' seconds are added to its
    ``"copy_s"``."""
    if not enabled:
        yield
        return
    t0 = time.perf_counter()
    onload_module(module, device)
    if optimizer is not None:
        onload_optimizer(optimizer, device)
    copied = time.perf_counter() - t0
    try:
        yield
    finally:
        t0 = time.perf_counter()
        offload_module(module)
        if optimizer is not None:
            offload_optimizer(optimizer)
        if seconds is not None:
            seconds["copy_s"] = seconds.get("copy_s", 0.0) + copied + time.perf_counter() - t0


def release_cuda_memory() -> None:
    """Free cuBLAS's workspaces and return the cached, unused blocks of torch's CUDA allocator to
    the driver. torch allocates a cuBLAS workspace (32 MiB on Hopper) per stream at the first
    matrix product and keeps it, and freed tensors stay cached by this process: without this
    an offloaded model still holds GPU memory that a collocated worker cannot use."""
    if not torch.cuda.is_initialized():
        return
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
