"""Harmless by construction (issue 31): a healthy step runs the user's code once through every
entry point, headroom reads only the values ops compute, and the guard prints nothing of its own
on a healthy run."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: models come from configs

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nanguard as ng
from nanguard.events import read_events
from nanguard.integrations.loop import LoopGuard
from nanguard.tracer.headroom import measure_headroom

STEPS = 4


class Net(nn.Module):
    """A bfloat16 model whose forward returns its loss: headroom has low-precision outputs to read."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 1))
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x.to(torch.bfloat16)).float(), y)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=gen)
    return x, x.sum(1, keepdim=True)


def _count_forwards(model: nn.Module) -> list[int]:
    calls: list[int] = []
    model.register_forward_pre_hook(lambda m, args: calls.append(1) if torch.is_grad_enabled() else None)
    return calls


def _headroom_steps(run_dir: Path) -> set[int]:
    events = read_events(next(run_dir.glob("events*.jsonl")))
    return {e["step"] for e in events if e["kind"] == "headroom" and e["dtype"] == "bfloat16"}


# -- item 1: one run of the user's step, headroom measured on the step itself ------------------
def test_guard_step_runs_the_closure_once_and_measures_headroom_as_it_runs(tmp_path: Path) -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    forwards = _count_forwards(model)
    guard = ng.Guard(model, optimizer, headroom_every=1, run_dir=tmp_path)
    closures = []
    for step in range(STEPS):
        x, y = _batch(step)

        def closure(x=x, y=y):
            closures.append(1)
            optimizer.zero_grad()
            loss = model(x, y)
            loss.backward()
            return loss

        assert guard.step(closure) is not None
    guard.close()
    assert len(closures) == len(forwards) == STEPS
    assert _headroom_steps(tmp_path) == set(range(STEPS))


def test_guard_step_on_a_compiled_model_runs_the_closure_once() -> None:
    torch._dynamo.reset()
    model = Net()
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = ng.Guard(compiled, optimizer, headroom_every=1)
    closures = []
    for step in range(2):
        x, y = _batch(step)

        def closure(x=x, y=y):
            closures.append(1)
            optimizer.zero_grad()
            loss = compiled(x, y)
            loss.backward()
            return loss

        assert guard.step(closure) is not None
    assert len(closures) == 2  # a compiled step is never run again to be measured


def test_guard_check_never_calls_replay_on_a_healthy_step_and_measures_the_next_forward(tmp_path: Path) -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    forwards = _count_forwards(model)
    hooks = len(model._forward_pre_hooks), len(model._forward_hooks)
    guard = ng.Guard(model, optimizer, headroom_every=1, run_dir=tmp_path)
    replays = []
    for step in range(STEPS):
        x, y = _batch(step)
        optimizer.zero_grad()
        loss = model(x, y)
        loss.backward()
        assert guard.check(loss, replay=lambda: replays.append(1), batch=(x, y))
        optimizer.step()
        guard.after_step()
    guard.close()
    assert replays == [] and len(forwards) == STEPS
    # The forward of step 0 ran before the guard saw a check: measured from step 1 on, as each ran.
    assert _headroom_steps(tmp_path) == set(range(1, STEPS))
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == hooks  # closed: nothing left armed


def test_an_evaluation_forward_between_checks_is_not_measured_as_the_next_step(tmp_path: Path) -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = ng.Guard(model, optimizer, headroom_every=1, run_dir=tmp_path)
    for step in range(2):
        x, y = _batch(step)
        optimizer.zero_grad()
        loss = model(x, y)
        loss.backward()
        assert guard.check(loss)
        optimizer.step()
        guard.after_step()
        model.eval()
        with torch.no_grad():
            model(x.clamp(-1, 1) * 2e38, y)  # an evaluation forward, between the steps, close to overflow
        model.train()
    guard.close()
    events = read_events(next(tmp_path.glob("events*.jsonl")))
    measured = [e for e in events if e["kind"] == "headroom"]
    assert {e["step"] for e in measured} == {1} and not any(e["close"] for e in measured)


def test_loop_guard_runs_each_forward_once(tmp_path: Path) -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    forwards = _count_forwards(model)
    with LoopGuard(model, optimizer, headroom_every=1, run_dir=tmp_path) as guard:
        for step in range(STEPS):
            optimizer.zero_grad()
            model(*_batch(step)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    assert guard.guard is not None and guard.guard.step_count == STEPS and guard.skipped == 0
    assert len(forwards) == STEPS
    assert _headroom_steps(tmp_path) == set(range(1, STEPS))


def test_fabric_guard_runs_each_forward_once(tmp_path: Path) -> None:
    import lightning as L

    from nanguard.integrations.fabric import FabricGuard

    fabric = L.Fabric(accelerator="cpu", devices=1)
    user = Net()
    forwards = _count_forwards(user)
    model, optimizer = fabric.setup(user, torch.optim.SGD(user.parameters(), lr=1e-2))
    with FabricGuard(fabric, model, optimizer, headroom_every=1, run_dir=tmp_path) as guard:
        for step in range(STEPS):
            fabric.backward(model(*_batch(step)))
            optimizer.step()
            optimizer.zero_grad()
    assert guard.guard is not None and guard.guard.step_count == STEPS and guard.skipped == 0
    assert len(forwards) == STEPS
    assert _headroom_steps(tmp_path) == set(range(1, STEPS))


def test_hf_trainer_runs_each_forward_once(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from torch.utils.data import Dataset

    from nanguard.integrations.hf import NanGuardCallback

    class Samples(Dataset):
        def __len__(self) -> int:
            return 2 * STEPS

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            gen = torch.Generator().manual_seed(i)
            ids = torch.randint(64, (8,), generator=gen)
            return {"input_ids": ids, "labels": ids}

    model = _hf_gpt2(transformers, dropout=0.1).to(torch.bfloat16)
    forwards = _count_forwards(model)
    callback = NanGuardCallback(headroom_every=1, run_dir=tmp_path / "run")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=STEPS,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    transformers.Trainer(model=model, args=args, train_dataset=Samples(), callbacks=[callback]).train()
    assert callback.guard is not None and callback.guard.step_count == STEPS and callback.skipped == 0
    assert len(forwards) == STEPS
    assert _headroom_steps(tmp_path / "run") == set(range(1, STEPS))


class _CountComms(TorchDispatchMode):
    """Collectives dispatched while entered (DTensor's redistributions and c10d's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor")
        return func(*args, **(kwargs or {}))


def tp_headroom_run(rank: int, world: int, entry: str, run_dir: str) -> dict[str, Any]:
    """A bfloat16 tensor-parallel MLP (DTensor op outputs inside its layers), headroom every 2nd step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)).to(torch.bfloat16)
    parallelize_module(model, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    comms, replays = [], []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        guard = ng.Guard(model, optimizer, "rollback", headroom_every=2, run_dir=Path(run_dir) / str(rank))
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            counter = _CountComms()
            if entry == "step":

                def closure(x=x):
                    optimizer.zero_grad()
                    loss = model(x).float().pow(2).mean()
                    loss.backward()
                    return loss

                with counter:
                    assert guard.step(closure) is not None
            else:
                optimizer.zero_grad()
                with counter:
                    loss = model(x).float().pow(2).mean()
                    loss.backward()
                assert guard.check(loss, replay=lambda: replays.append(1))
                optimizer.step()
                guard.after_step()
            comms.append(counter.count)
        guard.close()
    events = read_events(Path(run_dir) / str(rank) / f"events-rank{rank}.jsonl")
    measured = sorted({e["step"] for e in events if e["kind"] == "headroom"})
    return {"comms": comms, "replays": len(replays), "measured": measured, "warnings": [str(w.message) for w in seen]}


@pytest.mark.dist
@pytest.mark.parametrize("entry", ["step", "check"])
def test_headroom_under_tensor_parallel_reads_each_ranks_shard_and_communicates_nothing(entry: str, tmp_path) -> None:
    from nanguard.zoo.spawn import spawn_ranks

    for r in spawn_ranks(tp_headroom_run, entry, str(tmp_path), world=2, timeout=240):
        assert r["replays"] == 0 and r["warnings"] == [], r
        assert r["measured"] == ([0, 2] if entry == "step" else [2]), r  # check(): from its second step on
        assert r["comms"][0] == r["comms"][1] == r["comms"][2] == r["comms"][3], r  # measured steps add none


# -- item 2: headroom reads the values ops compute, nothing else -------------------------------
_BLANK = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}


class _Garbage(TorchDispatchMode):
    """Uninitialised memory made visible and the same on every run: each blank allocation
    (``empty_like``: dropout's mask, an ``out=`` buffer) holds the dtype's largest finite value
    until an op writes it."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        blank = func.overloadpacket.__name__ in _BLANK
        if blank and isinstance(out, torch.Tensor) and out.is_floating_point():
            out.fill_(torch.finfo(out.dtype).max / 2)
        return out


def _hf_gpt2(transformers: Any, *, dropout: float, attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=8,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        attn_implementation=attn,
    )
    return transformers.GPT2LMHeadModel(config)


def _close(model: nn.Module, run: Any) -> list[tuple[str, float]]:
    with measure_headroom(model) as found, _Garbage():
        run()
    return [(h.module, h.absmax) for h in found if h.close]


def test_headroom_never_reads_memory_no_op_has_written() -> None:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True).to(torch.bfloat16)
    x = torch.randn(4, 8, 32).to(torch.bfloat16)
    assert _close(layer, lambda: layer(x).float().pow(2).mean().backward()) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_healthy_hf_gpt2_with_dropout_is_not_close_to_overflow(dtype: torch.dtype, attn: str) -> None:
    transformers = pytest.importorskip("transformers")
    model = _hf_gpt2(transformers, dropout=0.1, attn=attn).to(dtype)
    ids = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(0))
    assert _close(model, lambda: model(input_ids=ids, labels=ids).loss.backward()) == []


def test_a_value_at_the_dtypes_limit_is_a_fill_and_values_below_it_are_measured() -> None:
    class Masked(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            fill = torch.finfo(x.dtype).min  # a mask value, as -inf is: not a computed value coming close
            return torch.where(x > 0, x * 1e38, fill).softmax(-1)

    model = Masked()
    with measure_headroom(model) as found:
        model(torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.bfloat16))
    close = {h.module: h.absmax for h in found if h.close}
    assert 1.9e38 < close[""] < torch.finfo(torch.bfloat16).max  # 2 * 1e38 computed and measured, the fill not


def test_a_partly_written_blank_buffer_is_not_read_but_a_computed_value_close_to_the_limit_is(caplog) -> None:
    class Net16(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            buf = torch.empty(8, dtype=x.dtype)  # an out= buffer, written after the mode sees it
            torch.mul(x, 2, out=buf)
            return buf * 3000.0  # 6 * 3000 = 18000 > 65504 / 8: close

    model = Net16()
    with measure_headroom(model) as found, _Garbage():
        model(torch.full((8,), 6.0, dtype=torch.float16) / 2)
    assert [(h.module, h.absmax) for h in found if h.close] == [("", 18000.0)]


def fsdp2_headroom_run(rank: int, world: int) -> list[tuple[str, float]]:
    """An FSDP2 MLP computing in bfloat16 (its all-gather buffers start as blank allocations); what
    headroom reports close, with every blank allocation holding huge values."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 8))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[3]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    return _close(model, lambda: model(x).float().pow(2).mean().backward())


@pytest.mark.dist
def test_headroom_under_fsdp2_never_reads_its_all_gather_buffers() -> None:
    from nanguard.zoo.spawn import spawn_ranks

    assert spawn_ranks(fsdp2_headroom_run, world=2, timeout=240) == [[], []]


# -- item 3: NANGUARD_DISABLE=1 is the loop as written without nanguard ------------------------
def _amp_setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.5), torch.amp.GradScaler("cpu", init_scale=1024.0)


def _big_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step)
    return x, y * 100.0  # gradients far above the clip: a missing clip changes the weights


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _plain_amp_loop() -> tuple[list[torch.Tensor], list[float]]:
    """The reference: torch's own scaler and clip_grad_norm_, no nanguard anywhere."""
    model, optimizer, scaler = _amp_setup()
    norms = []
    for step in range(STEPS):
        x, y = _big_batch(step)
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        scaler.step(optimizer)
        scaler.update()
    return _weights(model), norms


@pytest.mark.parametrize("entry", ["step", "check", "loop_guard"])
def test_a_disabled_guard_keeps_the_clip_the_scaler_and_the_norm(entry: str, monkeypatch) -> None:
    expected, expected_norms = _plain_amp_loop()
    monkeypatch.setenv("NANGUARD_DISABLE", "1")
    model, optimizer, scaler = _amp_setup()
    norms = []
    if entry == "loop_guard":
        guard: Any = LoopGuard(model, optimizer, clip_grad_norm=1.0)
    else:
        guard = ng.Guard(model, optimizer, scaler=scaler if entry == "step" else None, clip_grad_norm=1.0)
    for step in range(STEPS):
        x, y = _big_batch(step)
        if entry == "step":

            def closure(x=x, y=y):
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                scaler.scale(loss).backward()
                return loss

            guard.step(closure)
        else:  # the loop owns backward and the optimizer step; the guard clips (after the scaler's unscale)
            optimizer.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            scaler.unscale_(optimizer)
            if entry == "check":
                assert guard.check(torch.zeros(()))
            scaler.step(optimizer)
            scaler.update()
        norms.append(guard.last_grad_norm)
    for a, b in zip(_weights(model), expected, strict=True):
        assert torch.equal(a, b)
    assert norms == expected_norms and max(norms) > 1.0  # the clip had work to do


def test_a_disabled_guard_without_a_clip_reads_the_loops_norm(monkeypatch) -> None:
    monkeypatch.setenv("NANGUARD_DISABLE", "1")
    model, optimizer, _ = _amp_setup()
    guard = ng.Guard(model, optimizer)
    x, y = _big_batch(0)

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    guard.step(closure)
    grads = [p.grad for p in model.parameters()]
    assert guard.last_grad_norm == float(torch.nn.utils.get_total_norm(grads))


# -- item 10: a healthy guarded run prints nothing the unguarded run does not ------------------
def healthy_run(rank: int, world: int, guarded: bool, policy: str) -> dict[str, Any]:
    """A healthy DDP (or single-process) loop; every warning raised while it builds and runs."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        model: nn.Module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        if world > 1:
            model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = ng.Guard(model, optimizer, policy) if guarded else None
        for step in range(STEPS):
            x, y = _batch(step * world + rank)

            def closure(x=x, y=y):
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            if guard is not None:
                assert guard.step(closure) is not None
            else:
                closure()
                optimizer.step()
        if guard is not None:
            guard.close()
    return {"warnings": sorted({f"{w.category.__name__}: {w.message}" for w in seen})}


def _in_a_fresh_process(guarded: bool, policy: str) -> list[str]:
    code = f"import json, test_harmless as t; print(json.dumps(t.healthy_run(0, 1, {guarded}, {policy!r})))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])["warnings"]


def test_a_healthy_guarded_run_warns_nothing_the_unguarded_run_does_not() -> None:
    # In a fresh interpreter: a warning that comes once, with an import, shows only in the first run of a process.
    assert _in_a_fresh_process(True, "rollback") == _in_a_fresh_process(False, "rollback")


@pytest.mark.dist
def test_a_healthy_guarded_ddp_run_under_rollback_warns_nothing_the_unguarded_run_does_not() -> None:
    from nanguard.zoo.spawn import spawn_ranks

    guarded = spawn_ranks(healthy_run, True, "rollback", world=2)
    plain = spawn_ranks(healthy_run, False, "rollback", world=2)
    assert guarded == plain


def test_a_healthy_guarded_run_logs_no_warning(tmp_path: Path, caplog) -> None:
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO, logger="nanguard"):
        guard = ng.Guard(model, optimizer, "rollback", run_dir=tmp_path, headroom_every=1)
        for step in range(STEPS):
            x, y = _batch(step)

            def closure(x=x, y=y):
                optimizer.zero_grad()
                loss = model(x, y)
                loss.backward()
                return loss

            assert guard.step(closure) is not None
        guard.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
