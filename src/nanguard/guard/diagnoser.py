"""The diagnosis of a tripped step: replay it under the op tracer (and once more for
per-module statistics), agree on one diagnosis across ranks, and re-judge it with the run's
history. Each rank replays with its gradient communication off, so it sees only what its
own data and compute make.

A trip right after a trip of the same batch-independent fault (a float16 overflow every step
under ``policy="skip"``, a NaN weight) is not replayed in full again: one forward up to the
last origin's module confirms it, and the last diagnosis is reused with ``repeat_of``. A proven
diagnosis (a peer re-computed the step) is reused only for the same fault (rank, phase, op, module):
the step is replayed in full, and anything else is proven again.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from nanguard import compat, dist
from nanguard.diagnose import (
    communication_overflow,
    loaded_nonfinite,
    nonfinite_shards,
    nonfinite_update,
    rejected_batch,
    transient_fault,
    with_run_facts,
)
from nanguard.evidence import RunFacts
from nanguard.findings import Diagnosis
from nanguard.guard.fidelity import watched
from nanguard.guard.growth import WeightLog
from nanguard.guard.health import HealthFlag, StepHealth
from nanguard.guard.history import History
from nanguard.guard.optim_state import current_lr
from nanguard.guard.outlier import prove_spike
from nanguard.guard.policy import repeats
from nanguard.guard.proof import prove, proven
from nanguard.pipeline_stages import watch_stages
from nanguard.rng import private_generators, set_rng_state
from nanguard.stats import local
from nanguard.tracer import trace, weight_scale
from nanguard.tracer.collectives import choose
from nanguard.tracer.compiled import compiler_fault, eager
from nanguard.tracer.module_stats import module_stats
from nanguard.tree import tensors

__all__ = ["Diagnoser", "Replayed", "makes_nonfinite", "replay_trip"]

log = logging.getLogger("nanguard")


@dataclass
class Replayed:
    """What the replays of one tripped step found."""

    diagnosis: Diagnosis | None
    """The located diagnosis; None when the replay stayed finite or failed."""
    located: bool
    """Whether the tracer ran to the end (False when it failed or did not run)."""
    module_stats: dict[str, Any] | None = None
    """Per-module activation absmax and grad norm, for the report."""


@dataclass
class _LastTrip:
    step: int
    ranks: list[int]
    diagnosis: Diagnosis


class Diagnoser:
    """Builds the guard's diagnoses: of a tripped step, of a non-finite update, of a batch
    rejected before the forward.

    Example:
        >>> diagnoser = Diagnoser(model, optimizer, history, locate=True, module_stats=True)
        >>> diagnoser.tripped(closure, health, rng=rng, batch=batch).diagnosis.cause
        'op.log_domain'
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        history: History,
        *,
        locate: bool,
        module_stats: bool,
        comm: dist.CommWatch | None = None,
        prove: bool = True,
    ) -> None:
        self.model = model
        self.prove = prove
        self.comm = comm or dist.CommWatch()
        self.sharded = dist.is_distributed() and any(local(p) is not p for p in model.parameters())
        self.optimizer = optimizer
        self.history = history
        self.locate = locate
        self.module_stats = module_stats
        self._replays = 0  # the first replay of a run is news (a big model's may take a while); later ones are not
        # init.scale is about the weights the run started from, not weights grown by training.
        self.initial_scale = weight_scale(dist.unwrap(model))
        # How the weights grew since (sampled on the device, read on a trip): growth is not the init's doing.
        self.weights = WeightLog(dist.unwrap(model), optimizer)
        history.track(self.weights)
        self._last: _LastTrip | None = None
        self.spike_proof: dict[str, Any] | None = None  # what the last spike's proof found (guard/outlier.py)

    def tripped(
        self,
        closure: Callable[[], Any] | None,
        h: StepHealth,
        *,
        rng: Mapping[str, torch.Tensor] | None,
        batch: Any,
        closure_error: BaseException | None = None,
        trained: Any = None,
    ) -> Replayed:
        """Replay the step on every rank with the run's facts (history, initial weight scale); agree on one diagnosis.

        ``closure_error`` is the out-of-range index error the forward raised, if any: raised
        again unless the replay shows it was the data's fault. ``trained``: the step's loss as checked,
        which the replay is held to (``guard/fidelity.py``).
        """
        if closure_error is None and (repeat := self._repeat(closure, h, rng)) is not None:
            self._last = _LastTrip(h.step, h.bad_ranks, repeat)
            return Replayed(repeat, located=True)
        replayed = Replayed(None, located=False)
        gaps: list[str] = []
        run = self.run_facts(h.step)
        if self.locate and closure is not None:
            replay, stats = watched(closure, self.model, trained), self.module_stats
            with self._told(h.step), eager(), dist.observing() as gaps:
                replayed = replay_trip(
                    self.model, replay, batch=batch, rng=rng, step=h.step, with_module_stats=stats, run=run
                )
        found = replayed.diagnosis
        if found is None and replayed.located and closure is not None:
            found = self._compiled_again(closure, rng, h.step)
        if closure_error is not None and (found is None or not found.cause.startswith("data.")):
            raise closure_error  # not an id out of range: the user's own bug, theirs to see
        found, flagged = self._origin_beyond_the_replay(found, h)
        diag = dist.gather_diagnosis(found, flagged, choose=choose)
        if diag is None:
            diag = transient_fault(
                step=h.step,
                loss=h.loss,
                grad_norm=h.grad_norm,
                flagged_ranks=h.bad_ranks,
                located=replayed.located,
                distributed=dist.is_distributed(),
                attempted=self.locate and closure is not None,
                unobserved=_agreed(gaps + _private_draws(closure, dist.unwrap(self.model))),
            )
        diag = replace(diag, step=h.step)
        # A traced diagnosis was judged with the facts in its one diagnose; the others are judged here.
        diag = with_run_facts(diag, run)
        reused = self._proof_of_last(diag, h)
        replayed.diagnosis = reused if reused is not None else self._proven(diag, closure, h, batch, rng)
        self._last = _LastTrip(h.step, h.bad_ranks, replayed.diagnosis)
        return replayed

    def _origin_beyond_the_replay(self, found: Diagnosis | None, h: StepHealth) -> tuple[Diagnosis | None, list[int]]:
        """The diagnosis and the ranks it names, where the origin is not in one rank's own replay: a
        bad shard (FSDP2) or the comm hook's cast (the wire)."""
        flagged = h.bad_ranks
        if self.sharded:
            # Under FSDP2 every rank all-gathers a bad shard and reproduces its NaN: the rank
            # that holds the shard is the origin.
            shard = self._nonfinite_shards(h.step)
            if shard_ranks := dist.agree_flag(shard is not None):
                found, flagged = shard, shard_ranks
        if found is None and (wire_ranks := h.ranks_with(HealthFlag.WIRE)):
            # Not reproduced without communication: the comm hook's cast made it, on these ranks.
            found, flagged = self._wire_overflow(h.step), flagged or wire_ranks
        return found, flagged

    @contextlib.contextmanager
    def _told(self, step: int) -> Iterator[None]:
        """Say that a replay runs and how long it took: at WARNING for the run's first (on rank 0), when
        a big model's pause would otherwise be silent; at INFO for the later ones."""
        level = logging.WARNING if self._replays == 0 and dist.rank() == 0 else logging.INFO
        self._replays += 1
        log.log(level, "nanguard: replaying step %d under the tracer…", step)
        start = time.perf_counter()
        yield
        log.log(level, "nanguard: replayed step %d in %.1fs", step, time.perf_counter() - start)

    def _proven(
        self, diag: Diagnosis, closure: Callable[[], Any] | None, h: StepHealth, batch: Any, rng: Any
    ) -> Diagnosis:
        """A rank's own fault, or its device's? A peer re-computes the suspect's step (``guard/proof.py``)."""
        if not (self.prove and self.locate):
            return diag
        flagged, own = h.bad_ranks, h.own_loss
        proof = prove(self.model, closure, diag=diag, flagged=flagged, batch=batch, rng=rng, own_loss=own)
        return proven(diag, proof, h.step)

    def spiked(
        self, closure: Callable[[], Any] | None, h: StepHealth, metric: str, *, batch: Any, rng: Any
    ) -> Diagnosis | None:
        """A finite spike that one rank's device made (``guard/outlier.py``): ``hardware.faulty_device``, else
        None (what the proof found in ``spike_proof``). Every rank calls it on the same spike; on one process,
        or with ``prove=False``, it is None."""
        if not (self.prove and self.locate) or closure is None or not dist.is_distributed() or h.joined:
            return None
        diag, self.spike_proof = prove_spike(self.model, closure, step=h.step, metric=metric, batch=batch, rng=rng)
        if diag is None:
            log.info("nanguard: step %d: %s spike: %s", h.step, metric, self.spike_proof.get("why"))
        return diag

    def _proof_of_last(self, diag: Diagnosis, h: StepHealth) -> Diagnosis | None:
        """The last trip's proven diagnosis for this step when this is the same fault again: the next step,
        the same ranks, a repeatable cause, and the same rank, phase, op, module, kind and cause of the
        origin; None otherwise (a different fault is proven again)."""
        last = self._last
        if last is None or not isinstance(last.diagnosis.evidence.get("proof"), dict):
            return None
        before = last.diagnosis
        if not repeats(last.step, last.ranks, before.cause, h.step, h.bad_ranks):
            return None
        origin = before.evidence.get("origin_cause", before.cause)
        if (diag.rank, diag.phase, diag.op, diag.module, diag.kind, diag.cause) != (
            before.rank,
            before.phase,
            before.op,
            before.module,
            before.kind,
            origin,
        ):
            return None
        return replace(before, step=h.step, evidence={**copy.deepcopy(before.evidence), "repeat_of": last.step})

    def _compiled_again(self, closure: Callable[[], Any], rng: Mapping[str, torch.Tensor] | None, step: int) -> Any:
        """A compiled model whose eager replay was finite: ``compile.numerics`` when the step is non-finite
        again through the compiled code (``tracer/compiled.py``); None otherwise, or when that check fails."""
        try:
            return compiler_fault(
                self.model, closure, rng=rng, step=step, replay=lambda fn: dist.replay_locally(self.model, fn)
            )
        except Exception as err:  # evidence only: never worth killing training
            warnings.warn(f"nanguard: the compiled replay of step {step} failed: {err!r}", stacklevel=5)
            return None

    def _repeat(
        self, closure: Callable[[], Any] | None, h: StepHealth, rng: Mapping[str, torch.Tensor] | None
    ) -> Diagnosis | None:
        """The last trip's diagnosis for this step, when this trip directly follows it on the same
        ranks with a repeatable cause (``Cause.repeatable``), and one forward shows the last origin's module making
        a non-finite output from finite inputs again on each flagged rank; else None.

        Every rank takes the same branch: the trips and the diagnosis they compare are agreed.
        """
        found = self._repeatable(closure, h)
        if found is None or closure is None:
            return None
        last, module = found
        if rng is not None:
            set_rng_state(rng)
        try:
            with eager():
                seen = dist.replay_locally(self.model, lambda: makes_nonfinite(module, closure))
        except Exception as err:  # the full replay follows: never worth killing training
            warnings.warn(f"nanguard: the repeat check of step {h.step} failed: {err!r}", stacklevel=5)
            seen = False
        expected = not dist.is_distributed() or dist.rank() in h.bad_ranks
        if dist.agree_flag(expected and not seen):
            return None
        diag = last.diagnosis
        log.info("nanguard: step %d repeats the trip of step %d in %s", h.step, last.step, diag.module)
        return replace(diag, step=h.step, evidence={**copy.deepcopy(diag.evidence), "repeat_of": last.step})

    def _repeatable(self, closure: Callable[[], Any] | None, h: StepHealth) -> tuple[_LastTrip, nn.Module] | None:
        """The last trip and its origin's module when this trip may repeat it (``_repeat``): it directly
        follows on the same ranks, with a repeatable cause made in the forward of a module, by ranks that
        replay alone and unproven; else None. The same on every rank (what it reads is agreed)."""
        last = self._last
        if not self.locate or closure is None or last is None or self.sharded or h.joined:
            return None
        diag = last.diagnosis
        if not repeats(last.step, last.ranks, diag.cause, h.step, h.bad_ranks):
            return None
        if diag.evidence.get("communication"):
            return None  # ranks that replay together (TP, PP) cannot each stop their forward early
        if (diag.evidence.get("proof") or {}).get("verdict", "unproven") != "unproven":
            return None  # a proven fault repeats only as the same op too: replayed in full (_proof_of_last)
        module = dict(dist.unwrap(self.model).named_modules()).get(diag.module) if diag.phase == "forward" else None
        return None if module is None else (last, module)

    def _nonfinite_shards(self, step: int) -> Diagnosis | None:
        """This rank's own non-finite parameter shards, or None (host reads: on a trip only)."""
        counts = []
        with torch.no_grad():
            for name, p in dist.unwrap(self.model).named_parameters():
                shard = local(p).detach()
                nan, inf = int(shard.isnan().sum()), int(shard.isinf().sum())
                if nan or inf:
                    counts.append((name, nan, inf))
        if not counts:
            return None
        return nonfinite_shards(
            step=step,
            parameters=[n for n, _, _ in counts],
            nan=sum(c[1] for c in counts),
            inf=sum(c[2] for c in counts),
            rank=dist.rank(),
        )

    def _wire_overflow(self, step: int) -> Diagnosis | None:
        over = self.comm.overflowed()
        if over is None:
            return None
        # The replay left this rank's own gradients in .grad: name the parameters whose values
        # overflow the wire dtype, not every parameter that shares their bucket.
        wire, in_bucket = getattr(torch, over.dtype), set(over.parameters)
        with torch.no_grad():
            hot = [
                n
                for n, p in dist.unwrap(self.model).named_parameters()
                if n in in_bucket and p.grad is not None and not torch.isfinite(p.grad.abs().amax().to(wire))
            ]
        return communication_overflow(
            step=step,
            hook=over.hook,
            wire_dtype=over.dtype,
            parameters=hot or over.parameters,
            absmax=over.absmax,
            rank=dist.rank(),
        )

    def nonfinite_update(self, step: int, ranks: list[int]) -> Diagnosis:
        """The update of ``step`` left non-finite parameters on ``ranks``; name them."""
        named = list(dist.unwrap(self.model).named_parameters())
        with torch.no_grad():
            finite = [bool(torch.isfinite(local(p)).all()) for _, p in named]  # on a trip only
        bad = [(n, p) for (n, p), ok in zip(named, finite, strict=True) if not ok]
        ranks = _owners(self.optimizer, [p for _, p in bad], ranks)
        distributed = dist.is_distributed()
        diag = nonfinite_update(
            step=step,
            optimizer=type(self.optimizer).__name__,
            hyperparameters={
                k: v for k, v in self.optimizer.param_groups[0].items() if isinstance(v, (int, float, bool))
            },
            bad_parameters=[n for n, _ in bad],
            rank=ranks[0] if distributed and ranks else dist.rank_or_none(),
            ranks=ranks if distributed else [],
            dtype=str(bad[0][1].dtype).removeprefix("torch.") if bad else None,
        )
        return with_run_facts(diag, RunFacts(self.history.evidence(step + 1, self._lr())))

    def loaded_parameters(self, step: int, ranks: list[int]) -> Diagnosis:
        """The parameters were non-finite before ``step``, as the guard was built or a state dict
        loaded them (no update of this guard wrote them): name them, and the rows that hold NaN/Inf."""
        root = dist.unwrap(self.model)
        named: list[tuple[str, str | None, torch.Tensor]] = [
            (n, n.rpartition(".")[0], p) for n, p in root.named_parameters()
        ]
        embeddings = {n for n, m in root.named_modules() if isinstance(m, nn.Embedding)}
        seen = {id(p) for _, _, p in named}
        named += [
            (f"optimizer.param_groups[{g}]['params'][{i}]", None, p)  # held by the optimizer only
            for g, group in enumerate(self.optimizer.param_groups)
            for i, p in enumerate(group["params"])
            if id(p) not in seen
        ]
        counts = []
        with torch.no_grad():  # host reads: on a trip only
            for name, module, p in named:
                t, rows = _nonfinite_rows(p)
                if rows is not None:
                    nan = int(t.isnan().sum())
                    bad = ~torch.isfinite(t)
                    found = {"name": name, "module": module, "nan": nan, "inf": int(bad.sum()) - nan, "rows": rows}
                    if module in embeddings and name.endswith(".weight"):
                        found["token_ids"] = rows  # an embedding's rows are the ids that read them
                    counts.append(found)
        mine = loaded_nonfinite(step=step, found=counts, rank=dist.rank_or_none(), ranks=[]) if counts else None
        # Every rank is here (the flag is agreed): each gets the diagnosis of a rank that holds them.
        diag = dist.gather_diagnosis(mine, ranks)
        return diag if diag is not None else loaded_nonfinite(step=step, found=[], rank=None, ranks=ranks)

    def rejected_batch(self, batch: Any, step: int) -> Diagnosis | None:
        """``check_batch`` before the forward: a diagnosis of its errors, or None."""
        from nanguard.audit import check_batch

        errors = [f for f in check_batch(batch, model=self.model) if f.severity == "error"]
        if not errors:
            return None
        ranks = [dist.rank()] if dist.is_distributed() else []
        return rejected_batch(errors, step=step, rank=dist.rank_or_none(), ranks=ranks)

    def _lr(self) -> Any:
        return current_lr(self.optimizer)

    def run_facts(self, step: int) -> RunFacts:
        """What the run's history says at ``step`` (growth, the LR, the initial weight scale): a
        replay of that step is judged with it, so a value that overflows because the run is
        diverging is named a divergence."""
        history = self.history.evidence(step, self._lr())
        grown = self.weights.evidence(step)
        if grown:
            history = {**history, "lr": self._lr(), "weights": grown}
        return RunFacts(history, self.initial_scale)


def _nonfinite_rows(p: torch.Tensor) -> tuple[torch.Tensor, list[int] | None]:
    """This rank's own values of ``p`` (an FSDP2 or TP shard, a ZeRO-3 partition, else ``p``) and the rows
    of the full parameter among them that hold NaN/Inf (up to 16); None when they are all finite."""
    zero3 = compat.zero3_partition(p)
    t = (zero3[0] if zero3 is not None else local(p)).detach()
    bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return t, None
    if zero3 is not None:  # a flat partition: its elements, as rows of the full parameter
        shape = tuple(p.__dict__.get("ds_shape", ()))
        row = math.prod(shape[1:]) if shape else 1
        flat = bad.nonzero().flatten()[:4096].tolist()
        return t, sorted({(zero3[1] + i) // row for i in flat})[:16]
    rows = bad.reshape(t.shape[0], -1).any(1).nonzero().flatten()[:16].tolist() if t.dim() else []
    start = compat.row_offset(p)  # a shard's rows, as rows of the full parameter
    return t, [start + r for r in rows]


class _Stop(Exception):
    """Ends a repeat check's forward once the watched module has answered."""


def makes_nonfinite(module: nn.Module, closure: Callable[[], Any]) -> bool:
    """Run ``closure`` until ``module`` first returns: True when its output is non-finite while
    its inputs are all finite (the fault starts inside it). The rest of the step is not run.

    Example:
        >>> makes_nonfinite(model.attn, closure)
        True
    """
    verdict = False

    def hook(_module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        nonlocal verdict
        out = [t for t in tensors(output) if t.is_floating_point()]
        if not any(not bool(torch.isfinite(t).all()) for t in out):
            return  # a later call of the module may be the one that overflows
        ins = [t for t in tensors((args, kwargs)) if t.is_floating_point()]
        verdict = all(bool(torch.isfinite(t).all()) for t in ins)
        raise _Stop

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.enable_grad():
            closure()
    except _Stop:
        pass
    finally:
        handle.remove()
    return verdict


def replay_trip(
    model: nn.Module,
    closure: Callable[[], Any],
    *,
    batch: Any,
    rng: Mapping[str, torch.Tensor] | None,
    step: int,
    with_module_stats: bool,
    run: RunFacts | None = None,
) -> Replayed:
    """Re-run ``closure`` from the step's RNG state under the tracer; a failure of nanguard's
    own only warns, since it must not kill training.

    Example:
        >>> replay_trip(model, closure, batch=batch, rng=rng, step=7, with_module_stats=False).diagnosis.cause
        'op.log_domain'
    """
    inner = dist.unwrap(model)
    if rng is not None:
        set_rng_state(rng)
    try:
        with watch_stages() as stages:
            found = dist.replay_locally(
                model, lambda: trace(closure, (), {}, model=inner, inputs={"batch": batch}, run=run)
            )
        if found is not None and stages:  # pipeline parallel: this rank's stage
            found = replace(found, evidence={**found.evidence, "stage": stages.evidence()})
        replayed = Replayed(found, located=True)
    except Exception as err:  # the guard's own failure must not kill training
        warnings.warn(f"nanguard: locate failed on step {step}: {err!r}", stacklevel=5)
        replayed = Replayed(None, located=False)
    # Every rank replays or none does: the replays' DDP forwards may broadcast buffers.
    if with_module_stats:
        if rng is not None:
            set_rng_state(rng)
        try:
            replayed.module_stats = dist.replay_locally(model, lambda: module_stats(inner, closure))
        except Exception as err:  # evidence for the report only: never worth killing training
            warnings.warn(f"nanguard: module stats failed on step {step}: {err!r}", stacklevel=5)
    return replayed


def _private_draws(closure: Callable[[], Any] | None, model: nn.Module) -> list[str]:
    """The step's own random generators (not the global ones a replay restores): a replay draws
    other numbers from them, so a finite replay proves nothing about the hardware."""
    if closure is None:
        return []
    return [
        f"the draws from the {found}, whose state the replay cannot restore"
        for found in private_generators(closure, model)
    ]


def _agreed(gaps: list[str]) -> list[str]:
    """What some rank's replay could not observe, the same on every rank (only a trip pays the collective)."""
    if not dist.is_distributed():
        return gaps
    flagged = dist.agree_flag(bool(gaps))
    return gaps or ([f"what the replay of rank(s) {flagged} could not observe"] if flagged else [])


def _owners(optimizer: torch.optim.Optimizer, bad: list[torch.Tensor], ranks: list[int]) -> list[int]:
    """Under a sharded optimizer (ZeRO), the ranks that own the ``bad`` parameters (each owner updated its
    own and broadcast them to every rank); else, or when it owns none of them, ``ranks``."""
    owners = compat.zero_owners(optimizer)
    if owners is None or not ranks:
        return ranks
    return sorted({owners[id(p)] for p in bad if id(p) in owners}) or ranks
