"""torchtitan's own ``Trainer`` end to end on CPU gloo ranks, guarded by ``TitanGuard`` or not.

The trainer is built from torchtitan's ``llama3_debugmodel`` config with the model shrunk through
that config (2 layers, dim 64, vocab 256) and run by ``Trainer.train()``: its parallelize function
(FSDP2 ``dp_shard=2`` or ``TP=2``), its default selective activation checkpointing, bf16 FSDP
mixed precision, chunked loss, optimizer and scheduler containers, metrics, step loop.

The CPU patch, in this process only (no file of torchtitan's is edited): torchtitan picks
``cuda`` as its device type when no accelerator is present, so its modules' ``device_type`` is
``"cpu"`` and its ``device_module`` a stand-in answering the few calls the trainer makes (set
the device, count devices, memory statistics); the groups keep their timeout after the first
step (torchtitan calls ``torch.distributed.set_timeout``, absent from this torch); under PP its
micro-batches are joined back into the whole batch this torch's schedule splits itself. Through the
config: the attention's inner kernel is ``ScaledDotProductAttention`` (FlexAttention has no CPU
backward); FSDP reduces with ``SUM`` (gloo has no ``PREMUL_SUM``; a wrapper around the
parallelize function); the ``partial_dtensor`` backend (the default ``spmd_types`` one leaves
parameters plain, which FSDP2 refuses); a synthetic token loader and no tokenizer (nothing is
downloaded).

Example:
    >>> spawn_ranks(trainer_rank, "fsdp", "sqrt", 1, "skip", world=2)
    [{'losses': [...], 'skipped': [3], 'diag': {...}, ...}, {...}]
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from nanguard.zoo.titan import SEQ, VOCAB, _digest, _fields, _finish, _plant, model_config

__all__ = ["BAD_TRAINER_STEP", "cpu_patch", "trainer_config", "trainer_rank"]

BAD_TRAINER_STEP = 3
"""The trainer step (torchtitan counts from 1) a fault is planted at."""


class _CpuDevice:
    """The few ``torch.cuda`` calls torchtitan's trainer makes, answered for the CPU."""

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return type("Properties", (), {"total_memory": 1 << 30})()

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None


def _keep_timeouts(**_: Any) -> None:
    import torch.distributed as tdist

    tdist.barrier()


def cpu_patch() -> None:
    """Point torchtitan's device type at the CPU in this process (see the module's text)."""
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools

    for module in (tools, dist_utils, metrics):
        module.device_type = "cpu"
        module.device_module = _CpuDevice
    parallel_dims.device_type = "cpu"
    # After the first step the trainer shortens every group's timeout with
    # torch.distributed.set_timeout, which this torch lacks: the groups keep the launcher's.
    dist_utils.set_pg_timeouts = _keep_timeouts
    os.environ.setdefault("LOCAL_RANK", "0")


def _classes() -> tuple[Any, Any]:
    """The synthetic token loader and the absent tokenizer, as torchtitan configurables."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class TokenLoader(BaseDataLoader):
        """Random token ids (seeded by step and data-parallel rank) as ``({"input": x}, labels)``."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config: Any, *, dp_rank: int, seq_len: int, local_batch_size: int, **_: Any) -> None:
            self.dp_rank, self.seq_len, self.batch = dp_rank, seq_len, local_batch_size

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            step = 0
            while True:
                g = torch.Generator().manual_seed(step * 10 + self.dp_rank)
                x = torch.randint(0, VOCAB, (self.batch, self.seq_len + 1), generator=g)
                yield {"input": x[:, :-1].contiguous()}, x[:, 1:].contiguous()
                step += 1

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            return None

    class NoTokenizer(BaseTokenizer):
        """The loader makes token ids itself."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Any, **_: Any) -> None:
            super().__init__()

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError("the synthetic loader needs no tokenizer")

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError("the synthetic loader needs no tokenizer")

        def get_vocab_size(self) -> int:
            return VOCAB

    return TokenLoader, NoTokenizer


def trainer_config(
    setup: str,
    *,
    steps: int = 4,
    lr: float = 8e-4,
    dump_folder: str = "",
    backend: str = "partial_dtensor",
    loss: str = "chunked",
) -> Any:
    """torchtitan's ``llama3_debugmodel`` trainer config, shrunk and pointed at the CPU: ``setup``
    "fsdp" (dp_shard=2), "tp" (TP=2) or "pp" (2 pipeline stages, 1F1B) on 2 ranks; ``backend``
    its SPMD backend ("full_dtensor": every parameter and activation a DTensor, the loss too);
    ``loss`` "chunked" (its default ``ChunkedLossWrapper``) or "ce" (its plain ``CrossEntropyLoss``,
    ``llama3_debugmodel_ce_loss``)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    if setup not in ("fsdp", "tp", "pp"):
        raise ValueError(f"setup must be 'fsdp', 'tp' or 'pp', got {setup!r}")
    if loss not in ("chunked", "ce"):
        raise ValueError(f"loss must be 'chunked' or 'ce', got {loss!r}")
    loader, tokenizer = _classes()
    config = llama3_debugmodel()
    spec = config.model_spec
    spec.model = model_config()
    parallelize = spec.parallelize_fn

    def parallelize_on_gloo(model: Any, **kwargs: Any) -> Any:
        model = parallelize(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    spec.parallelize_fn = parallelize_on_gloo
    config.tokenizer = tokenizer.Config()
    config.dataloader = loader.Config()
    if loss == "ce":
        config.loss = CrossEntropyLoss.Config(global_vocab_size=VOCAB)
    config.optimizer = default_adamw(lr=lr)
    config.optimizer.implementation = "for-loop"
    config.training.local_batch_size = 2
    config.training.seq_len = SEQ
    config.training.steps = steps
    config.parallelism.data_parallel_shard_degree = 2 if setup == "fsdp" else 1
    config.parallelism.tensor_parallel_degree = 2 if setup == "tp" else 1
    if setup == "pp":  # 2 stages on 2 ranks, torchtitan's 1F1B schedule, 2 micro-batches a step
        config.parallelism.pipeline_parallel_degree = 2
        config.parallelism.pipeline_parallel_schedule = "1F1B"
        config.training.disable_cuda_graphs = True  # the trainer refuses PP otherwise (none on CPU anyway)
        stages = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]]
        config.parallelism.module_fqns_per_model_part = stages
    # The default "spmd_types" backend leaves parameters plain tensors, which FSDP2 refuses here
    # ("all parameters must be DTensors on the full SPMD mesh"): DTensor on the parallel axes only.
    config.parallelism.spmd_backend = backend
    config.debug.seed = 0  # the same initial weights in every run: guarded and unguarded compare
    config.validator.enable = False
    config.checkpoint.enable = False
    config.dump_folder = dump_folder
    return config


def _whole_batch_step(schedule: Any) -> None:
    """torchtitan 0.3 hands its schedule micro-batches (``step(arg_mbs=, kwarg_mbs=, target_mbs=)``);
    this torch's schedule takes the whole batch and splits it itself: join them back."""
    step = schedule.step

    def whole(
        *,
        arg_mbs: Any = None,
        kwarg_mbs: Any = None,
        target_mbs: Any = None,
        **kwargs: Any,
    ) -> Any:
        args = () if arg_mbs is None else tuple(torch.cat(parts) for parts in zip(*arg_mbs, strict=True))
        target = None if target_mbs is None else torch.cat(target_mbs)
        model_kwargs = {k: torch.cat([mb[k] for mb in kwarg_mbs]) for k in (kwarg_mbs or [{}])[0]}
        return step(*args, target=target, **kwargs, **model_kwargs)

    schedule.step = whole


class _Poisoned:
    """The trainer's data loader; while ``on["bad"]``, its next batch holds a token id past the vocabulary."""

    def __init__(self, loader: Any, on: dict[str, bool]) -> None:
        self.loader, self.on = loader, on

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for inputs, labels in self.loader:
            if self.on["bad"]:
                inputs["input"][0, 3] = VOCAB + 5
                self.on["bad"] = False
            yield inputs, labels


def _layout(t: Any) -> str:
    """``Tensor``, or ``DTensor`` with its placements."""
    placements = getattr(t, "placements", None)
    return type(t).__name__ if placements is None else f"DTensor{tuple(str(p) for p in placements)}"


def trainer_rank(
    rank: int,
    world: int,
    setup: str,
    fault: str | None,
    fault_rank: int,
    policy: str | None,
    *,
    steps: int = 4,
    lr: float = 8e-4,
    backend: str = "partial_dtensor",
    check_batch: bool = False,
    loss: str = "chunked",
) -> dict[str, Any]:
    """Run torchtitan's ``Trainer.train()`` for ``steps`` steps; ``fault`` ("sqrt", "sqrt_grad": in
    layers.1.feed_forward.w1; "token": a token id past the vocabulary in the first micro-batch)
    on ``fault_rank`` at ``BAD_TRAINER_STEP``; ``policy`` None trains unguarded, else with the
    guard's lines added the way ``docs/torchtitan.md`` shows (a subclass here: no file of
    torchtitan's is edited)."""
    import tempfile

    from nanguard.errors import NonFiniteError

    cpu_patch()
    with tempfile.TemporaryDirectory() as dump:
        config = trainer_config(setup, steps=steps, lr=lr, dump_folder=dump, backend=backend, loss=loss)
        trainer = _trainer_class(policy, check_batch)(config)
        if setup == "pp":
            _whole_batch_step(trainer.pp_schedule)
        model = trainer.model_parts[0]
        watch = _Watch(trainer, guarded=policy is not None)
        if rank == fault_rank:
            _plant(model, fault, watch.on)
            if fault == "token":
                trainer.dataloader = _Poisoned(trainer.dataloader, watch.on)
        watch.count_forwards(model)
        raised = None
        with watch.counting_backwards():
            try:
                trainer.train()
            except NonFiniteError as err:
                raised = err.diagnosis
        d = _finish(getattr(trainer, "guard", None), raised)
        digest = _digest(model)
        trainer.close()
    return {
        "rank": rank,
        "losses": watch.kept(0),
        "norms": watch.kept(1),
        "steps": trainer.step,
        "skipped": watch.skipped,
        "digest": digest,
        "forwards": watch.forwards,
        "backwards": watch.backwards,
        "loss_inputs": watch.seen,
        "raised": raised is not None,
        "diag": None
        if d is None
        else _fields(d) | {"trip": {k: d.evidence.get(k) for k in ("loss", "grad_norm", "why", "history")}},
    }


def _trainer_class(policy: str | None, check_batch: bool) -> Any:
    """torchtitan's ``Trainer``, or (``policy`` set) a subclass with the guard's lines added the way
    ``docs/torchtitan.md`` shows."""
    from torchtitan.trainer import Trainer

    from nanguard.integrations.torchtitan import TitanGuard

    if policy is None:
        return Trainer

    class GuardedTrainer(Trainer):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.guard = TitanGuard(
                self.model_parts, self.optimizers, self.lr_schedulers, policy=policy or "skip", check_batch=check_batch
            )
            self.loss_fn: Any = self.guard.loss(self.loss_fn)
            if self.parallel_dims.pp_enabled:  # the schedule took the loss function when it was built
                self.pp_schedule._loss_fn = self.guard.loss(self.pp_schedule._loss_fn)

        def train_step(self, data_iterator: Any) -> None:
            try:
                super().train_step(data_iterator)
            except RuntimeError as err:  # torchtitan stops at the logged non-finite loss of a skipped step
                if not (self.guard.step_skipped and "Loss is not finite" in str(err)):
                    raise

    return GuardedTrainer


class _Watch:
    """What a trainer run is checked by, wired into the trainer: the layouts its loss function is given
    and returns, the loss and grad norm its metrics log each step, the steps the guard skips, its
    forwards and its backwards (a replay's too); and the fault's switch, on during ``BAD_TRAINER_STEP``."""

    def __init__(self, trainer: Any, *, guarded: bool) -> None:
        self.trainer, self.guarded = trainer, guarded
        self.on = {"bad": False}
        self.seen: dict[str, str] = {}
        self.logged: dict[int, tuple[float, float]] = {}
        self.skipped: list[int] = []
        self.forwards = 0
        self.backwards = 0
        self._loss_fn, trainer.loss_fn = trainer.loss_fn, self._observed_loss
        self._log, trainer.metrics_processor.log = trainer.metrics_processor.log, self._record
        self._train_step, trainer.train_step = trainer.train_step, self._step

    def _observed_loss(self, pred: Any, labels: Any, *args: Any, **kwargs: Any) -> Any:
        out = self._loss_fn(pred, labels, *args, **kwargs)
        self.seen["pred"] = _layout(pred)
        self.seen["loss"] = _layout(out[0] if isinstance(out, tuple) else out)
        return out

    def _record(self, step: int, loss: float, max_loss: float, grad_norm: float, **kwargs: Any) -> None:
        self.logged[step] = (float(loss), float(grad_norm))
        self._log(step, loss, max_loss, grad_norm, **kwargs)

    def _step(self, data_iterator: Any) -> None:
        self.on["bad"] = self.trainer.step == BAD_TRAINER_STEP
        self._train_step(data_iterator)
        self.on["bad"] = False
        if self.guarded and self.trainer.guard.step_skipped:
            self.skipped.append(self.trainer.step)

    def count_forwards(self, model: torch.nn.Module) -> None:
        model.register_forward_pre_hook(self._forward)

    def _forward(self, *args: Any) -> None:
        self.forwards += 1

    @contextmanager
    def counting_backwards(self) -> Iterator[None]:
        """``Tensor.backward`` counted while the trainer runs: its ``loss.backward()``, and any replay's."""
        backward = torch.Tensor.backward

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.backwards += 1
            return backward(tensor, *args, **kwargs)

        torch.Tensor.backward = counted  # type: ignore[method-assign, assignment]
        try:
            yield
        finally:
            torch.Tensor.backward = backward  # type: ignore[method-assign]

    def kept(self, index: int) -> list[float]:
        """The logged loss (``index`` 0) or grad norm (1) of each step the guard did not skip."""
        return [self.logged[s][index] for s in sorted(self.logged) if s not in self.skipped]
