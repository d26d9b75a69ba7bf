"""What a zoo scenario is: ``Scenario`` (a fault on the tiny GPT) and ``Expect`` (the diagnosis it
must get), ``WildScenario`` and ``Case`` for faults outside the tiny GPT, and ``build``/``Run``, the
seeded model, optimizer and data a scenario trains on. The scenarios themselves are in
``scenarios.py`` (and ``dist_scenarios.py``, ``wild*.py``); this module imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from nanguard.zoo.gpt import GPT, GPTConfig, synthetic_batch

__all__ = [
    "BY_FIRST_BAD",
    "FIRST_BAD",
    "Batch",
    "Case",
    "Expect",
    "Run",
    "Scenario",
    "WildScenario",
    "build",
    "train_step",
]

Batch = dict[str, torch.Tensor]


FIRST_BAD = -1
"""``Expect.step``: the step where a plain, unguarded run first sees a non-finite loss or gradient, or
gradients whose float32 norm (``clip_grad_norm_``'s) is Inf."""
BY_FIRST_BAD = -2
"""``Expect.step``: at ``FIRST_BAD`` or before it: a run that grows for hundreds of steps may be caught while
still finite (the runaway rule), or at its first non-finite step, depending on the CPU's rounding."""


@dataclass(frozen=True)
class Expect:
    """What the fault determines. A field left None is not named, so it is not scored; only
    ``cause=None`` has a meaning of its own: a healthy run that must never trip."""

    cause: str | None
    op: str | None = None
    module: str | None = None
    phase: str | None = None
    kind: str | None = None
    rank: int | None = None
    ranks: tuple[int, ...] | None = None
    """Every rank whose own replay reproduces the fault (``diag.ranks``)."""
    step: int | None = None
    """The step the guard must trip at; None means the scenario's fault_step, ``FIRST_BAD`` the
    step a plain run first goes non-finite."""


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    expect: Expect
    config: dict[str, Any] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    fault: Callable[[GPT, Batch], Batch] | None = None
    fault_step: int = 3
    lr: float = 1e-3
    optimizer: str = "adamw"
    """"adamw", "sgd", or "adam_eps0" (Adam with eps=0)."""
    amp: bool = False
    """float16 autocast with a GradScaler."""
    steps: int = 0
    """Training steps of the zoo run; 0 means fault_step + 3."""
    ranks: int = 1
    """> 1: a torch.distributed scenario; the fault hits the last rank only."""
    dist_fault: str | None = None
    """For ranks > 1: "data" (fault on the last rank's batch), "comm" (synchronized gradients
    corrupted once), or "replica" (one rank's weights changed behind DDP's back)."""
    schedule: Callable[[int], float] | None = None
    """An LR schedule as users write one for ``LambdaLR`` (the factor at each step), stepped after every update."""
    after_update: Callable[[GPT, torch.optim.Optimizer], None] | None = None
    """The loop's own code after every update (a hand-written weight decay, a custom update rule)."""

    group = "gpt"

    @property
    def one_step(self) -> bool:
        """Is the fault visible to ``ng.locate`` on the fault step alone (no history, no ranks)?"""
        return self.ranks == 1 and not self.amp and self.expect.step is None

    @property
    def run_steps(self) -> int:
        return self.steps or self.fault_step + 3

    @property
    def trip_step(self) -> int | None:
        if self.expect.cause is None:
            return None
        return self.expect.step if self.expect.step is not None else self.fault_step


@dataclass
class Case:
    """A built wild scenario: ``fn(*args)`` runs the faulty step (forward and backward) and returns the loss."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    model: torch.nn.Module


@dataclass(frozen=True)
class WildScenario:
    name: str
    source: str
    """The public bug report it is modelled on, ``owner/repo#number``."""
    summary: str
    expect: Expect
    basis: str
    """What the expectation is derived from."""
    build: Callable[[], Case]

    group = "wild"
    """The zoo's own scenarios are group "gpt"."""


@dataclass
class Run:
    """A built scenario: the model, its optimizer, and the batch for each step."""

    scenario: Scenario
    model: GPT
    optimizer: torch.optim.Optimizer
    seed: int
    scaler: torch.amp.GradScaler | None = None
    rank: int = 0
    scheduler: torch.optim.lr_scheduler.LambdaLR | None = None

    def batch(self, step: int, faulty: bool = True) -> Batch:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.rank * 1009 + step)
        batch = synthetic_batch(self.model.config, gen)
        if faulty and self.scenario.fault is not None and step == self.scenario.fault_step:
            batch = self.scenario.fault(self.model, batch)
        return batch

    def optimizer_step(self) -> None:
        """Step the optimizer as a plain (unguarded) loop would, through the scaler when there is one."""
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.after_step()

    def after_step(self) -> None:
        """What the loop runs after the update, guarded or not: its own code, then the LR schedule's step."""
        if self.scenario.after_update is not None:
            with torch.no_grad():
                self.scenario.after_update(self.model, self.optimizer)
        if self.scheduler is not None:
            self.scheduler.step()

    def closure(self, batch: Batch, model: torch.nn.Module | None = None) -> Callable[[], torch.Tensor]:
        """The training closure for ``batch``: autocast and the scaler when the scenario uses them."""
        net = model if model is not None else self.model

        def closure() -> torch.Tensor:
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16, enabled=self.scenario.amp):
                _, loss = net(**batch)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            return loss

        return closure

    def batches(self, steps: int) -> Iterator[tuple[int, Batch]]:
        for step in range(steps):
            yield step, self.batch(step)


def train_step(model: GPT, batch: Batch) -> torch.Tensor:
    """One closure body: zero grads, forward, backward; returns the loss."""
    model.zero_grad(set_to_none=True)
    _, loss = model(**batch)
    loss.backward()
    return loss


def build(scenario: Scenario, seed: int = 0, rank: int = 0) -> Run:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**scenario.config)).to(scenario.dtype)
    params = model.parameters()
    if scenario.optimizer == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(params, lr=scenario.lr)
    elif scenario.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=scenario.lr)
    elif scenario.optimizer == "adam_eps0":
        optimizer = torch.optim.Adam(params, lr=scenario.lr, eps=0.0)
    else:
        raise ValueError(f"optimizer must be 'adamw', 'sgd' or 'adam_eps0', got {scenario.optimizer!r}")
    scaler = torch.amp.GradScaler("cpu") if scenario.amp else None
    schedule = scenario.schedule
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if schedule is not None else None
    return Run(scenario, model, optimizer, seed, scaler, rank, scheduler)


# -- faults ---------------------------------------------------------------------------
