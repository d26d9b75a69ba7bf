"""torchtitan's own components on CPU gloo ranks: its llama3 model from a shrunk debug config,
``parallelize_llama`` (FSDP2 ``dp_shard=2`` or ``TP=2``), its ``ChunkedLossWrapper`` loss, its
``OptimizersContainer`` and ``LRSchedulersContainer``, driven as its ``Trainer.train_step`` drives
them, guarded by ``TitanGuard`` or not. Used by the torchtitan tests, example and benchmark.

The CPU patch, and nothing else: FlexAttention has no CPU backward, so the attention's inner
kernel is torchtitan's ``ScaledDotProductAttention``; gloo has no ``PREMUL_SUM``, so FSDP reduces
with ``SUM`` (``set_force_sum_reduction_for_comms``; torchtitan divides by the token count itself).

Example:
    >>> spawn_ranks(titan_rank, "fsdp", "sqrt", 1, "skip", world=2)
    [{'skipped': [2], 'diag': {...}, ...}, {...}]
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from nanguard.findings import Diagnosis

__all__ = ["BAD_STEP", "VOCAB", "build", "model_config", "titan_rank"]

VOCAB = 256
BAD_STEP = 2
NAN_ROW = 200  # held by rank 1 under FSDP2 and TP (rows 128..255)
SEQ = 16
ATTENTION = "layers.1.attention"
"""Where the ``attn_sqrt`` fault takes a square root of negatives: the second block's attention."""


def build(setup: str, *, lr: float = 1e-3, layers: int = 2, dim: int = 64, loss: str = "chunked") -> dict[str, Any]:
    """The model, loss, optimizers and schedulers of a torchtitan trainer for ``setup`` ("fsdp":
    dp_shard=2, "tp": TP=2) on the 2 ranks of the current process group; ``loss`` "chunked"
    (torchtitan's default ``ChunkedLossWrapper``) or "ce" (its plain ``CrossEntropyLoss``)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    if setup not in ("fsdp", "tp"):
        raise ValueError(f"setup must be 'fsdp' or 'tp', got {setup!r}")
    parallel_dims.device_type = "cpu"  # torchtitan picks "cuda" when no accelerator is present
    config = model_config(layers=layers, dim=dim)
    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=2 if setup == "fsdp" else 1,
        cp=1,
        tp=2 if setup == "tp" else 1,
        pp=1,
        ep=1,
        world_size=2,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    parallelism = ParallelismConfig(
        spmd_backend="partial_dtensor", tensor_parallel_degree=dims.tp, data_parallel_shard_degree=dims.dp_shard
    )
    # The trainer declares the model's TP plan from its config (``update_from_config``); without it the
    # parallelize function shards nothing on the TP axis.
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)  # as the trainer sets it: its loss reads it
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    training = TrainingConfig(local_batch_size=2, seq_len=SEQ, mixed_precision_param="float32")
    parallelize_llama(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    if loss == "chunked":
        loss_fn = ChunkedLossWrapper.Config(
            num_chunks=2, loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB)
        ).build()
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    else:
        loss_fn = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build()
    optimizer_config = default_adamw(lr=lr)
    optimizer_config.implementation = "for-loop"
    optimizers = optimizer_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=100)
    return {"model": model, "loss_fn": loss_fn, "optimizers": optimizers, "lr_schedulers": schedulers, "dims": dims}


def model_config(*, layers: int = 2, dim: int = 64) -> Any:
    """torchtitan's llama3 debug model config shrunk (``layers`` layers, ``dim`` wide, vocabulary
    ``VOCAB``), its attention's inner kernel ``ScaledDotProductAttention`` (FlexAttention has no
    CPU backward)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    heads = 4
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=layers,
            dim=dim,
            n_heads=heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _batch(setup: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and labels (TP ranks share one batch; FSDP ranks each read their own)."""
    seed = step * 10 + (rank if setup == "fsdp" else 0)
    x = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


class _SqrtGrad(torch.autograd.Function):
    """Identity forward; its backward takes the square root of the gradient shifted negative."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * torch.sqrt(grad.abs() * 0.0 - 1.0)


def _plant(model: nn.Module, fault: str | None, on: dict[str, bool]) -> None:
    """While ``on``, layers.1.feed_forward.w1 takes the square root of negative values: in its
    forward (``sqrt``) or in its backward (``sqrt_grad``: the loss stays finite)."""
    if fault not in ("sqrt", "sqrt_grad", "attn_sqrt"):
        return
    w1: Any = model.get_submodule(ATTENTION if fault == "attn_sqrt" else "layers.1.feed_forward.w1")
    forward = w1.forward

    def faulty(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = forward(*args, **kwargs)
        if not on["bad"]:
            return out
        return _SqrtGrad.apply(out) if fault == "sqrt_grad" else torch.sqrt(out - 1.0)

    w1.forward = faulty


def _nan_row(model: nn.Module, row: int) -> None:
    """Row ``row`` of the token embedding NaN, as a bad checkpoint would load it: written by the
    rank whose shard holds it."""
    from nanguard.compat import row_offset

    weight: Any = model.get_submodule("tok_embeddings").weight
    start = row_offset(weight)
    shard = weight.to_local() if hasattr(weight, "to_local") else weight
    if start <= row < start + shard.shape[0]:
        with torch.no_grad():
            shard[row - start] = float("nan")


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def titan_rank(
    rank: int,
    world: int,
    setup: str,
    fault: str | None,
    fault_rank: int,
    policy: str | None,
    *,
    steps: int = 4,
    lr: float = 1e-3,
    check_batch: bool = False,
    loss: str = "chunked",
    wrap_loss: bool = True,
    disabled: bool = False,
) -> dict[str, Any]:
    """Train ``steps`` steps as torchtitan's ``train_step`` does; ``fault`` on ``fault_rank`` at
    ``BAD_STEP``: "sqrt" (an op fault in the forward), "sqrt_grad" (one in the backward), "attn_sqrt"
    (one in ``ATTENTION``'s forward), "token" (a token id past the vocabulary), "label" (a label past
    it), "nan_row" (row ``NAN_ROW`` of the embedding NaN from the start, on the rank that holds it), or
    None; ``policy`` None trains unguarded; ``wrap_loss=False`` leaves out ``guard.loss`` (the replay
    cannot see the loss); ``disabled``: the guard built under ``NANGUARD_DISABLE=1``."""
    from torchtitan.distributed import utils as dist_utils

    from nanguard.errors import NonFiniteError

    parts = build(setup, lr=lr, loss=loss)
    model, loss_fn, optimizers, schedulers = (
        parts["model"],
        parts["loss_fn"],
        parts["optimizers"],
        parts["lr_schedulers"],
    )
    on = {"bad": False}
    if rank == fault_rank:
        _plant(model, fault, on)
    if fault == "nan_row":
        _nan_row(model, NAN_ROW)
    guard = None if policy is None else _titan_guard(model, optimizers, schedulers, policy, check_batch, disabled)
    if guard is not None and wrap_loss:
        loss_fn = guard.loss(loss_fn)
    hooked = len(model._forward_pre_hooks) + len(model._forward_hooks) + len(optimizers._optimizer_step_pre_hooks)
    forwards = {"n": 0}  # the guard runs none of its own on a healthy step
    model.register_forward_pre_hook(lambda *a: forwards.__setitem__("n", forwards["n"] + 1))
    losses, norms, skipped = [], [], []
    positions = torch.arange(SEQ).expand(2, SEQ)
    raised = None
    for step in range(steps):
        optimizers.zero_grad()
        tokens, labels = _batch(setup, rank, step)
        on["bad"] = bad = step == BAD_STEP and rank == fault_rank
        if bad and fault in _BATCH_FAULTS:
            _BATCH_FAULTS[fault](tokens, labels)
        global_tokens = torch.tensor(labels.numel() * (2 if setup == "fsdp" else 1))
        value, _ = loss_fn(model(tokens, positions=positions), labels, global_tokens)
        value.backward()
        norm = dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)  # train_step's clip
        try:
            optimizers.step()
        except NonFiniteError as err:  # policy "raise", or parameters no skip can repair
            raised = err.diagnosis
            break
        schedulers.step()
        on["bad"] = False
        if guard is not None and guard.step_skipped:
            skipped.append(step)
            continue
        losses.append(_item(value.detach()))
        norms.append(float(norm.item()))
    d = _finish(guard, raised)
    return {
        "rank": rank,
        "dtensor_loss": type(value).__name__ == "DTensor",
        "losses": losses,
        "norms": norms,
        "skipped": skipped,
        "digest": _digest(model),
        "forwards": forwards["n"],
        "raised": raised is not None,
        "hooked": hooked,
        "diag": None if d is None else _fields(d, "fixes") | {"evidence": d.evidence},
    }


def _titan_guard(
    model: nn.Module, optimizers: Any, schedulers: Any, policy: str, check_batch: bool, disabled: bool
) -> Any:
    """``TitanGuard`` as ``docs/torchtitan.md`` builds it; ``disabled``: built under ``NANGUARD_DISABLE=1``."""
    import os

    from nanguard.integrations.torchtitan import TitanGuard

    if disabled:
        os.environ["NANGUARD_DISABLE"] = "1"
    try:
        return TitanGuard([model], optimizers, schedulers, policy, check_batch=check_batch, module_stats=False)
    finally:
        os.environ.pop("NANGUARD_DISABLE", None)


def _token_past_vocabulary(tokens: torch.Tensor, labels: torch.Tensor) -> None:
    tokens[0, 3] = VOCAB + 5


def _label_past_vocabulary(tokens: torch.Tensor, labels: torch.Tensor) -> None:
    labels[1, 2] = VOCAB + 7


# The faults planted in the batch at ``BAD_STEP``, by name.
_BATCH_FAULTS = {"token": _token_past_vocabulary, "label": _label_past_vocabulary}


def _item(value: torch.Tensor) -> float:
    """A scalar's value, read from this rank's local tensor when it is a DTensor."""
    return float((value.to_local() if hasattr(value, "to_local") else value).item())


def _finish(guard: Any, raised: Diagnosis | None) -> Diagnosis | None:
    """The run's diagnosis: the one a ``NonFiniteError`` carried, else the guard's last (None unguarded);
    the guard is closed."""
    if guard is None:
        return raised
    d = raised or guard.last_diagnosis
    guard.close()
    return d


def _fields(d: Diagnosis, *extra: str) -> dict[str, Any]:
    return {k: getattr(d, k) for k in ("cause", "op", "module", "phase", "rank", "ranks", "step", *extra)}
