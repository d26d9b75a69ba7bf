"""Proof, not suspicion: a peer rank re-computes a suspect rank's step, to tell a faulty device
from a software or data fault, and both from a transient one.

Under data parallelism every replica holds the same parameters, so any rank can compute any
rank's step: given the suspect's batch and RNG state, a healthy peer computes what the suspect
should have. On a trip the suspect (the rank the diagnosis names, else the first that flagged)
sends its batch and RNG state to a peer (the next rank that did not flag), point to point; both
re-compute the step with gradient communication off, and compare (loss and each parameter's
gradient norm, within a tolerance that nondeterministic reductions stay inside):

- both non-finite: the step reproduces everywhere, a software or data fault: the ordinary diagnosis;
- the suspect's non-finite (or different) where the peer's is finite: a faulty device
  (``hardware.faulty_device``), named, with both computations as evidence, unless the suspect's
  replay traced the value to an op doing what it does on its inputs (a log of a negative): then
  code or state that runs only on the suspect made the difference, and the ordinary diagnosis
  stands with the proof in its evidence (``rank_local``);
- both finite and alike: the fault came once and went (transient).

Every rank gets the same verdict (one all-gather of the two results). It costs nothing until a
trip; the peer's own batch is put back and its RNG state, buffers and parameters are restored by
the guard as after any replay, so a healthy run after it stays bit-identical. Needs no
determinism beyond what the tolerance allows.

Where it runs (``provable``): wherever a peer can compute the suspect's whole step. Under DDP (and
composable ``replicate``) every rank holds the whole model. Under FSDP2 (``fully_shard`` over one mesh
dimension, torchtitan's included) every rank's forward all-gathers the same full weights, so every rank
runs the re-computation together (the all-gathers are collectives), the peer on the suspect's batch; the
gradients are read unsharded, before any reduce-scatter. An engine says so itself (``replicas``: DeepSpeed,
whose replay gathers ZeRO-3's partitions on every rank). Not under tensor or pipeline parallelism (a
2-D mesh included): each rank computes a different slice or stage, no other rank computes the same
values, so nothing can be compared; the diagnosis says so (``verdict: "unproven"``) and never names the
hardware (``docs/drill.md``).
"""

from __future__ import annotations

import contextlib
import json
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.overrides import TorchFunctionMode

from nanguard import compat, dist
from nanguard.causes import TABLE
from nanguard.diagnose import faulty_device
from nanguard.findings import Diagnosis
from nanguard.hardware import where
from nanguard.rng import set_rng_state
from nanguard.stats import local
from nanguard.tree import leaves_with_path, path_str, tensors

__all__ = [
    "RTOL",
    "difference",
    "exchange",
    "judge",
    "peer_of",
    "provable",
    "prove",
    "proven",
    "recompute",
    "replicas",
    "rtol_of",
    "run_alone",
]

RTOL: Mapping[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-3,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}
"""How far two healthy computations of one step may differ, relatively, by the parameters' dtype:
reductions in another order (atomics, split-K, TF32 matmuls) stay well inside."""

# Causes a device cannot have made: the value is in the user's input, or in state every replica shares.
# Uninitialized memory differs between any two devices and runs: a peer computing it finite proves nothing.
_NOT_A_DEVICE = (
    "data.",
    "parameters.",
    "distributed.replica_divergence",
    "precision.loss_scale",
    "op.uninitialized_read",
)


def prove(
    model: nn.Module,
    closure: Callable[[], Any] | None,
    *,
    diag: Diagnosis,
    flagged: list[int],
    batch: Any,
    rng: Mapping[str, torch.Tensor] | None,
    own_loss: float,
) -> dict[str, Any] | None:
    """Re-compute the suspect rank's step on a peer; the proof's evidence (``verdict``: "everywhere",
    "device", "rank_local", "transient", "inconclusive" or "unproven", with why), the same on every rank, or
    None when no proof applies (not data parallel, no rank flagged, a cause no device makes).

    Every rank calls it with the agreed ``diag`` and ``flagged``; the others wait in its collectives.
    """
    if not _applies(closure, diag, flagged):
        return None
    assert closure is not None
    suspect = diag.rank if diag.rank in flagged else flagged[0]
    assert suspect is not None
    if (why_not := PIPELINE if diag.evidence.get("stage") else provable(model)) is not None:
        return {"suspect": suspect, "verdict": "unproven", "why": why_not}
    peer = peer_of(suspect, flagged)
    proof: dict[str, Any] = {"suspect": suspect, "peer": peer}
    results, unproven = recompute(model, closure, batch, rng, suspect, peer, own_loss=own_loss)
    if unproven is not None:
        return {**proof, "verdict": "unproven", "why": unproven}
    s, p = results[suspect], results[peer]
    verdict, why = judge(s, p, rtol=rtol_of(model))
    # The origin op did what it does on the values it got: the values reaching it differ between the two
    # ranks (code or state that runs only on the suspect, or an upstream miscomputation), not the device.
    if verdict == "device" and diag.cause in TABLE and TABLE[diag.cause].computed_from_inputs:
        verdict = "rank_local"
        why = (
            f"a peer computes the suspect's batch finite, but the suspect's replay traces the value to "
            f"{diag.op or 'an op'} doing what it does on the values it got ({diag.cause}): the values differ "
            "because of code or state that runs only on the suspect rank (a hook, a rank-conditional branch, "
            "rank-local buffers) or an upstream miscomputation; the device is not proven faulty"
        )
    proof.update(
        verdict=verdict,
        why=why,
        suspect_where=s.pop("where"),
        peer_where=p.pop("where"),
        suspect_result=_words(s),
        peer_result=_words(p),
        computations={"original": {"loss": s.pop("own_loss")}, "suspect": _brief(s), "peer": _brief(p)},
    )
    return proof


def peer_of(suspect: int, flagged: list[int]) -> int:
    """The rank that re-computes ``suspect``'s step: the next rank that did not flag, else the next rank.

    Example:
        >>> peer_of(1, flagged=[1, 2])   # on 4 ranks
        3
    """
    world = dist.world_size()
    ring = [(suspect + i) % world for i in range(1, world)]
    return next((r for r in ring if r not in flagged), ring[0])


def recompute(
    model: nn.Module,
    closure: Callable[[], Any],
    batch: Any,
    rng: Mapping[str, torch.Tensor] | None,
    suspect: int,
    peer: int,
    *,
    own_loss: float,
) -> tuple[list[dict[str, Any]], str | None]:
    """The suspect's step computed by the suspect and by the peer, on every rank by rank (``{"loss",
    "grad_norms", "finite", "where"}`` or ``{"error"}``, the suspect's with the ``own_loss`` its step had;
    the other ranks' entries are empty), or why it could not run. Every rank calls it: under FSDP2 every
    rank computes (the all-gathers are collectives)."""
    me = dist.rank()
    pair = me in (suspect, peer)
    sigs = exchange(_signature(batch, rng) if pair else None)
    mine = sigs[suspect]
    if mine is None or not mine["batch"]:
        return [], "the suspect rank passed no batch= (tensors) to Guard.step"
    peer_signature = sigs[peer]
    if peer_signature is None or peer_signature["batch"] != mine["batch"]:
        return [], "the peer's batch has other shapes or dtypes than the suspect's, so it cannot hold the suspect's"
    found = _one_side(model, closure, batch, rng, suspect, peer, mine)
    if me == suspect and found is not None:
        found["own_loss"] = own_loss
    return [r or {} for r in exchange(found)], None


def _one_side(
    model: nn.Module,
    closure: Callable[[], Any],
    batch: Any,
    rng: Mapping[str, torch.Tensor] | None,
    suspect: int,
    peer: int,
    signature: Mapping[str, Any],
) -> dict[str, Any] | None:
    """This rank's computation: the suspect's of its own step, the peer's of the suspect's (its own
    batch holding the suspect's values meanwhile); None on the other ranks (which compute their own step
    where the forward's collectives need every rank: FSDP2)."""
    me = dist.rank()
    if me == suspect:
        _send(batch, rng, peer)
        return {**_compute(model, closure, rng, reads=None), "where": _where(model)}
    if me == peer:
        theirs, their_rng = _receive(batch, signature, suspect)
        their_rng = _onto_own_devices(their_rng, model)
        try:
            with _holding(batch, theirs) as leaves:
                return {**_compute(model, closure, their_rng, reads=leaves), "where": _where(model)}
        except ValueError as err:  # the peer's batch cannot hold the suspect's: its own step keeps the others company
            if _gathers(model):
                _compute(model, closure, rng, reads=None)
            return {"error": str(err), "where": _where(model)}
    if _gathers(model):
        _compute(model, closure, rng, reads=None)
    return None


def proven(diag: Diagnosis, proof: Mapping[str, Any] | None, step: int) -> Diagnosis:
    """The diagnosis as the proof leaves it: a faulty device named, or the ordinary one with the proof."""
    if proof is None:
        return diag
    if proof["verdict"] == "device":
        return faulty_device(step=step, origin=diag, proof=proof)
    return replace(diag, evidence={**diag.evidence, "proof": dict(proof)})


def judge(suspect: Mapping[str, Any], peer: Mapping[str, Any], *, rtol: float) -> tuple[str, str]:
    """The verdict on two computations of one step (``{"loss", "grad_norms", "finite"}``, or
    ``{"error"}``): where the step reproduces, and why.

    Example:
        >>> judge({"loss": math.nan, "grad_norms": [1.0], "finite": False},
        ...       {"loss": 2.0, "grad_norms": [1.0], "finite": True}, rtol=1e-3)[0]
        'device'
    """
    for name, c in (("suspect", suspect), ("peer", peer)):
        if c.get("error"):
            return "unproven", f"the {name}'s re-computation failed: {c['error']}"
        if c.get("read") is False:
            return (
                "unproven",
                "the closure does not read the batch passed to Guard.step, so a peer cannot run another's",
            )
    s_bad, p_bad = not suspect["finite"], not peer["finite"]
    if s_bad and p_bad:
        return "everywhere", "the suspect's step is non-finite on the suspect and on a peer: software or data"
    if s_bad:
        return "device", "the suspect's step is non-finite on the suspect only: a peer computes it finite"
    if p_bad:
        return "inconclusive", "the suspect computes its step finite now, while the peer computes it non-finite"
    diff = difference(suspect, peer)
    if diff > rtol:
        return "device", f"both finite, but the suspect's values differ from the peer's by {diff:.3g} (> {rtol:g})"
    return "transient", f"the step is finite on the suspect and on a peer (within {rtol:g}): it came once and went"


# -- when a proof applies ----------------------------------------------------------------------


def _applies(closure: Any, diag: Diagnosis, flagged: list[int]) -> bool:
    if closure is None or not flagged or not dist.is_distributed():
        return False
    if diag.evidence.get("unobserved"):  # a replay that could not see the whole step: nor could a peer's
        return False
    return not diag.cause.startswith(_NOT_A_DEVICE)


TENSOR_PARALLEL = (
    "tensor parallel: each rank holds and computes a different slice of the layers (DTensor over a mesh "
    "dimension other than FSDP's), so no other rank computes the suspect's values to compare them with"
)
PIPELINE = (
    "pipeline parallel: each rank holds and computes a different stage of the model, so no other rank "
    "computes the suspect's values to compare them with"
)
NOT_REPLICATED = (
    "the ranks are not known to hold the same model (no DDP, FSDP2 or replicate wrapper: pipeline stages, or a "
    "loop that shares gradients itself), so no other rank is known to compute the suspect's step"
)


def provable(model: nn.Module) -> str | None:
    """None when a peer rank can compute any rank's whole step (DDP, ``replicate``, FSDP2 over one mesh
    dimension), else why not (tensor or pipeline parallel).

    Example:
        >>> provable(DistributedDataParallel(net)) is None
        True
    """
    from torch.distributed.tensor import DTensor

    if isinstance(model, nn.parallel.DistributedDataParallel) or compat.replicated(model) or model in _REPLICAS:
        return None
    meshes = {p.device_mesh.ndim for p in dist.unwrap(model).parameters() if isinstance(p, DTensor)}
    if _gathers(model):
        return None if meshes <= {1} else TENSOR_PARALLEL
    return TENSOR_PARALLEL if meshes else NOT_REPLICATED


def _gathers(model: nn.Module) -> bool:
    """Every rank's re-computation gathers the full weights (collectives every rank must join): FSDP2's
    forward all-gathers each module's; an engine that says so (``replicas``: DeepSpeed ZeRO-3)."""
    return compat.fully_sharded(model) or _REPLICAS.get(model, False)


_REPLICAS: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def replicas(model: nn.Module, *, gathers: bool) -> None:
    """Say that every rank's replay computes its whole step of ``model`` from the same full weights, so a peer
    can re-compute any rank's (an engine's own data parallelism, which no wrapper of ``model`` shows);
    ``gathers``: the replay gathers them with collectives, so every rank re-computes together.

    Example:
        >>> replicas(engine.module, gathers=True)   # DeepSpeed: ZeRO-3 gathers its partitions in a replay
    """
    _REPLICAS[model] = gathers


# -- the suspect's batch and RNG state, point to point ----------------------------------------------


def _tensors(batch: Any) -> list[tuple[str, torch.Tensor]]:
    return [(path_str("batch", p), t) for p, t in leaves_with_path(batch) if isinstance(t, torch.Tensor)]


def _signature(batch: Any, rng: Mapping[str, torch.Tensor] | None) -> dict[str, Any]:
    return {
        "batch": [[name, str(t.dtype), list(t.shape)] for name, t in _tensors(batch)],
        "rng": {k: [str(v.dtype), list(v.shape)] for k, v in (rng or {}).items()},
    }


def _send(batch: Any, rng: Mapping[str, torch.Tensor] | None, peer: int) -> None:
    device = dist._comm_device()
    for _, t in _tensors(batch):
        tdist.send(t.detach().to(device).contiguous(), dst=peer)
    for _, state in sorted((rng or {}).items()):
        tdist.send(state.to(device).contiguous(), dst=peer)


def _receive(
    batch: Any, signature: Mapping[str, Any], suspect: int
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor] | None]:
    device = dist._comm_device()
    theirs = []
    for (_, t), (_, dtype, shape) in zip(_tensors(batch), signature["batch"], strict=True):
        buf = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
        tdist.recv(buf, src=suspect)
        theirs.append(buf.to(t.device))
    states: dict[str, torch.Tensor] = {}
    for key, (dtype, shape) in sorted(signature["rng"].items()):
        buf = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
        tdist.recv(buf, src=suspect)
        states[key] = buf.cpu()
    return theirs, states or None


def _onto_own_devices(states: dict[str, torch.Tensor] | None, model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The suspect's CUDA generator states, in order, as those of this rank's own devices: the suspect
    drew from its cuda:3, the peer draws the same numbers from its cuda:5."""
    if not states:
        return states
    theirs = sorted((k for k in states if k.startswith("cuda:")), key=lambda k: int(k.partition(":")[2]))
    mine = sorted({p.device.index or 0 for p in dist.unwrap(model).parameters() if p.device.type == "cuda"})
    kept = {k: v for k, v in states.items() if not k.startswith("cuda:")}
    return {**kept, **{f"cuda:{index}": states[key] for key, index in zip(theirs, mine, strict=False)}}


@contextmanager
def _holding(batch: Any, theirs: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """The peer's batch tensors hold the suspect's values while open; its own come back after. A tensor
    that already holds them is left alone (position ids ``expand``ed from one row cannot be written); one
    that cannot hold them raises ``ValueError`` before anything was written."""
    pairs = [(t, v) for (_, t), v in zip(_tensors(batch), theirs, strict=True) if not torch.equal(t, v.to(t.device))]
    if any(torch._debug_has_internal_overlap(t) == 1 for t, _ in pairs):  # 1: MemOverlap.Yes
        raise ValueError("a batch tensor that differs from the suspect's is a view that cannot be written")
    saved = [t.detach().clone() for t, _ in pairs]
    try:
        with torch.no_grad():
            for leaf, value in pairs:
                leaf.copy_(value)
        yield [t for _, t in _tensors(batch)]
    finally:
        with torch.no_grad():
            for (leaf, _), value in zip(pairs, saved, strict=True):
                leaf.copy_(value)


def exchange(value: dict[str, Any] | None) -> list[dict[str, Any] | None]:
    """Every rank's ``value`` (None: it has none), by rank: one all-gather of JSON bytes.

    Example:
        >>> exchange({"loss": 2.0})   # on 2 ranks
        [{'loss': 2.0}, {'loss': 2.1}]
    """
    payload = json.dumps(value).encode() if value is not None else b""
    return [json.loads(p) if p else None for p in dist._all_gather_bytes(payload, dist._comm_device())]


# -- one computation of the step ---------------------------------------------------------------


def run_alone(model: nn.Module, closure: Callable[[], Any], rng: Mapping[str, torch.Tensor] | None) -> dict[str, Any]:
    """This rank's own step again from ``rng``, gradient communication off: ``{"loss", "grad_norms",
    "finite"}`` or ``{"error"}``. Every rank calls it where the forward's collectives need every rank (FSDP2).

    Example:
        >>> run_alone(model, closure, rng)["finite"]
        True
    """
    return _compute(model, closure, rng, reads=None)


class _Reads(TorchFunctionMode):
    """Notes whether any torch call reads one of ``leaves`` (the closure reads the batch it was given)."""

    def __init__(self, leaves: list[torch.Tensor]) -> None:
        super().__init__()
        self.ids = {id(t) for t in leaves}
        self.read = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.read:
            flat = [*args, *(kwargs or {}).values()]
            self.read = any(id(a) in self.ids for a in flat) or any(
                isinstance(a, (list, tuple)) and any(id(x) in self.ids for x in a) for a in flat
            )
        return func(*args, **(kwargs or {}))


def _compute(
    model: nn.Module,
    closure: Callable[[], Any],
    rng: Mapping[str, torch.Tensor] | None,
    *,
    reads: list[torch.Tensor] | None,
) -> dict[str, Any]:
    """Run the step (gradient communication off) from ``rng``: its loss and each gradient's norm."""
    if rng is not None:
        set_rng_state(rng)
    watch = _Reads(reads or [])

    def step() -> tuple[Any, list[float]]:
        out = closure()
        return out, _grad_norms(model)  # FSDP2's unsharded gradients live until the replay ends

    try:
        with torch.enable_grad(), watch if reads is not None else contextlib.nullcontext():
            out, norms = dist.replay_locally(model, step)
        loss = _loss_of(out)
    except Exception as err:  # the proof is evidence: a failure leaves the ordinary diagnosis
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    finite = math.isfinite(loss) and all(math.isfinite(n) for n in norms)
    found: dict[str, Any] = {"loss": loss, "grad_norms": norms, "finite": finite}
    if reads is not None:
        found["read"] = watch.read
    return found


def _loss_of(out: Any) -> float:
    """The closure's result as one number: a loss, or the sum of the losses it returns (a loop's micro-batches);
    a DTensor's local part (reading a whole one would be a collective only this rank runs)."""
    if isinstance(out, (int, float)):
        return float(out)
    found = [local(t).detach().float().sum() for t in tensors(out) if t.is_floating_point()]
    return float(sum(found)) if found else 0.0


def _grad_norms(model: nn.Module) -> list[float]:
    """Each parameter's gradient norm, whole: FSDP2's unsharded gradients (gradient sync is off), else ``.grad``."""
    with torch.no_grad():
        if _gathers(model):
            return [float(g.detach().float().norm()) for _, g in compat.fsdp_unsharded_grads(model)]
        params = [p for p in dist.unwrap(model).parameters() if p.requires_grad]
        return [float(p.grad.detach().float().norm()) if p.grad is not None else 0.0 for p in params]


def _where(model: nn.Module) -> dict[str, Any]:
    first = next(iter(dist.unwrap(model).parameters()), None)
    return where(first.device if first is not None else None)


def rtol_of(model: nn.Module) -> float:
    """The relative tolerance two computations of one step of ``model`` are held to (``RTOL`` by dtype)."""
    dtypes = {p.dtype for p in dist.unwrap(model).parameters() if p.is_floating_point()}
    return max((RTOL.get(d, RTOL[torch.float32]) for d in dtypes), default=RTOL[torch.float32])


def difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """The largest relative difference between two finite computations' loss and gradient norms.

    Example:
        >>> difference({"loss": 2.0, "grad_norms": [1.0]}, {"loss": 2.0, "grad_norms": [1.5]})
        0.3333333333333333
    """
    pairs = [(a["loss"], b["loss"]), *zip(a["grad_norms"], b["grad_norms"], strict=False)]
    return max((abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in pairs), default=0.0)


def _brief(c: Mapping[str, Any]) -> dict[str, Any]:
    """A computation as evidence: loss, total gradient norm, how many gradients are non-finite."""
    if c.get("error"):
        return {"error": c["error"]}
    norms = c["grad_norms"]
    total = math.sqrt(sum(n * n for n in norms)) if all(math.isfinite(n) for n in norms) else math.nan
    return {
        "loss": c["loss"],
        "grad_norm": total,
        "nonfinite_grads": sum(1 for n in norms if not math.isfinite(n)),
        "finite": c["finite"],
    }


def _words(c: Mapping[str, Any]) -> str:
    if c.get("error"):
        return "(failed)"
    return "finite" if c["finite"] else f"non-finite (loss {c['loss']:.4g})"
