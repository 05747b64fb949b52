"""A worker's random state round-trips through a checkpoint, on CPU and on a GPU."""

import pytest
import torch

from rlinf_vla.runtime.rng import get_rng_state, set_rng_state


def test_restoring_the_state_repeats_the_draws_and_old_cpu_tensors_still_load():
    cpu = torch.device("cpu")
    state = get_rng_state(cpu)
    assert set(state) == {"cpu"}
    first = torch.rand(5)
    set_rng_state(state, cpu)
    assert torch.equal(torch.rand(5), first)
    set_rng_state(state["cpu"], cpu)  # a checkpoint that holds the bare CPU state
    assert torch.equal(torch.rand(5), first)


@pytest.mark.gpu
def test_a_gpu_workers_state_includes_its_gpus_generator():
    gpu = torch.device("cuda", 0)
    torch.rand(1, device=gpu)  # the process has used the GPU
    state = get_rng_state(gpu)
    first = torch.rand(5, device=gpu)
    torch.rand(100, device=gpu)
    set_rng_state(state, gpu)
    assert torch.equal(torch.rand(5, device=gpu), first)
