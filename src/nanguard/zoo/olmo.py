"""OLMo-core's own ``Trainer`` end to end on CPU (1 process, or gloo ranks), guarded by
``NanGuardCallback`` or not, with a fault on one rank.

Everything is OLMo-core as shipped: ``prepare_training_environment`` (``backend="gloo"`` on ranks;
``None`` for one process), a tiny llama-like ``TransformerConfig`` built with ``init_device="cpu"``,
its ``NumpyFSLDataset`` over a token file written here and its numpy data loader, its
``TransformerTrainModule`` (``device="cpu"``; DDP or FSDP through its ``dp_config``; 2 micro-batches a
step; ``SkipStepAdamW`` or ``AdamW``; clipping at 1.0) and its ``Trainer`` (``device="cpu"``, no
checkpoints). Nothing is patched and nothing is downloaded.

The faults, at ``BAD_STEP`` on one rank (``fault_rank``): ``log`` (``blocks.1.feed_forward.w1`` takes
the log of its output, negatives included), ``nan_grad`` (that module's output goes through the square
root of a zero that depends on it: finite forward, a NaN gradient in the backward), ``term`` (the loss
the model returns gets a NaN term no gradient flows through: its gradients stay finite), ``token`` (a
token id past the vocabulary in that rank's batch), ``embeds`` (the batch carries precomputed
``input_embeddings``, as OLMo-core's multimodal input does, and one of them is NaN), and ``lr``
(every rank: an LR far too high from the start).

Example:
    >>> spawn_ranks(olmo_rank, "ddp", "log", 1, "skip", world=2)
    [{'losses': [...], 'skipped': [3], 'diag': {...}, ...}, {...}]
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["BAD_STEP", "FAULTS", "SEQ", "VOCAB", "olmo_rank", "ranks_cases", "single"]

BAD_STEP = 3
"""The trainer step (OLMo-core counts from 1) a fault is planted at."""
FAULTS = ("log", "nan_grad", "term", "token", "embeds", "lr")
VOCAB = 128
SEQ = 16
_TOKENS = SEQ * 256
_MODULE = "blocks.1.feed_forward.w1"
_METRICS = ("train/CE loss", "optim/total grad norm", "optim/step skipped", "nanguard/skipped", "nanguard/trips")


def single(cases: list[list[Any]]) -> list[dict[str, Any]]:
    """Each case ``[setup, fault, fault_rank, policy, keywords]`` run as ``olmo_rank(0, 1, ...)``, one
    after the other in one fresh spawned process: OLMo-core's environment setup (logging, exception
    hooks, the start method) stays out of the caller's process."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(ranks_cases, (0, 1, cases))


def ranks_cases(rank: int, world: int, cases: list[list[Any]]) -> list[dict[str, Any]]:
    """Each case ``[setup, fault, fault_rank, policy, keywords]`` on this rank, in order (for
    ``spawn_ranks``: one spawn, one import of OLMo-core, many runs)."""
    return [olmo_rank(rank, world, *case[:4], **(case[4] if len(case) > 4 else {})) for case in cases]


def olmo_rank(
    rank: int,
    world: int,
    setup: str,
    fault: str | None,
    fault_rank: int,
    policy: str | None,
    *,
    steps: int = 4,
    lr: float = 1e-3,
    optim: str = "skip_step_adamw",
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps with OLMo-core's ``Trainer``; ``setup`` "single", "ddp" or "fsdp";
    ``fault`` one of ``FAULTS`` or None; ``policy`` None trains unguarded. Returns what the run
    logged, did and ended with (JSON)."""
    from olmo_core.train import prepare_training_environment

    _environment(rank, world)
    prepare_training_environment(backend="gloo" if world > 1 else None, seed=0)
    logging.getLogger("olmo_core").setLevel(logging.WARNING)
    with _shared_dir(world) as (tmp, run), _one_run():
        result = _train(rank, world, tmp, setup, fault, fault_rank, policy, steps, lr, optim, options or {})
        run["stopped"] = result["error"] is not None
        return result


@contextlib.contextmanager
def _shared_dir(world: int) -> Iterator[tuple[str, dict[str, bool]]]:
    """One temporary directory for every rank (OLMo-core's data loader expects a shared file system),
    removed by rank 0 once every rank is done with it; a run that stopped on an error waits for no peer
    (a peer may be stuck in a collective the stopped rank never joins)."""
    import torch.distributed as tdist

    path = [tempfile.mkdtemp(prefix="nanguard-olmo-")]
    if world > 1:
        tdist.broadcast_object_list(path, src=0)  # a str: nothing but a path crosses
    run = {"stopped": False}
    try:
        yield path[0], run
    finally:
        if world > 1 and not run["stopped"]:
            tdist.barrier()
        if world == 1 or tdist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


@contextlib.contextmanager
def _one_run() -> Iterator[None]:
    """OLMo-core builds its world mesh once a process: forget it after each run, so one spawn runs many."""
    from olmo_core.distributed import parallel

    try:
        yield
    finally:
        parallel._WORLD_MESH = None


def _environment(rank: int, world: int) -> None:
    """The variables torchrun would set, for OLMo-core's environment checks (the group exists already)."""
    if world == 1:
        return
    for name, value in {
        "RANK": rank,
        "WORLD_SIZE": world,
        "LOCAL_RANK": rank,
        "LOCAL_WORLD_SIZE": world,
        "NUM_NODES": 1,
    }.items():
        os.environ[name] = str(value)


def _train(
    rank: int,
    world: int,
    tmp: str,
    setup: str,
    fault: str | None,
    fault_rank: int,
    policy: str | None,
    steps: int,
    lr: float,
    optim: str,
    options: dict[str, Any],
) -> dict[str, Any]:
    from olmo_core.train import Duration, TrainerConfig

    from nanguard.errors import NonFiniteError

    torch.manual_seed(0)
    model = _model()
    if fault == "embeds":  # the features come in precomputed: the token table is not trained (DDP wants
        model.embeddings.weight.requires_grad_(False)  # every trained parameter used)
    if rank == fault_rank:
        _plant(model, fault)
    train_module = _train_module(model, setup, lr, optim)
    data_loader = _data_loader(tmp, rank, world)
    recorder = _recorder(rank == fault_rank, fault)
    config = TrainerConfig(
        save_folder=os.path.join(tmp, "save"),
        device="cpu",
        max_duration=Duration.steps(steps),
        metrics_collect_interval=1,
        no_checkpoints=True,
        no_evals=True,
    )
    if policy is not None:
        from nanguard.integrations.olmo_core import NanGuardCallback

        config = config.with_callback("nanguard", NanGuardCallback(policy=policy, module_stats=False, **options))
    config = config.with_callback("recorder", recorder)
    trainer = config.build(train_module, data_loader)
    error = None
    with _counting() as counts:
        try:
            trainer.fit()
        except NonFiniteError as err:
            error = f"NonFiniteError: {err.diagnosis.cause if err.diagnosis is not None else None}"
        except Exception as err:  # OLMo-core's own reaction to the fault, reported as it was
            cause = err.__cause__ or err.__context__  # its bookkeeping thread's error comes wrapped
            error = _said(err) + (f" ({_said(cause)})" if cause is not None else "")
    guard: Any = trainer.callbacks.get("nanguard")  # the trainer's (TrainerConfig.with_callback deep-copies)
    diag = guard.last_diagnosis if guard is not None else None
    params = list(train_module.model.parameters())
    return {
        "rank": rank,
        "error": error,
        "steps": trainer.global_step,
        "metrics": recorder.metrics,
        "skipped": recorder.skipped,
        "digest": _digest(train_module.model),
        "finite": all(bool(torch.isfinite(_local(p)).all()) for p in params),
        "params": len(params),
        "forwards": counts["forward"],
        "backwards": counts["backward"],
        "diag": diag.to_dict() if diag is not None else None,
        "trips": guard.trips if guard is not None else 0,
        "times": recorder.times,
    }


def _said(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _model() -> Any:
    from olmo_core.nn.transformer import TransformerConfig

    config = TransformerConfig.llama_like(d_model=32, vocab_size=VOCAB, n_layers=2, n_heads=2)
    return config.build(init_device="cpu")


def _train_module(model: Any, setup: str, lr: float, optim: str) -> Any:
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.optim import AdamWConfig, SkipStepAdamWConfig
    from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig

    optim_config = SkipStepAdamWConfig(lr=lr) if optim == "skip_step_adamw" else AdamWConfig(lr=lr)
    dp = None
    if setup in ("ddp", "fsdp"):
        dp = TransformerDataParallelConfig(name=DataParallelType(setup))
    config = TransformerTrainModuleConfig(
        rank_microbatch_size=2 * SEQ,  # 2 sequences a micro-batch, 2 micro-batches a step
        max_sequence_length=SEQ,
        optim=optim_config,
        max_grad_norm=1.0,
        dp_config=dp,
    )
    return config.build(model, device=torch.device("cpu"))


def _data_loader(tmp: str, rank: int, world: int) -> Any:
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig

    path = os.path.join(tmp, "tokens.npy")
    ids = np.random.default_rng(0).integers(1, VOCAB - 1, size=_TOKENS).astype(np.uint16)
    # Every rank writes the same bytes into the shared directory; a rename, so that no rank reads the
    # file while another truncates it (OLMo-core sized the dataset from a half-written file: no indices).
    part = f"{path}.{rank}"
    ids.tofile(part)
    os.replace(part, path)
    tokenizer = TokenizerConfig(vocab_size=VOCAB, eos_token_id=VOCAB - 1, pad_token_id=0)
    dataset = NumpyFSLDatasetConfig(tokenizer=tokenizer, paths=[path], sequence_length=SEQ, work_dir=tmp).build()
    loader = NumpyDataLoaderConfig(global_batch_size=4 * SEQ * world, seed=0, work_dir=tmp, num_workers=0)
    return loader.build(dataset)


def _plant(model: Any, fault: str | None) -> None:
    """On this rank, at ``BAD_STEP``, ``blocks.1.feed_forward.w1`` takes the log of its output
    (``log``) or adds the square root of a zero computed from it (``nan_grad``); or the loss the model returns
    gets a NaN term no gradient flows through (``term``: the loss NaN, its gradients finite)."""
    if fault == "term":
        _plant_term(model)
        return
    if fault not in ("log", "nan_grad"):
        return
    w1: Any = model.get_submodule(_MODULE)
    forward = w1.forward
    on = _BAD

    def faulty(x: torch.Tensor) -> torch.Tensor:
        out = forward(x)
        if not on["now"]:
            return out
        if fault == "log":
            return torch.log(out)
        # The distance of the output from itself: 0, and the gradient of its square root there is Inf.
        return out + torch.sqrt((out - out.detach()) ** 2)

    w1.forward = faulty


def _plant_term(model: Any) -> None:
    forward = model.forward

    def with_term(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        loss = getattr(out, "loss", None)
        if not _BAD["now"] or loss is None:
            return out
        return out._replace(loss=loss + torch.full_like(loss.detach(), float("nan")))

    model.forward = with_term


_BAD = {"now": False}
"""Whether this rank's current step is the faulty one (set by the recorder callback)."""


def _recorder(faulty: bool, fault: str | None) -> Any:
    """A callback that plants the step's data faults and arms the model faults at ``BAD_STEP`` on
    the faulty rank, and keeps what the trainer logged (``metrics``) and which steps were skipped."""
    from olmo_core.train.callbacks import Callback

    class Recorder(Callback):
        priority = 1000  # before every other callback: the batch is changed before anyone reads it

        def __init__(self) -> None:
            self.metrics: dict[str, dict[str, float]] = {}
            self.skipped: list[int] = []
            self.times: list[float] = []  # seconds from pre_step to post_train_batch, each step

        def pre_step(self, batch: dict[str, Any]) -> None:
            _STEP["start"] = time.perf_counter()
            bad = faulty and self.step == BAD_STEP
            _BAD["now"] = bad
            if fault == "embeds":
                # Precomputed input embeddings (an encoder's, spliced into the sequence): the table's rows.
                module: Any = self.trainer.train_module
                weight = _local(module.model.embeddings.weight).detach()
                embeds = weight[batch["input_ids"] % weight.shape[0]].clone()
                if bad:
                    embeds[1, 5, :] = float("nan")
                batch["input_embeddings"] = embeds
            if bad and fault == "token":
                batch["input_ids"][1, 5] = VOCAB + 9

        def post_train_batch(self) -> None:
            self.times.append(time.perf_counter() - _STEP["start"])
            _STEP["start"] = None
            callback: Any = self.trainer.callbacks.get("nanguard")
            if callback is not None and callback.step_skipped:
                self.skipped.append(self.step)
            _BAD["now"] = False

        def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
            self.metrics[str(step)] = {k: float(v) for k, v in metrics.items() if k in _METRICS}

    return Recorder()


_STEP: dict[str, Any] = {"start": None}
"""The step being timed: when it started (None between steps)."""


@contextlib.contextmanager
def _counting() -> Iterator[dict[str, int]]:
    """Count the model forwards (``Transformer.forward``) and ``Tensor.backward`` calls inside (the
    collectives and host reads a step adds are counted by ``benchmarks/sync_count.py``)."""
    from olmo_core.nn.transformer import Transformer

    counts = {"forward": 0, "backward": 0}
    forward, backward = Transformer.forward, torch.Tensor.backward

    @functools.wraps(forward)  # the signature stays the model's: the guard names inputs by it
    def counted_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["forward"] += 1
        return forward(self, *args, **kwargs)

    @functools.wraps(backward)
    def counted_backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counts["backward"] += 1
        return backward(self, *args, **kwargs)

    Transformer.forward, torch.Tensor.backward = counted_forward, counted_backward  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        Transformer.forward, torch.Tensor.backward = forward, backward  # type: ignore[method-assign]


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _digest(model: Any) -> str:
    """The parameters (this rank's shards) and the RNG state, hashed."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(_local(p.detach()).contiguous().view(torch.uint8).numpy().tobytes())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()[:16]
