"""The policy: every decision of a guarded step, from its ``Verdict`` to an ``Action``.

``Guard.step`` measures a step (health, replay, diagnosis) into a ``Verdict``, asks
``Policy.decide(verdict, state)`` for an ``Action``, and applies it. The policy reads the cause
table (``nanguard.causes``) and what the other parts report through ``state``; it changes
nothing but its own remedy budgets, so every decision is here and nowhere else:

- ``raise``, ``skip``, ``rollback``: the configured policy, unless the damage is already in the
  parameters (``Cause.skippable`` False, or a diagnosis of the optimizer phase), which a skip
  cannot repair;
- ``auto``: the remedy the cause's row names, within ``remedy_budget`` (``Cause.budgeted``);
- parameters non-finite as the guard was built or a state dict loaded them (``evidence["loaded"]``)
  stop the run under every policy: no skip repairs them and no snapshot holds better ones;
- skips and rollbacks in a row past ``max_consecutive_skips`` stop the run;
- a GradScaler overflow is the scaler's own skip, and its collapse is reset once under auto;
- replicas that differ are re-broadcast from a finite majority, else rolled back, else raised;
- a GradScaler scale below ``loss_scale_floor``, or ``max_overflow_streak`` overflows in a row, has
  collapsed;
- snapshots (rollback and auto policies) are taken as the guard starts and every ``snapshot_every``
  good steps; under torch.distributed the replicas' fingerprints are compared every
  ``fingerprint_every`` good steps;
- a deferred step (``sync="deferred"``) is decided with the next call, when its health is read;
- a trip right after a trip of a repeatable cause on the same ranks reuses its diagnosis (``repeats``),
  once one forward confirms it;
- a rollback happens only with a snapshot to roll back to (else the decision is a raise).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, get_args

from nanguard.causes import Cause, row_of
from nanguard.findings import Diagnosis
from nanguard.guard.config import GuardConfig
from nanguard.guard.verdict import Verdict

__all__ = [
    "ACTION_KINDS",
    "DEFER",
    "SANE_SCALE",
    "STEP",
    "Action",
    "ActionKind",
    "Policy",
    "Remedy",
    "RemedyKind",
    "State",
    "TripRecord",
    "repeats",
]

ActionKind = Literal["step", "skip", "rollback", "raise", "overflow", "reset_scale", "resync", "defer"]
"""What the guard does with a step (``Action.kind``)."""
ACTION_KINDS: tuple[ActionKind, ...] = get_args(ActionKind)
TripRecord = Literal["bundle", "tracked", "event"]
"""How an action's trip is recorded (``Action.trip``)."""
RemedyKind = Literal["skip", "quarantine", "upcast", "rollback", "lower_lr", "raise"]
"""A remedy entry's action (``guard.remedies``, the ``remedy`` event)."""
SANE_SCALE = 2.0**16  # GradScaler's own default initial scale


@dataclass(frozen=True)
class Remedy:
    """A remedy entry (``guard.remedies``): what ``Remedies.apply`` does and records."""

    action: RemedyKind
    target: Any = None
    reason: str = ""
    """Why; "" when the applier words what it did (a quarantine, a lowered LR)."""


@dataclass(frozen=True)
class Action:
    """What the guard does with a step: everything ``guard/apply.py`` switches on.

    ``kind``: "step" (update), "skip", "rollback", "raise", "overflow" (the GradScaler skipped
    the update itself), "reset_scale" (reset the collapsed GradScaler scale, then go on), or
    "resync" (re-broadcast the replicas from ``Verdict.source``), "defer" (the fused optimizer
    stepped on the device; the step is decided when its health is read, with the next call).
    """

    kind: ActionKind
    remedy: Remedy | None = None
    message: str | None = None
    """raise: the NonFiniteError's message (None: the diagnosis alone)."""
    lower_lr: bool = False
    """rollback: then multiply every LR by ``lr_factor``, and snapshot again."""
    stop: str | None = None
    """skip or rollback: then stop the run with this message (too many in a row)."""
    trip: TripRecord | None = None
    """How the step's trip is recorded before the action: "bundle" (a tripped step: the faults it
    answers marked, its hardware tracked, its trip event and bundle written, announced; a joined rank
    is told the outcome), "tracked" (replicas that differ: marked, tracked, a trip event over the
    differing ranks, announced), "event" (a collapsed loss scale: this rank's trip event); None: no trip."""
    counted: bool = False
    """skip or rollback: one more in a row (``max_consecutive_skips``); a rollback that repairs replicas is not."""
    forget: bool = False
    """skip of a step with no trip (a spike): its values leave the detectors' windows and its RNG draw
    is abandoned, as in a run that never saw the batch."""


STEP = Action("step")
DEFER = Action("defer")


class State(Protocol):
    """What the policy reads from the guard's other parts."""

    @property
    def has_snapshot(self) -> bool: ...
    @property
    def consecutive_skips(self) -> int: ...
    @property
    def upcast(self) -> list[str]: ...
    @property
    def last_diagnosis(self) -> Diagnosis | None: ...
    def can_upcast(self, module: str | None) -> str | None:
        """None when the module can run in float32, else why not."""
        ...


class Policy:
    """Decides every step; owns the remedy budgets.

    Example:
        >>> policy = Policy(GuardConfig(policy="auto"))
        >>> policy.decide(Verdict("trip", 7, diagnosis=Diagnosis(cause="data.nonfinite", phase="data")), state).kind
        'skip'
    """

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.used: dict[str, int] = {}
        """Remedies given per cause (``policy="auto"``)."""

    def decide(self, verdict: Verdict, state: State) -> Action:
        kind = verdict.kind
        if kind == "healthy":
            return STEP
        if kind == "spike":
            return self._in_a_row(Action("skip", forget=True), state, verdict) if self.config.skip_spikes else STEP
        if kind == "overflow":
            return Action("overflow")
        if kind == "deferred":
            return DEFER
        diag = verdict.diagnosis
        assert diag is not None, f"a {kind} verdict carries its diagnosis"
        if kind == "collapse":
            return self._collapse(diag)
        if kind == "replicas":
            return replace(self._replicas(verdict, state), trip="tracked")
        action = replace(self._trip(diag, state), trip="bundle")
        return self._in_a_row(action, state, verdict) if action.kind in ("skip", "rollback") else action

    def _trip(self, diag: Diagnosis, state: State) -> Action:
        """A tripped step: as the configured policy says, unless nothing in this run repairs it."""
        if diag.evidence.get("loaded"):  # non-finite as built or loaded: nothing in this run repairs them
            return _raise(
                diag,
                "the parameters were non-finite before any update of this guard (as built, or as a "
                "state dict loaded them): no skip repairs them and no snapshot holds better ones; "
                "fix the checkpoint",
            )
        return self._auto(diag, row_of(diag.cause), state) if self.config.policy == "auto" else self._plain(diag, state)

    def collapsed(self, scale: float, streak: int) -> bool:
        """Has the GradScaler's scale collapsed: below ``loss_scale_floor`` after an overflow, or
        ``max_overflow_streak`` overflows in a row?"""
        return scale < self.config.loss_scale_floor or streak >= self.config.max_overflow_streak

    @property
    def takes_snapshots(self) -> bool:
        """Whether the guard keeps a snapshot to roll back to (rollback and auto policies)."""
        return self.config.policy in ("rollback", "auto")

    def due(self, good_steps: int) -> tuple[bool, bool]:
        """What is due after this many good steps: the replicas' fingerprints compared (every
        ``fingerprint_every``; 0: never), and a snapshot (rollback and auto policies, every ``snapshot_every``).

        Example:
            >>> replicas, snapshot = policy.due(guard.recovery.good_steps)
        """
        c, every = self.config, self.config.fingerprint_every
        replicas = bool(every) and good_steps % every == 0
        return replicas, c.policy in ("rollback", "auto") and good_steps % c.snapshot_every == 0

    # -- the decisions -----------------------------------------------------------------
    def _plain(self, diag: Diagnosis, state: State) -> Action:
        """policy skip, rollback or raise: as configured, unless a skip cannot repair the damage."""
        policy, cause = self.config.policy, row_of(diag.cause)
        if policy == "skip" and (not cause.skippable or diag.phase == "optimizer"):
            if state.has_snapshot:
                return Action("rollback")
            if not cause.skippable:
                reason = (
                    f"skipping cannot help: {diag.cause} means the parameters already hold the damage, so every "
                    "later step would trip again; policy='rollback' or policy='auto' restores the last good snapshot"
                )
                return Action("raise", Remedy("raise", None, reason), f"{diag}\n{reason}")
            return Action("raise")
        if policy == "rollback" and not state.has_snapshot:
            return Action("raise", message=f"{diag}\n(no snapshot to roll back to)")
        return Action(_PLAIN[policy])

    def _auto(self, diag: Diagnosis, cause: Cause, state: State) -> Action:
        """policy auto: the remedy of the cause's row, within its budget."""
        # Quarantines and plain skips are bounded by the dataset and max_consecutive_skips.
        used = self.used[cause.id] = self.used.get(cause.id, 0) + cause.budgeted
        if used > self.config.remedy_budget:
            return _raise(
                diag, f"remedy_budget={self.config.remedy_budget} for {cause.id} is spent: the remedies did not hold"
            )
        if cause.remedy == "quarantine":
            return Action("skip", Remedy("quarantine"))
        if cause.remedy == "upcast":
            return self._upcast(diag, state)
        if cause.remedy == "rollback_lower_lr":
            factor = self.config.lr_factor
            if state.has_snapshot:
                return Action(
                    "rollback", Remedy("rollback", None, f"roll back, then LR x{factor:g}"), lower_lr=factor < 1
                )
            return Action("skip", Remedy("lower_lr"))
        if cause.remedy == "rollback":
            if state.has_snapshot:
                why = "the parameters hold the damage: restore the last snapshot"
                return Action("rollback", Remedy("rollback", None, why))
            return _raise(diag, f"{cause.id} cannot be skipped and there is no snapshot to roll back to")
        if _empty_samples(diag):
            # A fully masked row whose mask the batch carried: the sample behind the op is what repeats.
            return Action("skip", Remedy("quarantine"))
        return Action("skip", Remedy("skip", None, "no specific remedy for this cause"))

    def _upcast(self, diag: Diagnosis, state: State) -> Action:
        name = diag.module
        if name in state.upcast:
            return _raise(diag, f"module '{name}' overflowed again though it already runs in float32", target=name)
        why_not = state.can_upcast(name)
        if why_not is not None:
            return Action("skip", Remedy("skip", name, why_not))
        return Action("skip", Remedy("upcast", name, "autocast off and inputs cast to float32 in this module"))

    def _collapse(self, diag: Diagnosis) -> Action:
        """The GradScaler's scale collapsed: under auto, reset it once; else stop."""
        if self.config.policy != "auto":
            return Action("raise", trip="event")
        if self.used.get(diag.cause, 0) >= 1:
            return Action("raise", Remedy("raise", None, "the loss scale collapsed again after a reset"), trip="event")
        self.used[diag.cause] = 1
        reason = f"GradScaler scale reset to {SANE_SCALE:g}; raises if it collapses again"
        return Action("reset_scale", Remedy("skip", None, reason))

    def _replicas(self, verdict: Verdict, state: State) -> Action:
        """Replicas differ: re-broadcast from the finite majority, else roll back, else raise."""
        if self.config.policy == "raise":
            return Action("raise")
        if verdict.source is None:  # no finite replica to copy from
            return Action("rollback") if state.has_snapshot else Action("raise")
        return Action("resync")

    def _in_a_row(self, action: Action, state: State, verdict: Verdict) -> Action:
        """Skips and rollbacks in a row without a good step: past the limit, stop after this one (its
        message names the latest diagnosis: this verdict's, else the run's last)."""
        count, limit = state.consecutive_skips + 1, self.config.max_consecutive_skips
        if count < limit:
            return replace(action, counted=True)
        last = verdict.diagnosis or state.last_diagnosis
        stop = f"{count} steps skipped in a row (max_consecutive_skips={limit})" + (
            f"; last: {last.summary()}" if last else ""
        )
        return replace(action, counted=True, stop=stop)

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"used": dict(self.used)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.used = {str(k): int(v) for k, v in dict(state.get("used", {})).items()}


def repeats(last_step: int, last_ranks: list[int], last_cause: str, step: int, ranks: list[int]) -> bool:
    """Whether a trip may reuse the last trip's diagnosis (confirmed by one forward, ``guard/diagnoser.py``):
    it directly follows that trip, on the same ranks, and its cause is one that repeats every step
    (``Cause.repeatable``: a float16 overflow, a NaN weight), not one a batch makes."""
    return last_step == step - 1 and bool(ranks) and last_ranks == ranks and row_of(last_cause).repeatable


_PLAIN: dict[str, ActionKind] = {"skip": "skip", "rollback": "rollback", "raise": "raise"}
"""The action each plain policy takes on a trip it can take."""


def _raise(diag: Diagnosis, reason: str, target: Any = None) -> Action:
    return Action("raise", Remedy("raise", target, reason), f"{diag}\n{reason}")


def _empty_samples(diag: Diagnosis) -> bool:
    """Does ``diag`` name the batch rows of samples whose mask is empty (``data.fully_masked`` among
    its other causes, with the rows in its evidence)?"""
    rows = diag.evidence.get("rows") if isinstance(diag.evidence, dict) else None
    return bool(rows) and any(a.get("cause") == "data.fully_masked" for a in diag.also)
