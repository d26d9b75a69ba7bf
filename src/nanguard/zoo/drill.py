"""``nanguard drill`` and the chaos soak: the tiny GPT trains under the guard while
``nanguard.inject`` plants every kind of fault, and the run is checked against what the guard
promises.

Each rank records every step's action and the exact bits of the weights and optimizer state
before every step: a skip must leave them bit-identical, a rollback must restore exactly the state
before the snapshot's step, however far back that is. After the run, a fresh model trained
(unguarded) on only the batches whose updates survived must end with bit-identical weights. The
parent compares the ranks' decisions step by step.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from nanguard.inject import FAULTS, Fault

__all__ = ["chaos_faults", "check_drill", "drill_rank", "run_drill", "standard_drill"]

_MODULES = ("blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp", "wte")


def standard_drill(world: int) -> list[Fault]:
    """The drill ``nanguard drill`` runs: one fault of each kind, on rank 0 and on a middle rank,
    8 steps apart (a skipped spike stays in the history the divergence rule reads for 5 steps).

    Example:
        >>> [f.spec for f in standard_drill(2)][:2]
        ['nan_grad@step=15,rank=1', 'inf_loss@step=23,rank=0']
    """
    middle = world // 2
    return [
        Fault("nan_grad", step=15, rank=middle),
        Fault("inf_loss", step=23, rank=0),
        Fault("nan_param", step=31, rank=middle, module="blocks.1.mlp"),
        Fault("spike_loss", step=39, rank=0, factor=1e4),
        Fault("corrupt_allreduce", step=47, rank=middle),
        Fault("stall", step=55, rank=middle, seconds=0.5),
    ]


def chaos_faults(seed: int, *, steps: int, world: int, gap: int = 6, first: int = 15) -> list[Fault]:
    """Faults of every kind at seeded random steps (``gap`` apart at least) on random ranks.

    Every kind is planted (in turn, then at random); a step's rank and module are random too.

    Example:
        >>> len(chaos_faults(0, steps=200, world=2)) >= len(FAULTS)
        True
    """
    rng = random.Random(seed)
    kinds = list(FAULTS)
    faults: list[Fault] = []
    step = first
    while step < steps - gap:
        kind = kinds[len(faults)] if len(faults) < len(kinds) else rng.choice(kinds)
        module = rng.choice(_MODULES) if kind in ("nan_grad", "nan_param") else None
        faults.append(Fault(kind, step=step, rank=rng.randrange(world), module=module, seconds=0.2))
        step += gap + rng.randrange(gap)
    return faults


def _model() -> torch.nn.Module:
    from nanguard.zoo import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32))


def _batch(model: torch.nn.Module, rank: int, step: int) -> dict[str, torch.Tensor]:
    from nanguard.zoo import GPT, synthetic_batch

    assert isinstance(model, GPT)
    return synthetic_batch(model.config, torch.Generator().manual_seed(rank * 100_003 + step), batch_size=4)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Weights and optimizer state, flat: what a skip must leave and a rollback restore."""
    parts = [p.detach().reshape(-1) for p in model.parameters()]
    for state in optimizer.state.values():
        parts += [v.detach().reshape(-1).float() for v in state.values() if isinstance(v, torch.Tensor)]
    return torch.cat(parts).clone()


def _digest(state: torch.Tensor) -> bytes:
    """The exact bits of a ``_state``, in 32 bytes: one is kept for every step, since a rollback
    may restore a snapshot from any step back (``snapshot_every`` good steps apart, or older while
    the guard holds its refreshes as the run grows), and a whole state per step would not fit."""
    return hashlib.sha256(state.contiguous().numpy().tobytes()).digest()


# The drill's Guard: every remedy on, snapshots often, and no limit that would end the drill early.
_SETTINGS: dict[str, Any] = {
    "policy": "auto",
    "skip_spikes": True,
    "snapshot_every": 4,
    "remedy_budget": 10**6,
    "max_consecutive_skips": 10**6,
    "headroom_every": 0,
}


def drill_rank(
    rank: int,
    world: int,
    faults: Sequence[dict[str, Any]],
    steps: int,
    run_dir: str | None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One rank's drill (under a process group when ``world > 1``): a guarded loop with ``faults``
    planted, checked step by step, then the unguarded reference run on the surviving batches.
    ``options`` override the drill's ``Guard`` arguments (``snapshot_every=100``, say)."""
    from nanguard.guard import Guard

    model = _model()
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    ledger = _Ledger(model, opt)
    settings = {**_SETTINGS, **(options or {})}
    guard = Guard(net, opt, run_dir=run_dir, inject=[Fault(**f) for f in faults], on_event=ledger.listen, **settings)
    started = time.monotonic()
    for step in range(steps):
        batch = _batch(model, rank, step)
        before = ledger.before(step)
        guard.step(_closure(net, opt, batch), batch=batch)
        ledger.after(step, guard.last_action or "?", before)
    guard.close()
    seconds = time.monotonic() - started
    final = _state(model, opt)
    # Ranks that kept different batches would hang in the reference's all-reduce: compare first.
    same = _same_everywhere(ledger.applied) if world > 1 else True
    reference = _reference(rank, world, ledger.applied) if same else None
    return {
        "rank": rank,
        "actions": ledger.actions,
        "repaired": ledger.repaired,
        "applied": len(ledger.applied),
        "broken": ledger.broken,
        "matches_reference": reference is not None and bool(torch.equal(final[: reference.numel()], reference)),
        "finite": bool(torch.isfinite(final).all()),
        "seconds": seconds,
    }


def _closure(net: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> Any:
    def closure() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        _, loss = net(**batch)
        loss.backward()
        return loss

    return closure


class _Ledger:
    """A rank's steps, each action checked against what it promises: a step's batch is applied, a skip
    leaves the weights and optimizer state bit-identical, a rollback restores the exact bits from
    before the step it goes back to (kept for every step: it may go back to any)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.digests: dict[int, bytes] = {}  # every step's, by step: the bits a rollback to it must restore
        self.actions: list[str] = []
        self.applied: list[int] = []
        self.broken: list[str] = []
        self.restored: list[int] = []
        self.repaired: list[int] = []  # steps whose trip was repaired without a skip (a resync of the replicas)

    def listen(self, event: dict[str, Any]) -> None:
        if event["kind"] == "rollback":
            self.restored.append(event["restored_step"])
        elif event["kind"] == "trip" and event["action"] == "resync":
            self.repaired.append(event["step"])

    def before(self, step: int) -> torch.Tensor:
        """The state before ``step``, its digest kept."""
        state = _state(self.model, self.optimizer)
        self.digests[step] = _digest(state)
        return state

    def after(self, step: int, action: str, before: torch.Tensor) -> None:
        self.actions.append(action)
        check = self._CHECKS.get(action)
        if check is not None:
            check(self, step, before)

    def _stepped(self, step: int, before: torch.Tensor) -> None:
        self.applied.append(step)

    def _skipped(self, step: int, before: torch.Tensor) -> None:
        if not torch.equal(_state(self.model, self.optimizer), before):
            self.broken.append(f"step {step}: the skip changed the weights or optimizer state")

    def _rolled_back(self, step: int, before: torch.Tensor) -> None:
        back, now = self.restored[-1], _state(self.model, self.optimizer)
        if back not in self.digests or _digest(now) != self.digests[back]:
            self.broken.append(f"step {step}: the rollback did not restore the state before step {back}")
        elif not bool(torch.isfinite(now).all()):  # equal bits, but a snapshot must never hold a NaN
            self.broken.append(f"step {step}: the rollback restored a non-finite state (before step {back})")
        self.applied = [s for s in self.applied if s < back]

    _CHECKS: ClassVar[dict[str, Callable[[_Ledger, int, torch.Tensor], None]]] = {
        "step": _stepped,
        "skip": _skipped,
        "rollback": _rolled_back,
    }


def _same_everywhere(values: list[int]) -> bool:
    import torch.distributed as tdist

    mine = torch.tensor([len(values), sum((i + 1) * v for i, v in enumerate(values))], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(tdist.get_world_size())]
    tdist.all_gather(everyone, mine)
    return all(torch.equal(e, everyone[0]) for e in everyone)


def _reference(rank: int, world: int, applied: list[int]) -> torch.Tensor:
    """The weights of an unguarded run that saw only the batches in ``applied``: a healthy guarded DDP
    step sends the unguarded run's bits at any world size (``tests/test_distributed_exact.py``)."""
    model = _model()
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    for step in applied:
        _closure(net, opt, _batch(model, rank, step))()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# What every rank's end must hold, and the problem when it does not.
_FINAL: tuple[tuple[str, str], ...] = (
    ("matches_reference", "final weights differ from a run that never saw the dropped batches"),
    ("finite", "the final weights or optimizer state are not finite"),
)


def check_drill(faults: Sequence[Fault], results: Sequence[dict[str, Any]]) -> list[str]:
    """What went wrong in a drill, in words; [] when every promise held.

    Example:
        >>> check_drill(faults, spawn_ranks(drill_rank, dicts, 200, None, world=2))
        []
    """
    problems = [p for r in results for p in (f"rank {r['rank']}: {b}" for b in r["broken"])]
    problems += _split_decisions(results)
    problems += _uncaught(faults, results[0])
    problems += [f"rank {r['rank']}: {text}" for r in results for key, text in _FINAL if not r[key]]
    return problems


def _split_decisions(results: Sequence[dict[str, Any]]) -> list[str]:
    """Each rank whose actions differ from rank 0's, with the first steps where they do."""
    first = results[0]["actions"]
    problems = []
    for r in results[1:]:
        split = [s for s, (a, b) in enumerate(zip(first, r["actions"], strict=True)) if a != b]
        if split:
            problems.append(f"rank {r['rank']} decided differently from rank 0 at steps {split[:5]}")
    return problems


def _uncaught(faults: Sequence[Fault], first: dict[str, Any]) -> list[str]:
    """Each fault (but a stall) rank 0 neither skipped nor rolled back, nor repaired by a resync."""
    problems = []
    for f in faults:
        # A NaN written where the step's forward does not read it (an embedding row no batch
        # used) shows in the parameter check after the update, read with the next step.
        # Or the replica check (every fingerprint_every updates) finds it first and resyncs the replicas.
        actions = first["actions"][f.step : f.step + (2 if f.kind == "nan_param" else 1)]
        resynced = f.kind == "nan_param" and f.step in first["repaired"]
        if f.kind != "stall" and not {"skip", "rollback"} & set(actions) and not resynced:
            problems.append(f"{f.spec}: not caught (the step's action was {actions[0]!r})")
    return problems


def run_drill(*, ranks: int = 1, steps: int = 64, inject: str | None = None, run_dir: str | None = None) -> int:
    """``nanguard drill``: the standard drill (or ``inject``'s faults) on the tiny GPT; 0 when it passed."""
    from nanguard.inject import parse
    from nanguard.report.terminal import Console

    faults = parse(inject) if inject else standard_drill(ranks)
    if steps <= max(f.step for f in faults):
        raise ValueError(f"steps must be > the last fault's step ({max(f.step for f in faults)}), got {steps}")
    console = Console()
    console.title(f"nanguard drill: {len(faults)} faults on {ranks} rank(s)", "; ".join(f.spec for f in faults))
    dicts = [
        {"kind": f.kind, "step": f.step, "rank": f.rank, "module": f.module, "factor": f.factor, "seconds": f.seconds}
        for f in faults
    ]
    if ranks > 1:
        from nanguard.zoo.spawn import RanksFailed, spawn_ranks

        try:
            results = spawn_ranks(drill_rank, dicts, steps, run_dir, world=ranks)
        except RanksFailed as err:
            console.line(str(err))
            return 1
    else:
        results = [drill_rank(0, 1, dicts, steps, run_dir)]
    rows = [[f.spec, results[0]["actions"][f.step], " ".join(r["actions"][f.step] for r in results)] for f in faults]
    console.table(["fault", "rank 0's action", "every rank's action"], rows)
    problems = check_drill(faults, results)
    for problem in problems:
        console.line(f"FAILED: {problem}")
    if not problems:
        console.line(
            f"drill passed: every fault caught and handled alike on every rank; the final weights equal "
            f"a run that never saw the {steps - results[0]['applied']} dropped batches"
        )
    if run_dir is not None:
        console.line(f"events in {run_dir}; see `nanguard report {run_dir}`")
    return 1 if problems else 0
