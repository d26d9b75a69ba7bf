"""The agreement vector's layout (``nanguard.agreement``): every slot named once, read back as written."""

from __future__ import annotations

import pytest
import torch

from nanguard.agreement import STEP_PERIOD, Agreed, Layout, step_slot


@pytest.mark.parametrize("world", [1, 2, 5])
def test_each_ranks_part_reads_back_by_slot_and_the_sum_is_everyones(world: int) -> None:
    at = Layout(world)
    parts = [at.vector(rank=r, code=r + 1, loss=0.25 * r, norm=float(r * r), step=10 + r) for r in range(world)]
    assert all(p.shape == (2 * world + 2,) and p.dtype == torch.float32 for p in parts)
    own = at.read(parts[-1].tolist())
    assert own.codes[-1] == world and sum(own.codes) == world and own.steps[-1] == step_slot(10 + world - 1)
    total = at.read(torch.stack(parts).sum(0).tolist())  # what the all-reduce (a sum) leaves on every rank
    squares = float(sum(r * r for r in range(world)))
    expected = Agreed(
        codes=tuple(range(1, world + 1)),
        loss=0.25 * sum(range(world)),
        norm=squares,
        steps=tuple(11 + r for r in range(world)),
    )
    assert total == expected
    assert Layout.for_size(at.size) == at


def test_the_slots_do_not_overlap_and_the_host_read_follows_them() -> None:
    at = Layout(3)
    used = [*range(at.size)[at.codes], at.loss, at.norm, *range(at.size)[at.steps]]
    assert sorted(used) == list(range(at.size))
    assert (at.own_scale, at.own_loss, at.own_norm) == (at.size, at.size + 1, at.size + 2)


def test_step_slots_are_exact_in_float32_and_zero_only_without_a_step() -> None:
    assert step_slot(None) == 0.0 and step_slot(0) == 1.0 and step_slot(STEP_PERIOD) == 1.0
    big = STEP_PERIOD - 1
    assert torch.tensor(step_slot(big), dtype=torch.float32).item() == big + 1
    assert Layout(2).vector(rank=0, code=8.0, step=None)[Layout(2).steps].tolist() == [0.0, 0.0]


def test_a_layout_of_no_ranks_or_an_odd_size_is_refused() -> None:
    with pytest.raises(ValueError, match="world"):
        Layout(0)
    with pytest.raises(ValueError, match="size"):
        Layout.for_size(5)
