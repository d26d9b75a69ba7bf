"""The rank side of tests/test_integration_deepspeed.py: DeepSpeed engines on CPU with gloo, several
cases in sequence in one spawned group (each engine is built fresh; building one costs seconds)."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Any

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Net(nn.Module):
    """A tiny MLP whose middle module can be told to fault on this rank: ``log`` of a negative
    (an op fault), or a product past float16's range (an fp16 overflow)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.act = Act()
        self.out = nn.Linear(16, 4)

        self.outside = False  # return the outputs: the loop computes the loss outside the model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.out(self.act(self.inp(x)))
        if self.outside:
            return out
        loss = (out.float() - y).pow(2).mean()
        logged, self.act.logged = self.act.logged, None
        return loss if logged is None else loss + logged  # a term only logged: NaN in the loss, not the gradients


class Act(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fault: str | None = None
        self.logged: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.fault == "log":
            return torch.log(h - 10.0)
        if self.fault == "logged":
            self.logged = torch.log(h.detach() - 10.0).mean()
        if self.fault == "overflow":
            return h * 1e5  # past float16's max: Inf in float16, finite in float32
        if self.fault == "grad_overflow":
            return torch.tanh(_Amplified.apply(h))  # the backward alone overflows float16
        if self.fault == "grad_nan":
            return torch.tanh(_NanGrad.apply(h))  # the backward alone makes NaN
        return torch.tanh(h)


class _Amplified(torch.autograd.Function):
    """The identity forward; a backward that multiplies the gradient by 1e4 (past float16's range
    under the loss scale): the overflow DeepSpeed's scaler skips silently, every loss finite."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 1e4


class _NanGrad(torch.autograd.Function):
    """The identity forward; a NaN gradient in the backward (a fault only a backward can show)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class Regression(nn.Module):
    """Least squares on one linear layer: plain SGD at an LR far above 2 / (the largest curvature)
    multiplies the error every step (geometric growth, whatever the seed) until it overflows."""

    def __init__(self, total: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.total = total  # the squared errors summed, not averaged: the gradients outgrow the loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        errors = (self.fc(x).float() - y).pow(2)
        return errors.sum() if self.total else errors.mean()


def init(rank: int) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")


def engine_for(
    stage: int,
    dtype: str,
    *,
    lr: float = 1e-2,
    accum: int = 1,
    sgd: bool = False,
    kind: str = "mlp",
    clip: float | None = None,
    ds_optimizer: dict[str, Any] | None = None,
    offload: bool = False,
    nan_row: tuple[str, int] | None = None,
) -> Any:
    """A fresh engine on a seeded model. ``ds_optimizer``: the config's "optimizer" section (DeepSpeed
    builds it) instead of a torch optimizer; ``offload``: ZeRO's optimizer offloaded to the CPU;
    ``nan_row``: (module, row) of a weight NaN before ``deepspeed.initialize``, as a bad checkpoint loads it."""
    import deepspeed

    torch.manual_seed(0)
    model: nn.Module = Regression(kind == "regression_sum") if kind.startswith("regression") else Net()
    if nan_row is not None:
        with torch.no_grad():
            model.get_submodule(nan_row[0]).weight[nan_row[1]] = float("nan")
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accum,
        "zero_optimization": {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": sgd,
    }
    if clip is not None:  # DeepSpeed clips the gradient norm at 1.0 unless told otherwise
        config["gradient_clipping"] = clip
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
    elif dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if offload:  # DeepSpeedCPUAdam's C++ op, built on first use (minutes), kept in the virtualenv
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    if ds_optimizer is not None:
        config["optimizer"] = ds_optimizer
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return engine
    optimizer = torch.optim.SGD(model.parameters(), lr=lr) if sgd else torch.optim.AdamW(model.parameters(), lr=lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def batch(rank: int, index: int, dtype: str, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 1000 + index)
    return torch.randn(rows, 8, generator=g).to(DTYPES[dtype]), torch.randn(rows, 4, generator=g)


def weights(engine: Any) -> list[float]:
    """This rank's fp32 weights as the engine keeps them (ZeRO's partition, its padding left out), flat."""
    from nanguard.integrations.deepspeed import EngineState

    return torch.cat([p.detach().float().reshape(-1) for p in EngineState(engine).master_params()]).tolist()


def fill_padding(engine: Any, value: float) -> int:
    """Write ``value`` into the padding of this rank's ZeRO-3 partitions (fp32: the weights ZeRO steps), what
    DeepSpeed allocates with ``torch.empty`` and never writes: memory a GPU's allocator hands out again can hold
    NaN. A parameter whose size the ranks do not divide is padded at its end: the last ranks' partitions.
    Returns how many elements it wrote."""
    import torch.distributed as torch_dist

    zero, written = engine.optimizer, 0
    with torch.no_grad():
        for group, bit16, fp32 in zip(
            zero.fp16_groups, zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat, strict=True
        ):
            for p in group:
                size = p.partition_numel()
                real = max(0, min(size, p.ds_numel - size * torch_dist.get_rank()))
                at = (p.ds_tensor.data_ptr() - bit16.data_ptr()) // p.ds_tensor.element_size()  # the same in both
                for flat in (bit16, fp32):
                    flat[at + real : at + size] = value
                written += size - real
    return written


def run_case(rank: int, case: dict[str, Any]) -> dict[str, Any]:
    """One run: ``steps`` steps of a fresh engine, guarded (``policy``) or not; ``fault`` (or a list,
    ``faults``): (kind, rank, step[, micro-batch]) with kind "data" (a NaN in the batch), "log", "overflow"
    or "grad_overflow" (the module faults); ``accum``: DeepSpeed's gradient accumulation steps; ``padding``: a
    value written into ZeRO-3's padding (``fill_padding``)."""
    from nanguard.integrations.deepspeed import DeepSpeedGuard

    stage, dtype, accum = case["stage"], case["dtype"], case.get("accum", 1)
    kind = case.get("model", "mlp")
    engine = engine_for(
        stage,
        dtype,
        lr=case.get("lr", 1e-2),
        accum=accum,
        sgd=case.get("sgd", False),
        kind=kind,
        clip=case.get("clip"),
        ds_optimizer=case.get("ds_optimizer"),
        offload=case.get("offload", False),
        nan_row=case.get("nan_row"),
    )
    if case.get("padding") is not None:
        fill_padding(engine, case["padding"])
    refused = _refused(engine) if case.get("refuse") else None
    act = getattr(engine.module, "act", None)
    if case.get("outside"):
        engine.module.outside = True
    rows = 32 if kind.startswith("regression") else 4  # more rows than inputs: every direction has curvature
    forwards, backwards = [0], [0]  # the module's forwards, and backwards through its last layer
    engine.module.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    last = engine.module.out if kind == "mlp" else engine.module.fc
    last.register_full_backward_pre_hook(lambda *_: backwards.__setitem__(0, backwards[0] + 1))
    guard = None
    trips: list[dict[str, Any]] = []  # every trip event's diagnosis, in order
    said = _Said()  # what nanguard logged
    recorded: list[Any] = []  # the grad norm of every step event, and the engine's own after each step
    engine_norms: list[Any] = []

    def on_event(event: dict[str, Any]) -> None:
        if event["kind"] == "trip":
            trips.append(event["diagnosis"])
        if event["kind"] == "step":
            recorded.append(event.get("grad_norm"))

    if case.get("policy"):
        if case.get("disabled"):
            os.environ["NANGUARD_DISABLE"] = "1"
        try:
            guard = DeepSpeedGuard(engine, case["policy"], on_event=on_event, **case.get("options", {}))
        finally:
            os.environ.pop("NANGUARD_DISABLE", None)
    untouched = not any(name in vars(engine) for name in ("backward", "step", "forward")) and not (
        engine._forward_pre_hooks or engine._forward_hooks
    )
    faults = case.get("faults") or ([case["fault"]] if case.get("fault") else [])
    losses, error = [], None
    try:
        for step in range(case["steps"]):
            if step == case.get("drop"):
                continue  # the batch this run never sees
            here = next((f for f in faults if f[1] == rank and f[2] == step), None)
            for micro in range(accum):
                # A fault's optional 4th entry: the one micro-batch it hits (else every one of the step).
                fault = here[0] if here is not None and (len(here) < 4 or here[3] == micro) else None
                if act is not None:
                    act.fault = fault if fault != "data" else None
                x, y = batch(rank, step * accum + micro, dtype, rows)
                if fault == "data":
                    x[0, 0] = float("nan")
                if case.get("closure") and guard is not None:
                    loss = guard.step(_closure(engine, x, y))
                else:
                    loss = engine(x, y)
                    if case.get("outside"):  # the loss outside the model, no micro_step: the replay sees the forward
                        loss = (loss.float() - y).pow(2).mean()
                    engine.backward(loss)
                    engine.step()
            losses.append(float(loss))
            norm = engine.get_global_grad_norm()
            engine_norms.append(None if norm is None else float(norm))
    except Exception as err:
        error = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-6)}"
    if act is not None:
        act.fault = None
    scale = float(engine.optimizer.loss_scale) if dtype == "fp16" else None
    out: dict[str, Any] = {
        "weights": weights(engine),
        "losses": losses,
        "forwards": forwards[0],
        "backwards": backwards[0],
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "lr": engine.get_lr()[0],
        "error": error,
        "scale": scale,
        "refused": refused,
        "untouched": untouched,
        "recorded_norms": recorded,
        "engine_norms": engine_norms,
    }
    if guard is not None:
        out["trip_diagnoses"] = trips
        diag = guard.last_diagnosis
        out.update(skipped=guard.skipped, trips=guard.trips, diagnosis=diag.to_dict() if diag else None)
        out["overflows"] = guard.guard.overflows if guard.guard is not None else None
        out["rollbacks"] = guard.guard.rollbacks if guard.guard is not None else None
        out["last_overflow"] = guard.last_overflow.to_dict() if guard.last_overflow else None
        out["last_grad_norm"] = guard.last_grad_norm
        out["has_guard"] = guard.guard is not None
        guard.close()
    said.close()
    out["said"] = said.lines
    return out


def _closure(engine: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    """``ng.Guard.step``'s closure for an engine: forward and ``engine.backward``, the loss returned."""

    def closure() -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        return loss

    return closure


def _refused(engine: Any) -> str | None:
    """What ``ng.Guard(engine, optimizer)`` says (it must refuse: ZeRO's gradients are not ``.grad``)."""
    import nanguard as ng

    try:
        ng.Guard(engine, engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer)
    except ValueError as err:
        return str(err)
    return None


class _Said(logging.Handler):
    """The ``nanguard`` logger's lines while it is open."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logging.getLogger("nanguard").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def close(self) -> None:
        logging.getLogger("nanguard").removeHandler(self)
        super().close()


def run_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    init(rank)
    return [run_case(rank, case) for case in cases]


def run_trainer(rank: int, world: int, runs: list[dict[str, Any]], out_dir: str) -> list[dict[str, Any]]:
    """Hugging Face Trainer runs with a DeepSpeed config (ZeRO ``stage``, ``dtype`` fp32/bf16/fp16, ``accum``
    gradient accumulation steps), guarded by the HF callback (``policy``) or not; ``nan_at``: the index of a
    NaN sample (the Trainer deals samples to ranks)."""
    os.environ.update({"DS_ACCELERATOR": "cpu", "LOCAL_RANK": str(rank), "RANK": str(rank)})
    os.environ.update({"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"})
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return [_trainer_run(run, f"{out_dir}/{i}") for i, run in enumerate(runs)]


def _trainer_run(run: dict[str, Any], out_dir: str) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from nanguard.integrations.hf import NanGuardCallback

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=8, resid_pdrop=0.0)
    config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": run["stage"]},
        "steps_per_print": 10**9,
    }
    dtype = run.get("dtype", "fp32")
    if dtype != "fp32":  # "auto": from TrainingArguments' fp16 / bf16
        ds[dtype] = {"enabled": "auto", **({"initial_scale_power": 8} if dtype == "fp16" else {})}
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        max_steps=4,
        gradient_accumulation_steps=run.get("accum", 1),
        fp16=dtype == "fp16",
        bf16=dtype == "bf16",
        deepspeed=ds,
    )
    callbacks = [NanGuardCallback(policy=run["policy"])] if run.get("policy") else []
    trainer = Trainer(model=model, args=args, train_dataset=_Samples(64, run.get("nan_at")), callbacks=callbacks)
    trainer.train()
    engine = trainer.model_wrapped
    diag = callbacks[0].last_diagnosis if callbacks else None
    return {
        "losses": [h.get("loss") for h in trainer.state.log_history if "train_runtime" not in h],
        "engine": [engine.zero_optimization_stage(), engine.fp16_enabled(), engine.bfloat16_enabled()],
        "accum": engine.gradient_accumulation_steps(),
        "weights": weights(engine),
        "skipped_steps": engine.skipped_steps,
        "skipped": callbacks[0].skipped if callbacks else None,
        "diagnosis": diag.to_dict() if diag else None,
    }


class _Samples(torch.utils.data.IterableDataset):
    """Seeded (inputs_embeds, labels) samples; ``nan_at`` corrupts one."""

    def __init__(self, n: int, nan_at: int | None) -> None:
        self.n, self.nan_at = n, nan_at

    def __iter__(self) -> Any:
        gen = torch.Generator().manual_seed(0)
        for i in range(self.n):
            x = torch.randn(8, 32, generator=gen)
            y = torch.randint(64, (8,), generator=gen)
            if i == self.nan_at:
                x[1, 3] = float("nan")
            yield {"inputs_embeds": x, "labels": y}
