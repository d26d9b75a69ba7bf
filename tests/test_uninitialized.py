"""Reads of uninitialized memory: a gradient allocated with ``new_empty`` whose rows the backward leaves
unwritten (FBGEMM's ``pack_segments`` backward, flash-linear-attention's chunk kernels), a padded buffer
filled in part. The memory holds whatever the allocator left there, NaN on some steps and not on others, so
a replay or a peer device sees other values: the tracer fills each allocation with NaN, and the cause is
``op.uninitialized_read``, never the hardware.

The real step goes NaN here through ``torch.use_deterministic_algorithms(True)``, which fills new memory
with NaN (``torch.utils.deterministic.fill_uninitialized_memory``), as a GPU block a freed NaN tensor held
would: whatever the CPU allocator hands out, the tests see the same values.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

import nanguard as ng
from nanguard.diagnose import diagnose
from nanguard.zoo.spawn import spawn_ranks
from nanguard.zoo.wild_causes import nan_memory


class _KeepFirst(torch.autograd.Function):
    """The forward keeps the first ``n`` rows; the backward's gradient is allocated with ``zeros`` or
    ``new_empty`` (the bug) and only those rows are written."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n: int, zeros: bool) -> torch.Tensor:
        ctx.n, ctx.shape, ctx.zeros = n, x.shape, zeros
        return x[:n].clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = g.new_zeros(ctx.shape) if ctx.zeros else g.new_empty(ctx.shape)  # the allocation
        grad[: ctx.n] = g
        return grad, None, None


class _Net(nn.Module):
    def __init__(self, *, zeros: bool = False, padded: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.1)  # its mask starts as new memory, all of it written: no origin
        self.head = nn.Linear(6, 1) if padded else nn.Linear(4, 1)
        self.zeros, self.padded = zeros, padded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.fc(x))
        if self.padded:  # a buffer padded to 6 features, only 4 of them written
            out = h.new_zeros(h.shape[0], 6) if self.zeros else h.new_empty(h.shape[0], 6)
            out[:, :4] = h
            return self.head(out).mean()
        return self.head(_KeepFirst.apply(h, 3, self.zeros)).mean()


def _step(model: nn.Module, x: torch.Tensor) -> Any:
    def closure() -> torch.Tensor:
        model.zero_grad()
        loss = model(x)
        loss.backward()
        return loss

    return closure


def test_a_backward_that_writes_only_the_rows_its_forward_kept_is_named_wherever_the_memory_came_from() -> None:
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(5, 4)
    diag = ng.locate(_step(model, x), model=model)  # the allocator's memory as it comes: finite or not
    assert diag is not None
    origin = diag.evidence["origin"]
    assert (diag.cause, diag.op, diag.phase, origin["node"]) == (
        "op.uninitialized_read",
        "aten.new_empty.default",
        "backward",
        "_KeepFirstBackward",
    )
    assert origin["category"] == "blank" and "test_uninitialized.py" in origin["source"]
    assert "zeros" in diag.fixes[0] and "read before any op wrote it" in diag.evidence["why"]
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the parameters as they were

    torch.manual_seed(0)
    twin = _Net(zeros=True)
    assert ng.locate(_step(twin, x), model=twin) is None  # zeros: every element written or zero


def test_a_padded_buffer_filled_in_part_is_named_in_the_forward_and_its_module() -> None:
    torch.manual_seed(0)
    model, x = _Net(padded=True), torch.randn(5, 4)
    diag = ng.locate(_step(model, x), model=model)
    assert diag is not None
    assert (diag.cause, diag.op, diag.phase, diag.module) == (
        "op.uninitialized_read",
        "aten.new_empty.default",
        "forward",
        "",
    )
    torch.manual_seed(0)
    twin = _Net(zeros=True, padded=True)
    assert ng.locate(_step(twin, x), model=twin) is None


def test_memory_written_before_it_is_read_is_no_origin_and_the_fault_after_it_is_named() -> None:
    """Dropout's mask and a buffer copied into whole start as new memory: the log after them is the origin."""
    torch.manual_seed(0)
    model, x = _Net(zeros=True), torch.randn(5, 4)
    model.fc.register_forward_hook(lambda _m, _a, out: torch.empty_like(out).copy_(out).log())
    diag = ng.locate(_step(model, x), model=model)
    assert diag is not None and (diag.cause, diag.op, diag.module) == ("op.log_domain", "aten.log.default", "fc")


def test_the_rule_names_a_blank_origin_and_nothing_else() -> None:
    blank = {"origin": {"category": "blank", "op": "aten.empty.memory_format", "module": "attn"}}
    assert diagnose(blank).cause == "op.uninitialized_read"
    assert diagnose({"origin": {**blank["origin"], "category": "op"}}).cause != "op.uninitialized_read"


def test_the_guard_names_the_step_that_read_nan_from_new_memory_and_skips_it() -> None:
    """Only step 1 takes the path that allocates with ``new_empty`` (the others with zeros), its new memory NaN."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, opt, policy="skip")
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.randn(5, 4, generator=gen)
        model.zeros = step != 1
        with nan_memory() if step == 1 else contextlib.nullcontext():
            assert (guard.step(_step(model, x)) is None) == (step == 1), step
    guard.close()
    diag = guard.last_diagnosis
    assert guard.skipped == 1 and diag is not None and diag.step == 1
    assert (diag.cause, diag.op, diag.phase) == ("op.uninitialized_read", "aten.new_empty.default", "backward")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _ddp_run(rank: int, bad_rank: int) -> dict[str, Any]:
    """At step 1 ``bad_rank`` takes the ``new_empty`` path and its new memory holds NaN (its device's allocator
    reused a NaN block); the others' holds zeros (fresh pages). A peer recomputing that rank's step gets other
    memory, which proves nothing of a device."""
    torch.manual_seed(0)
    net = _Net()
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, opt, policy="skip", fingerprint_every=0)
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        bad = (rank, step) == (bad_rank, 1)
        net.zeros = not bad
        with nan_memory() if bad else contextlib.nullcontext():
            guard.step(_step(model, x), batch=x)
    guard.close()
    diag = guard.last_diagnosis
    assert diag is not None
    return {"skipped": guard.skipped, "diag": diag.to_dict()}


def _ddp(rank: int, world: int) -> list[dict[str, Any]]:
    return [_ddp_run(rank, bad_rank) for bad_rank in (0, 1)]  # rank 0, then the middle rank of 3


def test_under_ddp_the_rank_whose_memory_held_nan_is_named_and_no_device_is_blamed() -> None:
    for runs in spawn_ranks(_ddp, world=3, timeout=300):
        for bad_rank, out in zip((0, 1), runs, strict=True):
            diag = out["diag"]
            assert out["skipped"] == 1, (bad_rank, out)
            assert (diag["cause"], diag["rank"], diag["step"], diag["phase"]) == (
                "op.uninitialized_read",
                bad_rank,
                1,
                "backward",
            ), diag
            assert "proof" not in diag["evidence"] and "hardware" not in diag["cause"], diag["evidence"].get("proof")


class _TwoBranches(nn.Module):
    """A padded buffer read in part (a latent read: the memory is often finite) beside a log of a negative
    (the fault): both reach the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.pad = _Net(padded=True)
        self.energy = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pad(x) + torch.log(self.energy(x) - 100.0).mean()


def test_a_fault_computed_by_an_op_is_named_before_a_latent_read_of_new_memory() -> None:
    torch.manual_seed(0)
    model, x = _TwoBranches(), torch.randn(5, 4)
    diag = ng.locate(_step(model, x), model=model)
    assert diag is not None and (diag.cause, diag.op, diag.module) == ("op.log_domain", "aten.log.default", "")
    assert [a["cause"] for a in diag.also] == ["op.uninitialized_read"] and "module 'pad'" in diag.also[0]["why"]
    model.energy.bias.data.fill_(200.0)  # the log's argument positive: the read of new memory is all that is left
    diag = ng.locate(_step(model, x), model=model)
    assert diag is not None and (diag.cause, diag.module) == ("op.uninitialized_read", "pad")
