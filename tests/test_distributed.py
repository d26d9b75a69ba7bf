"""Guard under real torch.distributed: 2 gloo ranks, faults on one rank only."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel as DDP

import nanguard as ng
from nanguard.events import read_events
from nanguard.zoo import GPT, GPTConfig, synthetic_batch
from nanguard.zoo.runner import CorruptOnce
from nanguard.zoo.spawn import RanksFailed, spawn_ranks

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parent.parent


def _model(vision: bool = True, n_embd: int = 64) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vision_dim=16 if vision else 0, n_embd=n_embd, block_size=16))


def _batch(model: GPT, rank: int, step: int, bad: bool = False) -> dict:
    batch = synthetic_batch(model.config, torch.Generator().manual_seed(rank * 1000 + step))
    if bad:
        batch["pixel_values"][0, 0, 0] = float("nan")
    return batch


def _loop(model, ddp, opt, guard, rank, steps, bad_step=None, bad_ranks=(1,), spoil=None, after_backward=None):
    """Guarded steps; at ``bad_step`` on ``bad_ranks`` the batch gets NaN pixels, or ``spoil(batch)``."""
    for step in range(steps):
        faulty = step == bad_step and rank in bad_ranks
        batch = _batch(model, rank, step, bad=faulty and spoil is None)
        if spoil is not None and faulty:
            spoil(batch)

        def closure(batch=batch):
            opt.zero_grad(set_to_none=True)
            _, loss = ddp(**batch)
            loss.backward()
            if after_backward is not None:
                after_backward()
            return loss

        guard.step(closure, batch=batch)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _equal_across_ranks(model) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(tdist.get_world_size())]
    tdist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _bad_data_ddp(rank, world, tmp):
    model = _model()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = ng.Guard(ddp, opt, run_dir=tmp)
    _loop(model, ddp, opt, guard, rank, steps=5, bad_step=2)
    guard.close()
    diag = guard.last_diagnosis
    return {
        "skipped": guard.skipped,
        "diag": diag.to_dict(),
        "equal": _equal_across_ranks(model),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }


def test_bad_data_on_rank_1_under_ddp(tmp_path) -> None:
    results = spawn_ranks(_bad_data_ddp, tmp_path)
    for r in results:
        assert r["skipped"] == 1 and r["equal"] and r["finite"]
        d = r["diag"]
        assert (d["cause"], d["rank"], d["ranks"], d["step"], d["phase"]) == ("data.nonfinite", 1, [1], 2, "data")
        assert d["evidence"]["flagged_ranks"] == [1]
    for rank in (0, 1):
        events = list(read_events(tmp_path / f"events-rank{rank}.jsonl"))
        trip = next(e for e in events if e["kind"] == "trip")
        assert trip["rank"] == rank and trip["step"] == 2 and trip["diagnosis"]["rank"] == 1


def _transient(rank, world, tmp):
    model = _model()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    hook = CorruptOnce(at_call=3)
    guard = ng.Guard(ddp, opt, comm_hook=(None, hook))
    _loop(model, ddp, opt, guard, rank, steps=4)
    return {"skipped": guard.skipped, "diag": guard.last_diagnosis.to_dict(), "equal": _equal_across_ranks(model)}


def test_transient_corruption_of_synchronized_gradients(tmp_path) -> None:
    for r in spawn_ranks(_transient, tmp_path):
        assert r["skipped"] == 1 and r["equal"]
        d = r["diag"]
        assert d["cause"] == "distributed.transient" and d["phase"] == "communication"
        assert d["evidence"]["flagged_ranks"] == []


def _replicas(rank, world, tmp):
    model = _model()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = ng.Guard(ddp, opt, fingerprint_every=1)
    _loop(model, ddp, opt, guard, rank, steps=2)
    if rank == 1:
        with torch.no_grad():
            model.blocks[1].mlp.fc.weight.add_(1e-3)  # a rank-local change DDP never sees
    _loop(model, ddp, opt, guard, rank, steps=1)
    diag = guard.last_diagnosis
    return {"diag": diag.to_dict() if diag else None, "equal_after": _equal_across_ranks(model)}


def test_replica_divergence_is_named_and_repaired(tmp_path) -> None:
    for r in spawn_ranks(_replicas, tmp_path):
        d = r["diag"]
        assert d is not None and d["cause"] == "distributed.replica_divergence"
        assert d["rank"] == 1 and d["evidence"]["first_parameter"] == "blocks.1.mlp.fc.weight"
        assert r["equal_after"]


def _fsdp(rank, world, tmp):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = ng.Guard(model, opt)
    _loop(model, model, opt, guard, rank, steps=4, bad_step=1)
    finite = all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())
    return {"skipped": guard.skipped, "diag": guard.last_diagnosis.to_dict(), "finite": finite}


def test_fsdp2_bad_data_on_one_rank(tmp_path) -> None:
    for r in spawn_ranks(_fsdp, tmp_path):
        assert r["skipped"] == 1 and r["finite"]
        d = r["diag"]
        assert (d["cause"], d["rank"], d["ranks"]) == ("data.nonfinite", 1, [1])


def _rollback(rank, world, tmp):
    model = _model()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = ng.Guard(ddp, opt, policy="rollback", snapshot_every=2, rollback_skip_batches=1)
    _loop(model, ddp, opt, guard, rank, steps=7, bad_step=3, bad_ranks=(0,))
    return {"rollbacks": guard.rollbacks, "equal": _equal_across_ranks(model), "action": guard.last_action}


def test_rollback_under_ddp_keeps_replicas_equal(tmp_path) -> None:
    for r in spawn_ranks(_rollback, tmp_path):
        assert r["rollbacks"] == 1 and r["equal"] and r["action"] == "step"


def _check_batch_one_rank(rank, world, tmp):
    model = _model(vision=False)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = ng.Guard(ddp, opt, check_batch=True)

    def spoil(batch):
        batch["input_ids"][0, 0] = model.config.vocab_size  # would raise inside rank 1's forward

    _loop(model, ddp, opt, guard, rank, steps=4, bad_step=1, spoil=spoil)
    return {"skipped": guard.skipped, "diag": guard.last_diagnosis.to_dict(), "equal": _equal_across_ranks(model)}


def test_check_batch_on_one_rank_is_agreed_before_the_forward(tmp_path) -> None:
    for r in spawn_ranks(_check_batch_one_rank, tmp_path):
        assert r["skipped"] == 1 and r["equal"]
        d = r["diag"]
        assert (d["cause"], d["rank"], d["ranks"], d["step"], d["phase"]) == (
            "data.index_out_of_range",
            1,
            [1],
            1,
            "data",
        )


def _manual_allreduce(rank, world, tmp):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = ng.Guard(model, opt)

    def all_reduce_grads():  # a hand-written data-parallel loop, no DDP
        for p in model.parameters():
            tdist.all_reduce(p.grad)
            p.grad /= world

    _loop(model, model, opt, guard, rank, steps=4, bad_step=2, after_backward=all_reduce_grads)
    return {"skipped": guard.skipped, "diag": guard.last_diagnosis.to_dict(), "equal": _equal_across_ranks(model)}


def test_plain_all_reduce_loop_attributes_by_the_local_loss(tmp_path) -> None:
    for r in spawn_ranks(_manual_allreduce, tmp_path):
        assert r["skipped"] == 1 and r["equal"]
        d = r["diag"]
        assert (d["cause"], d["rank"], d["ranks"], d["evidence"]["flagged_ranks"]) == ("data.nonfinite", 1, [1], [1])


def test_torchrun_end_to_end(tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    script = str(ROOT / "examples" / "ddp_train.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        script,
        "--run-dir",
        str(tmp_path),
        "--steps",
        "5",
        "--bad-step",
        "2",
    ]
    # Its own session, so a hang kills torchrun's workers too, not only torchrun.
    popen = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = popen.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        stdout, stderr = popen.communicate()
        pytest.fail(f"torchrun hung past 180 s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "data.nonfinite" in proc.stdout and re.search(r"rank\s+1\n", proc.stdout)
    for rank in (0, 1):
        kinds = [e["kind"] for e in read_events(tmp_path / f"events-rank{rank}.jsonl")]
        assert kinds.count("trip") == 1 and kinds.count("step") == 5


def _fails_on_rank_1(rank, world, tmp):
    if rank == 1:
        raise KeyError("boom on rank 1")
    return {"rank": rank}


def _hangs_on_rank_1(rank, world, tmp):
    if rank == 1:
        time.sleep(3600)
    return {"rank": rank}


def test_spawn_reports_a_rank_traceback_to_the_parent(tmp_path) -> None:
    with pytest.raises(RanksFailed) as info:
        spawn_ranks(_fails_on_rank_1, tmp_path, timeout=120)
    text = str(info.value)
    assert "rank 1 failed" in text and "KeyError: 'boom on rank 1'" in text and "_fails_on_rank_1" in text


def test_spawn_stops_a_hung_rank_at_the_deadline(tmp_path) -> None:
    with pytest.raises(RanksFailed, match=r"rank 1: no result before the deadline \(20s"):
        spawn_ranks(_hangs_on_rank_1, tmp_path, timeout=20)


def _fault_placement(rank, world, tmp, mode, placements):
    """For each set of bad ranks in ``placements``: a fresh model under ``mode``, NaN pixels on those ranks."""
    return [_placement_run(rank, world, mode, bad) for bad in placements]


def _placement_run(rank, world, mode, bad):
    model = _model(n_embd=32)
    after = None
    if mode == "ddp":
        wrapped = DDP(model)
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        wrapped = fully_shard(model)
    else:
        wrapped = model

        def after():
            for p in model.parameters():
                tdist.all_reduce(p.grad)
                p.grad /= world

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = ng.Guard(wrapped, opt, module_stats=False)
    _loop(model, wrapped, opt, guard, rank, steps=2, bad_step=1, bad_ranks=bad, after_backward=after)
    d = guard.last_diagnosis
    return {"skipped": guard.skipped, "diag": d.to_dict() if d else None}


PLACEMENTS = [[0], [2], [1, 3]]


@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "allreduce"])
def test_rank_attribution_wherever_the_fault_lands(tmp_path, mode) -> None:
    results = spawn_ranks(_fault_placement, tmp_path, mode, PLACEMENTS, world=4, timeout=120)
    for per_rank in results:
        for bad, r in zip(PLACEMENTS, per_rank, strict=True):
            assert r["skipped"] == 1, (bad, r)
            d = r["diag"]
            assert (d["cause"], d["rank"], d["ranks"], d["step"]) == ("data.nonfinite", bad[0], bad, 1), (bad, d)
            assert d["evidence"]["flagged_ranks"] == bad


def _nanogpt_loop(rank, world, tmp):
    """nanoGPT's loop: gradient accumulation that toggles ``require_backward_grad_sync`` itself,
    checked with ``guard.check``; rank 1's first micro-batch at step 1 holds NaN pixels."""
    from nanguard.rng import get_rng_state

    model = _model(n_embd=32)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = ng.Guard(ddp, opt, module_stats=False)
    accum, skips_at = 2, []

    def forward_backward(batches: list[dict]) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        for micro, batch in enumerate(batches):
            ddp.require_backward_grad_sync = micro == accum - 1
            _, loss = ddp(**batch)
            (loss / accum).backward()
        return loss

    for step in range(4):
        # The step's micro-batches are fetched before it, so the replay re-runs them (a NaN
        # written while building one inside the replay would be the replay's own op.nan_write).
        batches = [_batch(model, rank, step * accum + m, bad=(step, m, rank) == (1, 0, 1)) for m in range(accum)]
        rng = get_rng_state()
        loss = forward_backward(batches)
        if guard.check(loss, replay=lambda batches=batches: forward_backward(batches), rng=rng):
            opt.step()
            guard.after_step()
        else:
            skips_at.append(step)
    return {"skips_at": skips_at, "diag": guard.last_diagnosis.to_dict(), "equal": _equal_across_ranks(model)}


def test_a_loop_that_toggles_grad_sync_replays_without_communication(tmp_path) -> None:
    for r in spawn_ranks(_nanogpt_loop, tmp_path, timeout=120):
        assert r["skips_at"] == [1] and r["equal"], r
        d = r["diag"]
        assert (d["cause"], d["rank"], d["ranks"], d["step"]) == ("data.nonfinite", 1, [1], 1), d


class _TwoPath(torch.nn.Module):
    """``side`` is used only where the caller says: under DDP, a weight one rank may leave unused."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.main = torch.nn.Linear(8, 8)
        self.side = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        y = self.main(x)
        return (y + self.side(x) if use_side else y).pow(2).mean()


def _resync(rank, world, tmp, nan_ranks, policy):
    """Rank 0 uses ``side`` at steps 0-1; before step 2 ``nan_ranks`` write NaN into it; step 2
    leaves it unused, so only the fingerprint check sees the NaN; step 3 uses it again."""
    model = _TwoPath()
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    guard = ng.Guard(ddp, opt, policy=policy, fingerprint_every=1, snapshot_every=1)
    error = None
    try:
        for step in range(4):
            if step == 2 and rank in nan_ranks:
                with torch.no_grad():
                    model.side.weight[0, 0] = float("nan")
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))

            def closure(x=x, use=rank == 0 and step != 2):
                opt.zero_grad(set_to_none=True)
                loss = ddp(x, use)
                loss.backward()
                return loss

            guard.step(closure)
    except ng.NonFiniteError as err:
        error = err.diagnosis.cause
    d = guard.last_diagnosis
    return {
        "diag": d.to_dict() if d else None,
        "error": error,
        "steps": guard.step_count,
        "skipped": guard.skipped,
        "rollbacks": guard.rollbacks,
        "equal": _equal_across_ranks(model),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }


def test_resync_copies_from_a_finite_rank_never_spreading_a_nan(tmp_path) -> None:
    for r in spawn_ranks(_resync, tmp_path, [0], "skip", timeout=120):
        d = r["diag"]
        assert (d["cause"], d["rank"], d["ranks"]) == ("distributed.replica_divergence", 0, [0]), d
        assert d["evidence"]["source_rank"] == 1 and d["evidence"]["nonfinite_ranks"] == [0]
        assert d["evidence"]["first_parameter"] == "side.weight"
        assert r["error"] is None and r["steps"] == 4 and r["skipped"] == 0 and r["equal"] and r["finite"], r


def test_no_finite_replica_raises_on_every_rank_at_once(tmp_path) -> None:
    for r in spawn_ranks(_resync, tmp_path, [0, 1], "skip", timeout=120):
        assert r["error"] == "distributed.replica_divergence" and r["steps"] == 3, r
        d = r["diag"]
        assert d["ranks"] == [0, 1] and d["evidence"]["source_rank"] is None


def test_no_finite_replica_rolls_back_under_the_rollback_policy(tmp_path) -> None:
    for r in spawn_ranks(_resync, tmp_path, [0, 1], "rollback", timeout=120):
        assert r["error"] is None and r["rollbacks"] == 1 and r["equal"] and r["finite"], r


def _fp16_wire(rank, world, tmp, big_ranks):
    """fp16 compression hook; at step 1 the ranks in ``big_ranks`` feed inputs x1e4, so their
    local gradients (finite in float32) exceed float16's 65504."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    model = _TwoPath()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = ng.Guard(ddp, opt, comm_hook=(None, fp16_compress_hook), module_stats=False)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
        if step == 1 and rank in big_ranks:
            x = x * 1e4

        def closure(x=x):
            opt.zero_grad(set_to_none=True)
            loss = ddp(x, True)
            loss.backward()
            return loss

        guard.step(closure)
    d = guard.last_diagnosis
    return {"skipped": guard.skipped, "diag": d.to_dict() if d else None, "equal": _equal_across_ranks(model)}


def test_fp16_compression_overflow_is_named_as_communication_precision(tmp_path) -> None:
    for r in spawn_ranks(_fp16_wire, tmp_path, [0], timeout=120):
        assert r["skipped"] == 1 and r["equal"], r
        d = r["diag"]
        assert (d["cause"], d["phase"], d["kind"], d["rank"], d["ranks"], d["step"]) == (
            "precision.overflow",
            "communication",
            "inf",
            0,
            [0],
            1,
        ), d
        assert "main.weight" in d["evidence"]["parameters"] and d["evidence"]["wire_dtype"] == "float16"
        assert d["evidence"]["absmax"] > 65504


def _fsdp_shard_nan(rank, world, tmp, repeats):
    """FSDP2 on 4 ranks: rank 2 writes a NaN into its own shard of one weight; ``repeats`` fresh runs."""
    return [_shard_run(rank) for _ in range(repeats)]


def _shard_run(rank):
    from torch.distributed.fsdp import fully_shard

    model = _model(n_embd=32)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = ng.Guard(model, opt, module_stats=False)
    for step in range(2):
        if step == 1 and rank == 2:
            with torch.no_grad():
                model.blocks[1].mlp.fc.weight.to_local()[0, 0] = float("nan")
        batch = _batch(model, rank, step)

        def closure(batch=batch):
            opt.zero_grad(set_to_none=True)
            _, loss = model(**batch)
            loss.backward()
            return loss

        try:
            guard.step(closure, batch=batch)
        except ng.NonFiniteError as err:  # a skip cannot repair a parameter: the skip policy escalates at once
            return {"skipped": guard.skipped, "raised": True, "diag": err.diagnosis.to_dict()}
    return {"skipped": guard.skipped, "raised": False, "diag": guard.last_diagnosis.to_dict()}


def test_fsdp2_nan_in_one_ranks_shard_is_attributed_to_that_rank(tmp_path) -> None:
    results = spawn_ranks(_fsdp_shard_nan, tmp_path, 3, world=4, timeout=120)
    for per_rank in results:
        for r in per_rank:
            d = r["diag"]
            assert r["raised"] and r["skipped"] == 0, r
            assert (d["cause"], d["phase"], d["rank"], d["ranks"], d["module"], d["step"]) == (
                "parameters.nonfinite",
                "parameters",
                2,
                [2],
                "blocks.1.mlp.fc",
                1,
            ), d
            assert d["evidence"]["parameters"] == ["blocks.1.mlp.fc.weight"]


def _persistent_nan(rank, world, tmp):
    """From step 1 rank 1's ``main.weight`` holds a NaN that no skip removes."""
    model = _TwoPath()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = ng.Guard(ddp, opt, max_consecutive_skips=3, module_stats=False)
    raised_at = cause = None
    for step in range(6):
        if step == 1 and rank == 1:
            with torch.no_grad():
                model.main.weight[0, 0] = float("nan")
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))

        def closure(x=x):
            opt.zero_grad(set_to_none=True)
            loss = ddp(x, True)
            loss.backward()
            return loss

        try:
            guard.step(closure)
        except ng.NonFiniteError as err:
            raised_at, cause = step, err.diagnosis.cause
            break
    return {"raised_at": raised_at, "cause": cause, "skipped": guard.skipped, "rank": guard.last_diagnosis.rank}


def test_a_persistent_fault_escalates_on_every_rank_at_the_same_step(tmp_path) -> None:
    results = spawn_ranks(_persistent_nan, tmp_path, timeout=120)
    assert results[0] == results[1], results
    r = results[0]
    # A skip cannot repair a NaN parameter: every rank escalates at the first trip, none skips first.
    assert (r["raised_at"], r["cause"], r["skipped"], r["rank"]) == (1, "parameters.nonfinite", 0, 1), r


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier")


def _accumulate(ddp, x_of, micro_steps: int, sync_last: bool = True) -> torch.Tensor:
    """Gradient accumulation: the micro-steps before the last one under ``no_sync`` (the last one
    too unless ``sync_last``); returns the summed loss that backward ran on."""
    total = torch.zeros(())
    for micro in range(micro_steps):
        synced = sync_last and micro == micro_steps - 1
        with contextlib.nullcontext() if synced else ddp.no_sync():
            loss = ddp(x_of(micro), True) / micro_steps
            loss.backward()
        total = total + loss.detach()
    return total


def _collectives_per_step(rank, world, tmp, steps):
    """torch.distributed collectives called during ``steps`` healthy DDP steps, with and without the
    guard, for each way of driving it. Both run the Python all-reduce hook, so the difference is what
    the guard adds."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from nanguard import compat

    calls = {"n": 0}

    def counting(fn):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            return fn(*args, **kwargs)

        return wrapper

    def run(mode: str, guarded: bool) -> int:
        model = _TwoPath()
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        guard = ng.Guard(ddp, opt, fingerprint_every=0) if guarded else None
        if guard is None:
            ddp.register_comm_hook(None, allreduce_hook)
        calls["n"] = 0
        with compat.swap_collectives({name: counting(getattr(tdist, name)) for name in _COLLECTIVES}):
            for step in range(steps):

                def x_of(micro, step=step):
                    return torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step * 10 + micro))

                def closure():
                    opt.zero_grad(set_to_none=True)
                    if mode == "step":
                        return _accumulate(ddp, x_of, 1)
                    return _accumulate(ddp, x_of, 2, sync_last=mode != "all no_sync")

                if guard is None:
                    closure()
                    opt.step()
                elif mode == "check":
                    loss = closure()
                    assert guard.check(loss)
                    opt.step()
                    guard.after_step()
                else:
                    assert guard.step(closure) is not None
        return calls["n"]

    modes = ("step", "accumulate", "check", "all no_sync")
    return {mode: (run(mode, False), run(mode, True)) for mode in modes}


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_the_guard_adds_per_healthy_ddp_step(tmp_path, world) -> None:
    steps = 3
    for r in spawn_ranks(_collectives_per_step, tmp_path, steps, world=world, timeout=120):
        plain, guarded = r["step"]
        assert plain >= steps, r  # the count sees DDP's own gradient all-reduce
        # guard.step: the flags ride in DDP's last gradient bucket (2 ranks: in its payload with the
        # loss; 3 or more: a flagging rank's NaN in it).
        assert guarded == plain, r
        assert r["accumulate"][1] == r["accumulate"][0] >= steps, r  # no_sync micro-steps, then one synced
        # The fallbacks: check(loss) learns the loss after backward; no hook ran when every micro-step
        # is under no_sync. Each adds the one small all-reduce.
        for mode in ("check", "all no_sync"):
            plain, guarded = r[mode]
            assert (guarded - plain) / steps == 1, (mode, r)


def _loss_riding(rank, world, tmp):
    """Two micro-steps per step (the first under no_sync). Step 2: rank 1's loss is NaN through a
    detached term while its gradients stay finite. Step 3: rank 0's no_sync micro-batch is NaN."""
    model = _TwoPath()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = ng.Guard(ddp, opt, fingerprint_every=0, module_stats=False)
    returned, trips = [], {}
    for step in range(5):

        def closure(step=step):
            opt.zero_grad(set_to_none=True)
            total = torch.zeros(())
            for micro in range(2):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step * 10 + micro))
                if (step, micro, rank) == (3, 0, 0):
                    x[0, 0] = float("nan")
                with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                    loss = ddp(x, True) / 2
                    if (step, micro, rank) == (2, 1, 1):
                        loss = loss + torch.log(torch.tensor(-1.0))  # NaN, but no gradient flows through it
                    loss.backward()
                total = total + loss.detach()
            return total

        result = guard.step(closure)
        returned.append(None if result is None else float(result))
        if result is None:
            d = guard.last_diagnosis
            trips[str(step)] = [d.rank, d.ranks, d.evidence["flagged_ranks"]]  # as JSON returns it
    every_rank = [None] * world
    tdist.all_gather_object(every_rank, returned)
    return {
        "every_rank": every_rank,
        "history": [(p.step, p.loss) for p in guard.history],
        "trips": trips,
        "equal": _equal_across_ranks(model),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }


def test_the_loss_rides_in_the_gradient_all_reduce(tmp_path) -> None:
    results = spawn_ranks(_loss_riding, tmp_path, timeout=120)
    assert results[0]["history"] == results[1]["history"] and results[0]["trips"] == results[1]["trips"]
    r = results[0]
    # The NaN loss with finite gradients skips on every rank; so does the NaN in a no_sync micro-step.
    assert r["trips"] == {"2": [1, [1], [1]], "3": [0, [0], [0]]}, r
    assert r["equal"] and r["finite"], r
    assert [s for s, _ in r["history"]] == [0, 1, 4], r
    for step, loss in r["history"]:  # the mean over ranks of the loss each rank's backward ran on
        mean = sum(ranks[step] for ranks in r["every_rank"]) / 2
        assert abs(loss - mean) <= 1e-6 * abs(mean), (step, loss, mean)


def _local_change_after_the_all_reduce(rank, world, tmp):
    """At step 1 rank 1 alone writes a NaN into its averaged gradient after backward: no collective
    could share that in time, so the ranks must still decide alike (and nobody may hang)."""
    model = _TwoPath()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = ng.Guard(ddp, opt, module_stats=False, fingerprint_every=0)
    actions = []
    try:
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))

            def closure(x=x, step=step):
                opt.zero_grad(set_to_none=True)
                loss = ddp(x, True)
                loss.backward()
                if (step, rank) == (1, 1):
                    model.main.weight.grad[0, 0] = float("nan")
                return loss

            guard.step(closure)
            actions.append(guard.last_action)
    except ng.NonFiniteError as err:
        d = err.diagnosis
        return {"actions": actions, "raised": [len(actions), d.cause, d.rank, d.ranks]}
    return {"actions": actions, "raised": None}


def test_a_rank_local_change_after_the_all_reduce_splits_no_decision(tmp_path) -> None:
    results = spawn_ranks(_local_change_after_the_all_reduce, tmp_path, timeout=120)
    assert results[0] == results[1], results
    # Seen one step late, alike on every rank: the next parameter check finds rank 1's NaN update.
    assert results[0] == {"actions": ["step", "step"], "raised": [2, "optimizer.nonfinite_update", 1, [1]]}, results


def _scaled_riding(rank, world, tmp):
    """A GradScaler: backward runs on the scaled loss; at step 1 rank 1's loss alone is NaN."""
    model = _TwoPath()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = ng.Guard(ddp, opt, scaler=scaler, fingerprint_every=0, module_stats=False)
    returned = []
    for step in range(3):

        def closure(step=step):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
            loss = ddp(x, True)
            if (step, rank) == (1, 1):
                loss = loss + torch.log(torch.tensor(-1.0))
            scaler.scale(loss).backward()
            return loss

        result = guard.step(closure)
        returned.append(None if result is None else float(result))
    every_rank = [None] * world
    tdist.all_gather_object(every_rank, returned)
    d = guard.last_diagnosis
    return {"every_rank": every_rank, "history": [(p.step, p.loss) for p in guard.history], "ranks": d.ranks}


def test_the_riding_loss_is_unscaled_under_a_grad_scaler(tmp_path) -> None:
    results = spawn_ranks(_scaled_riding, tmp_path, timeout=120)
    assert results[0] == results[1]
    r = results[0]
    assert r["ranks"] == [1] and [s for s, _ in r["history"]] == [0, 2], r
    for step, loss in r["history"]:
        mean = sum(ranks[step] for ranks in r["every_rank"]) / 2
        assert abs(loss - mean) <= 1e-6 * abs(mean), (step, loss, mean)


def test_backward_roots_records_each_backward_and_always_unpatches() -> None:
    from nanguard.dist import backward_roots

    original = torch.autograd.backward
    w = torch.ones(2, requires_grad=True)
    with backward_roots() as roots:
        first = (w * 2).sum()
        first.backward()
        second = (w * 3).sum()
        torch.autograd.backward([second])
    assert len(roots) == 2 and roots[0] is first and roots[1] is second
    assert torch.autograd.backward is original
    with pytest.raises(RuntimeError), backward_roots():
        torch.ones(1).backward()  # no graph: backward raises inside the patch
    assert torch.autograd.backward is original
