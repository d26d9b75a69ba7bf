"""``nanguard bisect``: the first bad step of a run that had no guard, found from its checkpoints.

The user's setup function returns the run's parts (model, optimizer, optionally scheduler and
scaler) and three functions: ``load(path) -> step`` restores one checkpoint, ``batches(start)``
yields the run's batches from ``start`` on, ``closure(batch) -> loss`` runs one step's forward and
backward. Every checkpoint is loaded and checked for non-finite values; the replay starts from the
latest finite one and runs each step under a ``Guard(policy="raise")``: the first trip is the first
bad step, diagnosed as a guarded run would have diagnosed it.

nanguard itself never unpickles: the user's ``load`` reads the checkpoint, however it likes.
Under torch.distributed every rank runs the same bisection and every rank gets the same result.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanguard import dist
from nanguard.errors import NanguardError, NonFiniteError
from nanguard.findings import Diagnosis
from nanguard.report.load import ShowProgress, progress_of
from nanguard.specs import call, resolve
from nanguard.stats import local

__all__ = ["Bisection", "Checkpoint", "bisect"]

REQUIRED = ("model", "optimizer", "load", "batches", "closure")
OPTIONAL = ("scheduler", "scaler")
RECENT = 16  # the last steps' loss and grad norm kept for the report


@dataclass
class Checkpoint:
    """One entry of the checkpoint directory: the step ``load`` returned (None: ``load`` refused
    it), and what in it is non-finite (None: every value is finite)."""

    path: str
    step: int | None
    nonfinite: str | None = None
    refused: str | None = None

    @property
    def finite(self) -> bool:
        return self.step is not None and self.nonfinite is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "step": self.step,
            "finite": self.finite,
            "nonfinite": self.nonfinite,
            "refused": self.refused,
        }


@dataclass
class Bisection:
    """What ``bisect`` found. ``first_bad_step`` None: every replayed step was finite."""

    first_bad_step: int | None
    checkpoint_step: int
    checkpoint: str
    steps_replayed: int
    diagnosis: Diagnosis | None
    last_step: int | None
    """The last step replayed (finite or not); None when none was."""
    until: int | None
    checkpoints: list[Checkpoint]
    spikes: list[dict[str, Any]] = field(default_factory=list)
    recent: list[dict[str, Any]] = field(default_factory=list)
    """The last finite steps before the end: ``{"step", "loss", "grad_norm"}``."""
    stepped_back: list[int] = field(default_factory=list)
    """Later finite checkpoints (their steps) where the run was already diverging: the replay from
    each tripped on the divergence before the spike detectors were warm, so an earlier one was used."""

    @property
    def rows(self) -> list[int] | None:
        """The batch rows that held the bad values, when the diagnosis can tell them."""
        rows = self.diagnosis.evidence.get("rows") if self.diagnosis is not None else None
        return list(rows) if isinstance(rows, list) else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "first_bad_step": self.first_bad_step,
            "checkpoint_step": self.checkpoint_step,
            "checkpoint": self.checkpoint,
            "steps_replayed": self.steps_replayed,
            "last_step": self.last_step,
            "until": self.until,
            "rows": self.rows,
            "diagnosis": self.diagnosis.to_dict() if self.diagnosis is not None else None,
            "checkpoints": [c.to_dict() for c in self.checkpoints],
            "spikes": self.spikes,
            "recent": self.recent,
            "stepped_back": self.stepped_back,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Bisection:
        """The inverse of ``to_dict``."""
        diag = data["diagnosis"]
        return cls(
            first_bad_step=data["first_bad_step"],
            checkpoint_step=data["checkpoint_step"],
            checkpoint=data["checkpoint"],
            steps_replayed=data["steps_replayed"],
            diagnosis=Diagnosis.from_dict(diag) if diag is not None else None,
            last_step=data["last_step"],
            until=data["until"],
            checkpoints=[Checkpoint(c["path"], c["step"], c["nonfinite"], c["refused"]) for c in data["checkpoints"]],
            spikes=list(data["spikes"]),
            recent=list(data["recent"]),
            stepped_back=list(data["stepped_back"]),
        )

    def summary(self) -> str:
        """One line: the first bad step and where the replay started, or how far it stayed finite."""
        start = f"replayed {self.steps_replayed} step(s) from {self.checkpoint} (step {self.checkpoint_step})"
        if self.first_bad_step is None:
            end = "the end of the batches" if self.last_step is None or self.until is None else f"step {self.until}"
            return f"every step is finite up to {end}: {start}"
        cause = self.diagnosis.cause if self.diagnosis is not None else "unknown"
        back = ""
        if self.stepped_back:
            back = f" (already diverging at the checkpoint(s) of step {', '.join(map(str, self.stepped_back))})"
        return f"first bad step: {self.first_bad_step} ({cause}); {start}{back}"


@dataclass
class _Parts:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    load: Callable[[str], Any]
    batches: Callable[[int], Any]
    closure: Callable[[Any], Any]
    scheduler: Any = None
    scaler: Any = None


def bisect(
    setup: str | Callable[[], Mapping[str, Any]] | Mapping[str, Any],
    checkpoints: str | os.PathLike[str],
    *,
    until: int | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    progress: ShowProgress | None = None,
) -> Bisection:
    """Find the first bad step of a run from its checkpoints, and diagnose it.

    ``setup`` is ``"pkg.module:function"`` (imported as ``nanguard replay`` imports, from the current
    directory too), the function itself, or the dict it returns: ``model``, ``optimizer``, optionally
    ``scheduler`` (stepped after each good step) and ``scaler`` (a GradScaler: the closure calls
    ``scaler.scale(loss).backward()``); ``load(path) -> int`` restores them from one entry of
    ``checkpoints`` and returns its step (the step of the next batch); ``batches(start)``: the run's
    batches from step ``start`` on, in the run's order; ``closure(batch) -> loss``: zero the
    gradients, forward, backward, return the loss. An entry ``load`` raises on is not a checkpoint.

    Every checkpoint is checked for non-finite values; the replay starts from the latest finite one
    and stops at the first trip (NaN/Inf, or a run diverging before it) or after step ``until``. A run
    already diverging at that checkpoint (its replay trips on the divergence before the spike
    detectors are warm) is replayed again from the finite checkpoint before it.
    ``run_dir`` keeps the replay's events and the trip's bundle. ``progress(total, label)`` is a
    context manager yielding ``advance(message)`` (``report.terminal.Console.progress``).

    Example:
        >>> found = ng.bisect("mytrain.bisect:setup", "ckpt/", until=48213)
        >>> found.first_bad_step, found.diagnosis.cause, found.checkpoint_step
        (48213, 'data.nonfinite', 48000)
    """
    if until is not None and (not isinstance(until, int) or isinstance(until, bool) or until < 0):
        raise ValueError(f"until must be an int >= 0 or None, got {until!r}")
    entries = _entries(checkpoints)
    parts = _parts(setup)
    table = _check_all(parts, entries, progress)
    start = _latest_finite(table, checkpoints)
    if table[-1] is not start:  # the state is another entry's: load the start again
        _reload(parts, start)
    found = _replay(parts, start, table, until=until, run_dir=run_dir, progress=progress)
    # A run already diverging at its checkpoint trips before the spike detectors are warm, late:
    # an earlier checkpoint shows where the divergence began.
    while _diverging_from_start(found) and (earlier := _before(table, found.checkpoint_step)) is not None:
        _reload(parts, earlier)
        back = [*found.stepped_back, found.checkpoint_step]
        found = _replay(parts, earlier, table, until=until, run_dir=run_dir, progress=progress)
        found.stepped_back = back
    return _as_the_origin_saw_it(found)


def _as_the_origin_saw_it(found: Bisection) -> Bisection:
    """Every rank's result as the rank the diagnosis names saw it (rank 0 without one): the rows of
    its batch, its own losses. The ranks already agree on the steps, the checkpoints and the cause."""
    if not dist.is_distributed():
        return found
    origin = found.diagnosis.rank if found.diagnosis is not None and found.diagnosis.rank is not None else 0
    payload = json.dumps(found.to_dict()).encode() if dist.rank() == origin else b""
    gathered = dist._all_gather_bytes(payload, dist._comm_device())
    return Bisection.from_dict(json.loads(gathered[origin]))


def _diverging_from_start(found: Bisection) -> bool:
    from nanguard.guard.config import GuardConfig

    cause = found.diagnosis.cause if found.diagnosis is not None else None
    return cause == "optimizer.divergence" and found.steps_replayed <= GuardConfig().spike_warmup


def _before(table: list[Checkpoint], step: int) -> Checkpoint | None:
    earlier = [c for c in table if c.finite and c.step is not None and c.step < step]
    return max(reversed(earlier), key=lambda c: c.step or 0) if earlier else None


def _reload(parts: _Parts, entry: Checkpoint) -> None:
    step = _checked_step(parts.load(entry.path), entry.path)
    if step != entry.step:
        raise ValueError(f"FUNCTION: load({entry.path!r}) returned step {entry.step}, then {step}")


# -- the setup ---------------------------------------------------------------------------------


_PART_TYPES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("model", lambda v: isinstance(v, nn.Module), "a torch.nn.Module"),
    ("optimizer", lambda v: isinstance(v, torch.optim.Optimizer), "a torch.optim.Optimizer"),
    ("load", callable, "a function"),
    ("batches", callable, "a function"),
    ("closure", callable, "a function"),
)
"""What each required part of the setup must be, and how an error words it."""


def _parts(setup: Any) -> _Parts:
    what, setup = _called(setup)
    expected = f"a dict with {', '.join(REQUIRED)} (and optionally {', '.join(OPTIONAL)})"
    if not isinstance(setup, Mapping):
        raise ValueError(f"FUNCTION: {what} returned a {type(setup).__name__}, not {expected}")
    missing = [k for k in REQUIRED if k not in setup]
    unknown = sorted(str(k) for k in setup if k not in REQUIRED + OPTIONAL)
    if missing or unknown:
        wrong = f"lacks {', '.join(missing)}" if missing else f"has unknown key(s) {', '.join(unknown)}"
        raise ValueError(f"FUNCTION: {what} returned a dict that {wrong}; expected {expected}")
    for key, valid, kind in _PART_TYPES:
        if not valid(setup[key]):
            raise ValueError(f"FUNCTION: {what}: {key!r} is a {type(setup[key]).__name__}, not {kind}")
    return _Parts(**{k: setup[k] for k in REQUIRED + OPTIONAL if k in setup})


def _called(setup: Any) -> tuple[str, Any]:
    """(how errors name the setup, what it gives): a "pkg.module:function" or a function is called."""
    if isinstance(setup, str):
        return repr(setup), call(resolve(setup, "FUNCTION", "pkg.module:function"), "FUNCTION", setup)
    if callable(setup) and not isinstance(setup, Mapping):
        what = getattr(setup, "__qualname__", "setup")
        return what, call(setup, "FUNCTION", what)
    return "setup", setup


# -- the checkpoints ---------------------------------------------------------------------------


def _entries(checkpoints: str | os.PathLike[str]) -> list[Path]:
    if not isinstance(checkpoints, (str, os.PathLike)):
        raise ValueError(f"checkpoints must be a directory path, got {type(checkpoints).__name__}")
    folder = Path(checkpoints)
    if not folder.is_dir():
        raise ValueError(f"--checkpoints: no such directory {str(checkpoints)!r}")
    entries = [p for p in folder.iterdir() if not p.name.startswith(".")]
    if not entries:
        raise ValueError(f"--checkpoints: {str(checkpoints)!r} is empty")
    return sorted(entries, key=_natural)


def _natural(path: Path) -> list[Any]:
    """``ckpt-9`` before ``ckpt-10``: digits compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def _checked_step(step: Any, path: str) -> int:
    """``load``'s answer, which must be the checkpoint's step."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"FUNCTION: load({path!r}) returned {step!r}, not the checkpoint's step (an int >= 0)")
    return step


def _check_all(parts: _Parts, entries: list[Path], progress: ShowProgress | None) -> list[Checkpoint]:
    """Load every entry and check it; the table agreed by every rank, in load order."""
    table: list[Checkpoint] = []
    _agree_count(len(entries))
    with progress_of(progress, len(entries), "checking checkpoints") as advance:
        for path in entries:
            entry = Checkpoint(str(path), None)
            try:
                step = parts.load(str(path))
            except Exception as err:  # not a checkpoint this load reads
                entry.refused = _one_line(err)
            else:
                entry.step = _checked_step(step, str(path))
                entry.nonfinite = _nonfinite(parts)
            table.append(_agreed(entry))
            advance(f"{path.name}: {_state(entry)}")
    return table


def _latest_finite(table: list[Checkpoint], checkpoints: str | os.PathLike[str]) -> Checkpoint:
    loaded = [c for c in table if c.step is not None]
    if not loaded:
        why = table[0].refused if table else "no entries"
        raise ValueError(
            f"--checkpoints: load accepts no entry of {str(checkpoints)!r} ({len(table)} tried; "
            f"{Path(table[0].path).name}: {why})"
        )
    finite = [c for c in loaded if c.finite]
    if not finite:
        first = min(loaded, key=lambda c: c.step or 0)
        raise NanguardError(
            f"every checkpoint is non-finite, the earliest too ({first.path}, step {first.step}: {first.nonfinite}): "
            "the first bad step comes before it"
        )
    return max(reversed(finite), key=lambda c: c.step or 0)  # of equal steps, the last in name order


def _nonfinite(parts: _Parts) -> str | None:
    """What in the restored state is non-finite: the first tensor named, and how many are."""
    named: list[tuple[str, torch.Tensor]] = [
        *((f"model: {n}", t) for n, t in dist.unwrap(parts.model).named_parameters()),
        *((f"model: {n}", t) for n, t in dist.unwrap(parts.model).named_buffers()),
    ]
    for i, state in enumerate(parts.optimizer.state.values()):
        named += [(f"optimizer: state {i} {k}", v) for k, v in state.items() if isinstance(v, torch.Tensor)]
    if parts.scaler is not None and getattr(parts.scaler, "is_enabled", lambda: False)():
        named.append(("scaler: scale", torch.as_tensor(float(parts.scaler.get_scale()))))
    bad = [
        (name, t)
        for name, t in named
        if t.is_floating_point() and local(t).numel() and not bool(torch.isfinite(local(t).detach()).all())
    ]
    if not bad:
        return None
    name, t = bad[0]
    data = local(t).detach()
    count = f"{int(torch.isnan(data).sum())} NaN, {int(torch.isinf(data).sum())} Inf"
    more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
    return f"{name} holds {count}{more}"


def _state(entry: Checkpoint) -> str:
    if entry.step is None:
        return f"not a checkpoint ({entry.refused})"
    return f"step {entry.step}, " + ("finite" if entry.nonfinite is None else f"non-finite: {entry.nonfinite}")


# -- the replay --------------------------------------------------------------------------------


def _replay(
    parts: _Parts,
    start: Checkpoint,
    table: list[Checkpoint],
    *,
    until: int | None,
    run_dir: str | os.PathLike[str] | None,
    progress: ShowProgress | None,
) -> Bisection:
    from nanguard.guard import Guard

    assert start.step is not None
    spikes: list[dict[str, Any]] = []
    recent: list[dict[str, Any]] = []

    def on_event(event: dict[str, Any]) -> None:
        if event["kind"] == "spike":
            spikes.append(event)
        elif event["kind"] == "step" and not event.get("skipped"):
            recent.append({"step": event["step"], "loss": event.get("loss"), "grad_norm": event.get("grad_norm")})
            del recent[:-RECENT]

    with _own_settings():  # NANGUARD_POLICY, _DISABLE, _INJECT are for training runs, not this replay
        guard = Guard(
            parts.model,
            parts.optimizer,
            policy="raise",
            scaler=parts.scaler,
            scheduler=parts.scheduler,
            run_dir=run_dir,
            on_event=on_event,
        )
    guard.load_state_dict({"step_count": start.step})
    found = Bisection(None, start.step, start.path, 0, None, None, until, table, spikes, recent)
    total = until - start.step + 1 if until is not None else 0
    try:
        with progress_of(progress, max(total, 0), f"replaying from step {start.step}") as advance:
            for step, batch in _steps(parts.batches, start.step, until):
                found.last_step = step
                found.steps_replayed += 1
                try:
                    guard.step(_bound(parts.closure, batch), batch=batch)
                except NonFiniteError as err:
                    found.diagnosis = err.diagnosis
                    diag_step = err.diagnosis.step if err.diagnosis is not None else None
                    found.first_bad_step = diag_step if diag_step is not None else step
                    advance(f"step {step}: {err.diagnosis.cause if err.diagnosis else 'non-finite'}")
                    break
                if parts.scheduler is not None:
                    parts.scheduler.step()
                advance(f"step {step}: finite")
    finally:
        guard.close()
    return found


def _steps(batches: Callable[[int], Any], start: int, until: int | None) -> Iterator[tuple[int, Any]]:
    """(step, batch) from ``start`` on; every rank stops where the first rank runs out of batches."""
    source = iter(batches(start))
    step = start
    while until is None or step <= until:
        batch = next(source, _END)
        if dist.agree_flag(batch is _END):
            return
        yield step, batch
        step += 1


_END = object()


def _bound(closure: Callable[[Any], Any], batch: Any) -> Callable[[], Any]:
    return lambda: closure(batch)


@contextlib.contextmanager
def _own_settings() -> Iterator[None]:
    saved = {
        k: os.environ.pop(k) for k in ("NANGUARD_POLICY", "NANGUARD_DISABLE", "NANGUARD_INJECT") if k in os.environ
    }
    try:
        yield
    finally:
        os.environ.update(saved)


# -- ranks agree -------------------------------------------------------------------------------


def _agree_count(count: int) -> None:
    if not dist.is_distributed():
        return
    counts = _gather([count])
    if len({c[0] for c in counts}) > 1:
        seen = ", ".join(f"rank {r}: {c[0]}" for r, c in enumerate(counts))
        raise ValueError(f"--checkpoints: the ranks see different entries ({seen}): use a directory every rank shares")


def _agreed(entry: Checkpoint) -> Checkpoint:
    """The entry as every rank sees it: a checkpoint where every rank's ``load`` accepted it at the
    same step, non-finite where any rank's state is."""
    if not dist.is_distributed():
        return entry
    rows = _gather([entry.step is not None, entry.step if entry.step is not None else -1, entry.nonfinite is not None])
    refused = [r for r, row in enumerate(rows) if not row[0]]
    if refused:
        if entry.step is not None:
            entry.step, entry.nonfinite = None, None
            entry.refused = f"rank(s) {refused} could not load it"
        return entry
    if len({r[1] for r in rows}) > 1:
        steps = ", ".join(f"rank {r}: {row[1]}" for r, row in enumerate(rows))
        raise ValueError(f"FUNCTION: load({entry.path!r}) returned different steps on the ranks ({steps})")
    bad = [r for r, row in enumerate(rows) if row[2]]
    if bad:
        mine = entry.nonfinite
        entry.nonfinite = f"non-finite on rank(s) {bad}" if mine is None else f"{mine} (rank(s) {bad})"
    return entry


def _gather(values: list[int | bool]) -> list[list[int]]:
    import torch.distributed as tdist

    mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=dist._comm_device())
    out = [torch.zeros_like(mine) for _ in range(dist.world_size())]
    tdist.all_gather(out, mine)
    return [t.tolist() for t in out]


# -- small helpers -----------------------------------------------------------------------------


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text if len(text) <= 200 else text[:200] + "..."
