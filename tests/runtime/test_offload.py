import copy

import pytest
import torch

from rlinf_vla.runtime import (
    offload_module,
    offload_optimizer,
    onload_module,
    onload_optimizer,
    resident,
)


def _model_and_optimizer(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model, opt, seed):
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    x = torch.randn(16, 5, device=device)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def _offload_cycle(device):
    """Training interrupted by an offload/onload cycle matches uninterrupted training."""
    model, opt = _model_and_optimizer(device)
    ref_model, ref_opt = copy.deepcopy(model), None
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    params = list(model.parameters())
    for seed in range(2):
        _step(model, opt, seed)
        _step(ref_model, ref_opt, seed)

    offload_module(model)
    offload_optimizer(opt)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
    for state in opt.state.values():
        assert state["exp_avg"].device.type == "cpu"
    onload_module(model, device)
    onload_optimizer(opt, device)
    # The optimizer still holds the same parameter objects.
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]

    for seed in range(2, 4):
        assert _step(model, opt, seed) == pytest.approx(_step(ref_model, ref_opt, seed), rel=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)
    return model, opt


def test_offload_cycle_preserves_training_cpu():
    _offload_cycle("cpu")


@pytest.mark.gpu
def test_offload_frees_gpu_memory():
    model, opt = _offload_cycle("cuda")
    torch.cuda.synchronize()
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]
    tensors += [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    before = torch.cuda.memory_allocated()
    offload_module(model)
    offload_optimizer(opt)
    after = torch.cuda.memory_allocated()
    assert before - after >= nbytes  # (allocations are rounded up, never down)
    assert next(model.parameters()).is_pinned()
    onload_module(model, "cuda")
    onload_optimizer(opt, "cuda")
    assert torch.cuda.memory_allocated() - after >= nbytes


@pytest.mark.gpu
def test_release_cuda_memory_frees_the_cublas_workspace_and_the_cache():
    from rlinf_vla.runtime.offload import release_cuda_memory

    a = torch.randn(512, 512, device="cuda")
    release_cuda_memory()
    base = torch.cuda.memory_allocated()
    (a @ a).sum().item()  # the first matrix product allocates cuBLAS's workspace
    held, cached = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    release_cuda_memory()
    assert torch.cuda.memory_allocated() == base < held  # only `a` is left
    assert torch.cuda.memory_reserved() < cached  # and the freed blocks went back to the driver


@pytest.mark.gpu
def test_resident_holds_the_model_on_the_gpu_for_the_block_only():
    model, opt = _model_and_optimizer("cpu")
    _step(model, opt, 0)  # the optimizer state exists, on the CPU

    def where() -> set[str]:
        tensors = [*model.parameters(), *model.buffers()]
        tensors += [st["exp_avg"] for st in opt.state.values()]
        return {t.device.type for t in tensors}

    with resident(model, "cuda", opt):
        assert where() == {"cuda"}
        _step(model, opt, 1)
    assert where() == {"cpu"}
    with pytest.raises(RuntimeError, match="boom"), resident(model, "cuda", opt):
        assert where() == {"cuda"}
        raise RuntimeError("boom")
    assert where() == {"cpu"}  # also after an error in the block
    with resident(model, "cuda", opt, enabled=False):
        assert where() == {"cpu"}


def test_resident_adds_the_seconds_of_its_moves(monkeypatch):
    """Both moves are timed: each takes 0.05 s here (a stand-in for the copies), so the block
    adds at least 0.1 s to what ``seconds["copy_s"]`` held; disabled, it adds nothing."""
    import time

    from rlinf_vla.runtime import offload

    monkeypatch.setattr(offload, "onload_module", lambda module, device: time.sleep(0.05))
    monkeypatch.setattr(offload, "offload_module", lambda module: time.sleep(0.05))
    seconds = {"copy_s": 1.0}
    with offload.resident(torch.nn.Linear(2, 2), "cpu", seconds=seconds):
        time.sleep(0.2)  # the block's own time is not a copy
    assert 1.1 <= seconds["copy_s"] < 1.2
    with offload.resident(torch.nn.Linear(2, 2), "cpu", enabled=False, seconds=seconds):
        pass
    assert 1.1 <= seconds["copy_s"] < 1.2
