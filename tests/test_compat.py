"""The private torch internals behind ``nanguard.compat``: each test fails loudly when torch changes one."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from nanguard import compat, dist
from nanguard.zoo.spawn import spawn_ranks


def test_foreach_copy_and_norm() -> None:
    dst = [torch.zeros(3), torch.zeros(2, 2)]
    src = [torch.arange(3.0), torch.full((2, 2), 2.0)]
    compat.foreach_copy_(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    norms = compat.foreach_norm(src, 2.0, dtype=torch.float32)
    assert [float(n) for n in norms] == pytest.approx([5.0**0.5, 4.0])


def test_set_grad_enabled_switches_grad_mode() -> None:
    compat.set_grad_enabled(False)
    try:
        assert not torch.is_grad_enabled() and not (torch.ones(1, requires_grad=True) * 2).requires_grad
    finally:
        compat.set_grad_enabled(True)
    assert torch.is_grad_enabled()


def test_default_group_is_the_group_torch_distributed_uses(tmp_path) -> None:
    assert compat.default_group() is None and not tdist.is_initialized()
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert compat.default_group() is tdist.distributed_c10d._get_default_group()
        assert compat.default_group().size() == tdist.get_world_size() == 1
    finally:
        tdist.destroy_process_group()
    assert compat.default_group() is None


def test_scaler_scale_is_the_device_tensor_behind_get_scale() -> None:
    w = nn.Parameter(torch.ones(2))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale((w * 2).sum()).backward()
    scale = compat.scaler_scale(scaler)
    assert isinstance(scale, torch.Tensor) and scale.numel() == 1
    assert float(scale) == scaler.get_scale() == 1024.0


@pytest.mark.parametrize(("found_inf", "moves"), [(0.0, True), (1.0, False)])
def test_fused_optimizer_skips_on_found_inf(found_inf: float, moves: bool) -> None:
    w = nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([w], lr=0.1, fused=True)
    assert compat.supports_found_inf(opt)
    w.grad = torch.ones(4)
    before = w.detach().clone()
    compat.step_with_found_inf(opt, torch.tensor(found_inf))
    assert (not torch.equal(w.detach(), before)) == moves
    assert not hasattr(opt, "found_inf")


def test_an_unfused_optimizer_does_not_take_found_inf() -> None:
    assert not compat.supports_found_inf(torch.optim.Adam([nn.Parameter(torch.ones(1))]))


# The leading positional parameters the stand-ins in nanguard.dist take, by collective.
COLLECTIVES = {
    "all_reduce": ["tensor"],
    "broadcast": ["tensor"],
    "barrier": [],
    "all_gather": ["tensor_list", "tensor"],
    "all_gather_into_tensor": ["output_tensor", "input_tensor"],
    "reduce_scatter_tensor": ["output", "input"],
}


def test_the_swapped_collectives_keep_their_signatures() -> None:
    assert set(COLLECTIVES) == set(dist._LOCAL_STAND_INS)
    for name, leading in COLLECTIVES.items():
        params = list(inspect.signature(getattr(tdist, name)).parameters)
        if leading:
            assert params[: len(leading)] == leading, (name, params)
        assert "async_op" in params, (name, params)


def test_swap_collectives_restores_and_rejects_unknown_names() -> None:
    original = tdist.all_reduce

    def stand_in(*args: object, **kwargs: object) -> None:
        return None

    with compat.swap_collectives({"all_reduce": stand_in}):
        assert tdist.all_reduce is stand_in
    assert tdist.all_reduce is original
    with (
        pytest.raises(RuntimeError, match="no_such_collective"),
        compat.swap_collectives({"no_such_collective": stand_in}),
    ):
        pass


def _ranks(rank: int, world: int, tmp: str) -> dict[str, object]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.fsdp import fully_shard

    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    hook_before = compat.ddp_has_comm_hook(ddp)
    ddp.register_comm_hook(ddp.process_group, allreduce_hook)
    hook_after = compat.ddp_has_comm_hook(ddp)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()
    reference = [p.grad.to_local().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    model.set_requires_gradient_sync(False)
    model(x).square().sum().backward()
    state = model._get_fsdp_state()
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    fsdp_params = [fp for group in groups if group is not None for fp in group.fsdp_params]
    held = any(fp.unsharded_accumulated_grad is not None or fp._unsharded_param.grad is not None for fp in fsdp_params)
    compat.drop_fsdp_accumulated_grads(model)
    dropped = all(fp.unsharded_accumulated_grad is None and fp._unsharded_param.grad is None for fp in fsdp_params)
    model.set_requires_gradient_sync(True)
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    same = all(torch.equal(p.grad.to_local(), r) for p, r in zip(model.parameters(), reference, strict=True))
    return {
        **_join_and_zero(ddp),
        "hooks": (hook_before, hook_after),
        "fsdp_state": state is not None and len(fsdp_params) == 4,
        "held": held,
        "dropped": dropped,
        "same_grads": same,
    }


def _join_and_zero(ddp: nn.parallel.DistributedDataParallel) -> dict[str, object]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    calls = []

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(*args, **kwargs)

    original = tdist.all_reduce
    before = compat.ddp_join_enabled(ddp)
    with ddp.join():
        inside = compat.ddp_join_enabled(ddp)
        with compat.swap_collectives({"all_reduce": counting}):
            with ddp.no_sync(), compat.ddp_join_paused(ddp):
                paused = not compat.ddp_join_enabled(ddp)
                ddp(torch.ones(1, 4))
            quiet = len(calls)
            with ddp.no_sync():
                ddp(torch.ones(1, 4))  # the join context's own all-reduces, once more
        restored = compat.ddp_join_enabled(ddp)
    zero = ZeroRedundancyOptimizer(list(ddp.parameters()), optimizer_class=torch.optim.SGD, lr=0.1)
    local = compat.zero_local_optimizer(zero)
    owners = compat.zero_owners(zero)
    mine = {id(p) for g in local.param_groups for p in g["params"]} if local is not None else set()
    return {
        "join": [before, inside, paused, quiet, len(calls) > quiet, restored],
        "zero_local": local is not None and mine == {k for k, r in (owners or {}).items() if r == tdist.get_rank()},
        "zero_owners": sorted(set((owners or {}).values())),
        "plain": [compat.zero_local_optimizer(torch.optim.SGD(ddp.parameters(), lr=0.1)), compat.zero_owners(local)],
    }


@pytest.mark.dist
def test_ddp_hooks_and_fsdp2_internals(tmp_path) -> None:
    for r in spawn_ranks(_ranks, tmp_path):
        assert r["hooks"] == [False, True]  # results travel as JSON
        assert r["fsdp_state"], "FSDP2 no longer exposes _get_fsdp_state()._fsdp_param_group.fsdp_params"
        assert r["held"], "FSDP2 no longer keeps the unsynced gradients where compat clears them"
        assert r["dropped"] and r["same_grads"]
        # DDP join(): enabled inside, paused for a local replay (no join all-reduce), restored after.
        assert r["join"] == [False, True, True, 0, True, True], r["join"]
        assert r["zero_local"] and r["zero_owners"] == [0, 1] and r["plain"] == [None, None], r


def test_scaler_steps_aside_lets_a_replay_unscale_again() -> None:
    from nanguard.compat import scaler_steps_aside, scaler_unscaled

    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # the scale tensor is made on first use
    param.grad = torch.full((2,), 8.0)
    scaler.unscale_(opt)
    with scaler_steps_aside(scaler):
        assert not scaler_unscaled(scaler, opt)
        scaler.unscale_(opt)  # would raise: unscale_() has already been called
    assert scaler_unscaled(scaler, opt)
    assert torch.equal(param.grad, torch.full((2,), 0.5))


def test_the_dispatch_mode_sees_each_op_and_the_autograd_node_of_backward() -> None:
    seen: list[tuple[str, bool]] = []

    class Mode(compat.DispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((str(func), compat.current_autograd_node() is not None))
            return func(*args, **(kwargs or {}))

    x = torch.ones(3, requires_grad=True)
    before = compat.autograd_sequence_nr()
    with Mode():
        y = x.log().sum()
        built = compat.autograd_sequence_nr()
        y.backward()
    assert built >= before + 2  # log and sum each made an autograd node
    assert ("aten.log.default", False) in seen  # forward: no node is running
    assert any(running for op, running in seen if op != "aten.log.default")  # backward: its node is
    assert compat.current_autograd_node() is None


def test_op_overloads_and_uninitialized_parameters_are_told_apart() -> None:
    assert compat.is_op_overload(torch.ops.aten.log) and compat.is_op_overload(torch.ops.aten.log.default)
    assert not compat.is_op_overload(torch.log)
    lazy = torch.nn.LazyLinear(2)
    assert compat.is_uninitialized(lazy.weight)
    lazy(torch.ones(1, 3))
    assert not compat.is_uninitialized(lazy.weight)


def _dtensor_internals(rank, world):
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.utils._python_dispatch import TorchDispatchMode

    class Namespaces(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(f"{func.namespace}::{func._schema.name.split('::')[-1]}")
            return func(*args, **(kwargs or {}))

    mesh = init_device_mesh("cpu", (world,))
    pending = funcol.all_reduce(torch.ones(3), "sum", mesh)
    wrapped = compat.inner_tensor(pending)
    elem_is_inner = wrapped is pending.elem
    dt = DTensor.from_local(torch.full((2,), float(rank)), mesh, [Partial()])
    local_is_inner = compat.inner_tensor(dt) is dt._local_tensor and torch.equal(compat.inner_tensor(dt), dt.to_local())
    with Namespaces() as mode:
        dt.redistribute(mesh, [Replicate()]).to_local().sum()
        tdist.all_reduce(torch.ones(1))
    return {
        "elem": elem_is_inner,
        "local": local_is_inner,
        "plain": compat.inner_tensor(torch.ones(1)) is None,
        "seen": [s for s in mode.seen if not s.startswith("aten::")],
    }


@pytest.mark.dist
def test_dtensor_and_functional_collective_internals(tmp_path) -> None:
    for r in spawn_ranks(_dtensor_internals, timeout=120):
        assert r["elem"], "AsyncCollectiveTensor no longer keeps its buffer in .elem"
        assert r["local"], "DTensor no longer keeps this rank's values in ._local_tensor"
        assert r["plain"]
        # The ops DTensor redistributes with and torch.distributed's own: all are communication.
        assert {"_c10d_functional::all_reduce", "_c10d_functional::_wrap_tensor_autograd", "c10d::allreduce_"} <= set(
            r["seen"]
        ), r["seen"]
        assert all(s.split("::")[0] in compat.COMM_NAMESPACES for s in r["seen"]), r["seen"]


def test_pipeline_stage_hooks_see_each_microbatch_and_unpatch(tmp_path) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from nanguard.zoo.parallel import ParallelMLP

    originals = (_PipelineStageBase.forward_one_chunk, _PipelineStageBase.backward_one_chunk)
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        stage = PipelineStage(ParallelMLP(), 0, 1, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: ((out - y) ** 2).mean())
        x = torch.randn(4, 8)
        seen: list[tuple] = []
        with compat.pipeline_stage_hooks(
            lambda s, received, out: seen.append(("forward", s.stage_index, received[0].shape, out.shape)),
            lambda s, received, sent: seen.append(("backward", s.stage_index, received, len(sent))),
        ):
            schedule.step(x, target=torch.randn(4, 8), losses=[])
    finally:
        tdist.destroy_process_group()
    micro = (torch.Size([2, 8]), torch.Size([2, 8]))
    # The first stage receives its microbatch; the last starts its backward from the loss.
    assert seen == [("forward", 0, *micro), ("forward", 0, *micro), ("backward", 0, None, 1), ("backward", 0, None, 1)]
    assert (_PipelineStageBase.forward_one_chunk, _PipelineStageBase.backward_one_chunk) == originals


def test_written_tensors_of_in_place_and_communication_ops() -> None:
    a, b = torch.ones(2), torch.ones(2)
    assert compat.written_tensors(torch.ops.aten.add_.Tensor, (a, b), {}) == [a]
    assert compat.written_tensors(torch.ops.aten.add.Tensor, (a, b), {}) == []
    out = compat.written_tensors(torch.ops.c10d.recv_.default, ([a, b], None, 0, 0), {})
    assert len(out) == 2 and out[0] is a and out[1] is b  # c10d declares no aliasing: named in place
    assert compat.written_tensors(torch.ops.c10d.send.default, ([a], None, 1, 0), {}) == []


def test_clip_grad_norm_hands_the_norm_it_computed_to_the_watched_clip() -> None:
    # compat.watch_clips relies on clip_grad_norm_ looking up clip_grad._clip_grads_with_norm_ at each call.
    model = torch.nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    seen: list[tuple[int, float]] = []
    stop = compat.watch_clips(lambda params, norm: seen.append((len(params), float(norm))))
    try:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    finally:
        stop()
    assert seen == [(2, float(norm))]
    assert torch.nn.utils.clip_grad._clip_grads_with_norm_ is torch.nn.utils.clip_grads_with_norm_


def test_clip_grad_norm_and_get_total_norm_show_the_gradients_before_the_norm_is_computed() -> None:
    # The ``before`` watcher relies on clip_grad_norm_ looking up clip_grad._get_total_norm at each call.
    model = torch.nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    seen: list[list[torch.Tensor]] = []
    stop = compat.watch_clips(lambda params, norm: None, before=seen.append)
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        torch.nn.utils.get_total_norm(g for g in grads)  # a generator: read once, by the norm too
    finally:
        stop()
    assert [[id(g) for g in s] for s in seen] == [[id(g) for g in grads]] * 2
    assert torch.nn.utils.get_total_norm is torch.nn.utils.clip_grad._get_total_norm  # put back
