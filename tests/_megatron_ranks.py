"""The rank side of tests/test_integration_megatron.py: megatron-core on CPU gloo ranks (the shim in
``_megatron_cpu``), a tiny GPT from a ``TransformerConfig``, Megatron's DDP, optimizer and schedules,
several runs in sequence in one spawned group.

A run is a dict: ``tp``/``pp`` (model parallel sizes; data parallel is what is left of the world),
``dist_opt`` (Megatron's DistributedOptimizer), ``dtype`` ("fp32" or "bf16"), ``steps``, ``micro``
(micro-batches per step), ``lr``, ``policy`` (None: unguarded), ``fault``: (kind, rank, step) with
kind "data" (a NaN in the batch's float input), "ids" (a token id past the vocabulary), "log" (log of a
negative in one module), "grad" (a NaN planted in one module's backward), "logged" (a NaN loss term
that is only logged: the gradients finite), "nan_row" (a word-embedding row no batch looks up NaN before
the guard is built, on the first stage), or ``diverge`` (an LR far too high on every rank). A run the
guard stops (``NonFiniteError``) records its diagnosis in ``trips``.
"""

from __future__ import annotations

import logging
import sys
import traceback
import warnings
from functools import partial
from typing import Any

import torch
from torch import nn

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from _megatron_cpu import install

VOCAB, SEQ, HIDDEN, ROWS = 64, 8, 16, 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FAULT_MODULE = "decoder.layers.0.mlp"


def init(tp: int, pp: int) -> None:
    """The shim, then Megatron's model-parallel groups on the spawned gloo world."""
    install()
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(0)


class _PlantedNaN(torch.autograd.Function):
    """The identity forward; a backward that writes a NaN into the gradient (weights stay finite)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad


class Fault:
    """A forward hook on one module that faults on this rank when armed: ``log`` of a negative,
    or ``grad``, a NaN planted in its backward."""

    def __init__(self) -> None:
        self.kind: str | None = None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.kind is None:
            return output
        out, *rest = output if isinstance(output, tuple) else (output,)
        if self.kind == "log":
            out = torch.log(out - 1e3)
        elif self.kind == "grad":
            out = _PlantedNaN.apply(out)
        return (out, *rest) if isinstance(output, tuple) else out


def build(run: dict[str, Any]) -> tuple[list[nn.Module], Any, Fault]:
    """A fresh seeded tiny GPT (this rank's pipeline stage), wrapped in Megatron's DDP, and its optimizer."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    dtype = run.get("dtype", "fp32")
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        use_cpu_initialization=True,
        tensor_model_parallel_size=run.get("tp", 1),
        pipeline_model_parallel_size=run.get("pp", 1),
        pipeline_dtype=DTYPES[dtype],
        params_dtype=DTYPES[dtype],
        bf16=dtype == "bf16",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    fault = Fault()
    for name, module in model.named_modules():
        if name == FAULT_MODULE:
            module.register_forward_hook(fault)
    inner: nn.Module = model
    if dtype == "bf16":  # what Megatron's get_model does: the bf16 wrapper casts the inputs and the output
        from megatron.core.transformer.module import Float16Module

        inner = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=run.get("dist_opt", False),
        check_for_nan_in_grad=run.get("check_for_nan_in_grad", False),
    )
    ddp = DistributedDataParallel(config, ddp_config, inner)
    opt_config = OptimizerConfig(
        optimizer=run.get("optimizer", "adam"),
        lr=run.get("lr", 1e-2),
        bf16=dtype == "bf16",
        params_dtype=DTYPES[dtype],
        use_distributed_optimizer=run.get("dist_opt", False),
        clip_grad=run.get("clip_grad", 1.0),
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return [ddp], optimizer, fault


def batch(rank: int, step: int, micro: int) -> dict[str, torch.Tensor]:
    """This data-parallel rank's micro-batch: token ids, positions, labels and a float loss mask."""
    g = torch.Generator().manual_seed(rank * 1000 + step * 10 + micro)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return {
        "tokens": tokens,
        "position_ids": torch.arange(SEQ).expand(ROWS, SEQ).contiguous(),
        "labels": torch.roll(tokens, -1, 1),
        "loss_mask": torch.ones(ROWS, SEQ),
    }


def loss_func(
    loss_mask: torch.Tensor, output: torch.Tensor, validate: bool = False, logged: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's GPT loss: the per-token losses averaged over the mask; ``validate``: checked by
    Megatron's RerunStateMachine as ``pretrain_gpt.py``'s loss function does; ``logged``: plus a term
    only logged (detached), NaN: the loss is NaN, its gradients finite."""
    losses = output.float().view(-1)
    loss = (losses * loss_mask.view(-1)).sum() / loss_mask.sum()
    if logged:
        loss = loss + torch.log(losses.detach().min() - 1e6)
    if validate:
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        get_rerun_state_machine().validate_result(
            result=loss,
            rejection_func=torch.isnan,
            message="found NaN in local forward loss calculation",
            tolerance=0.0,
            fatal=True,
        )
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator: Any, model: nn.Module, validate: bool = False) -> tuple[torch.Tensor, Any]:
    """Megatron's ``forward_step_func``: the batch from the iterator, the model, and the loss function."""
    b = next(data_iterator)
    output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    return output, partial(loss_func, b["loss_mask"], validate=validate, logged="logged" in b)


def regression_loss(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A squared error on the logits: plain SGD at an LR far above 2 / (its curvature) multiplies the
    error every step (geometric growth, whatever the seed) until it overflows."""
    loss = (output.float() - target).pow(2).mean()
    return loss, {"lm loss": loss.detach()}


def regression_step(data_iterator: Any, model: nn.Module) -> tuple[torch.Tensor, Any]:
    """A ``forward_step_func`` regressing the logits (the model without labels returns them)."""
    b = next(data_iterator)
    output = model(b["tokens"], b["position_ids"], None)
    return output, partial(regression_loss, b["loss_mask"][..., None] * 0.1)


def train(run: dict[str, Any], rank: int) -> dict[str, Any]:
    """``steps`` steps of Megatron's loop, guarded (``policy``) or not; what each rank saw."""
    from megatron.core import parallel_state

    from nanguard.errors import NonFiniteError

    chunks, optimizer, fault = build(run)
    dp_rank = parallel_state.get_data_parallel_rank()
    bad_kind, bad_rank = (run.get("fault") or (None, -1, -1))[:2]
    guard = None
    step_func: Any = regression_step if run.get("regression") else forward_step
    if run.get("validate"):
        step_func = partial(forward_step, validate=True)
    if run.get("policy") is not None:
        from nanguard.integrations.megatron import MegatronGuard

        if bad_kind == "nan_row" and rank == bad_rank:  # as a bad checkpoint loads it, before the guard
            _nan_row(chunks, run)
        guard = MegatronGuard(chunks, optimizer, policy=run["policy"], **run.get("options", {}))
        step_func = guard.forward_step(step_func)
    counts = [0, 0]  # the chunk's training forwards, and the backwards through its output
    chunks[0].register_forward_pre_hook(lambda *a: counts.__setitem__(0, counts[0] + 1))
    step_func = _counted(step_func, counts)
    results: list[Any] = []
    losses: list[float] = []
    trips: list[dict[str, Any]] = []  # each skipped step's diagnosis, in order
    said: list[str] = []
    try:
        _loop(run, rank, dp_rank, chunks, optimizer, fault, step_func, guard, results, losses, trips, said)
    except NonFiniteError as err:  # policy="raise", or a loaded NaN no skip repairs: every rank stops
        trips.append(err.diagnosis.to_dict())
        said.append("raised")
    out: dict[str, Any] = {
        "results": [[bool(r[0]), None if r[1] is None else float(r[1])] for r in results],
        "losses": losses,
        "weights": weights(chunks),
        "forwards": counts[0],
        "backwards": counts[1],
        "finite": all(bool(torch.isfinite(p).all()) for c in chunks for p in c.parameters()),
    }
    if guard is not None:
        diag = guard.last_diagnosis
        out["skipped"] = guard.skipped
        out["diagnosis"] = diag.to_dict() if diag is not None else None
        out["trips"], out["said"] = trips, said
        guard.close()
    return out


def _loop(
    run: dict[str, Any],
    rank: int,
    dp_rank: int,
    chunks: list[nn.Module],
    optimizer: Any,
    fault: Fault,
    step_func: Any,
    guard: Any,
    results: list[Any],
    losses: list[float],
    trips: list[dict[str, Any]],
    said: list[str],
) -> None:
    """Megatron's loop: ``steps`` of forward_backward_func then optimizer.step(), the fault planted."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    micro = run.get("micro", 1)
    bad_kind, bad_rank, bad_step = run.get("fault") or (None, -1, -1)
    for step in range(run.get("steps", 3)):
        batches = [batch(dp_rank, step, m) for m in range(micro)]
        here = rank == bad_rank and step == bad_step
        if here and bad_kind == "data":
            batches[0]["loss_mask"][0, 1] = float("nan")
        if here and bad_kind == "ids":
            batches[0]["tokens"][0, 2] = VOCAB + 5
        if here and bad_kind == "logged":
            batches[0]["logged"] = torch.ones(())
        fault.kind = bad_kind if here and bad_kind in ("log", "grad") else None
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        stored = forward_backward(
            forward_step_func=step_func,
            data_iterator=iter(batches),
            model=chunks,
            num_microbatches=micro,
            seq_length=SEQ,
            micro_batch_size=ROWS,
            decoder_seq_length=SEQ,
            forward_only=False,
        )
        results.append(list(optimizer.step()))
        losses.extend(float(s["lm loss"]) for s in stored)
        if guard is not None and guard.step_skipped and guard.last_diagnosis is not None:
            trips.append(guard.last_diagnosis.to_dict())
            said.append(str(guard.last_diagnosis))


def _nan_row(chunks: list[nn.Module], run: dict[str, Any]) -> None:
    """A word-embedding row no batch of the run looks up made NaN (this rank holds the embedding: the first
    pipeline stage): only the parameter check can see it."""
    from megatron.core.utils import unwrap_model

    steps, micro = run.get("steps", 3), run.get("micro", 1)
    tokens = [batch(r, s, m)["tokens"] for r in range(2) for s in range(steps) for m in range(micro)]
    used = {int(t) for ids in tokens for t in ids.flatten()}
    row = min(set(range(VOCAB)) - used)
    weight = unwrap_model(chunks[0]).embedding.word_embeddings.weight
    with torch.no_grad():
        weight[row] = float("nan")


def _counted(step_func: Any, counts: list[int]) -> Any:
    """``step_func`` whose output counts the backwards through it (the user's forward runs inside)."""

    def counted(data_iterator: Any, model: nn.Module) -> Any:
        output, loss = step_func(data_iterator, model)
        if output.requires_grad:
            output.register_hook(lambda grad: counts.__setitem__(1, counts[1] + 1))
        return output, loss

    return counted


def weights(chunks: list[nn.Module]) -> list[float]:
    return torch.cat([p.detach().float().reshape(-1) for c in chunks for p in c.parameters()]).tolist()


def run_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case in turn on this rank; a case that raises reports its traceback instead."""
    out = []
    for case in cases:
        init(case.get("tp", 1), case.get("pp", 1))
        try:
            out.append(train(case, rank))
        except Exception:
            out.append({"error": traceback.format_exc()})
    return out
