"""``torch_threads``: the thread count holds inside the block and is restored after it."""

from __future__ import annotations

import pytest
import torch

from rlinf_vla.runtime import torch_threads


def test_sets_the_count_inside_and_restores_it_after_an_error() -> None:
    before = torch.get_num_threads()
    inside = 1 if before != 1 else 2
    with pytest.raises(RuntimeError, match="boom"), torch_threads(inside):
        assert torch.get_num_threads() == inside
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_none_leaves_the_count_alone() -> None:
    before = torch.get_num_threads()
    with torch_threads(None):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before
