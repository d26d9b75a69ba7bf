"""A rollback lands before a steady growth began, whatever its rate (issue 31, item 5).

SGD at lr=1.0 on a one-weight fit whose curvature makes the error grow ``sqrt(rate)`` a step, so
the loss grows ``rate`` a step from the first update: x1.3 never makes the tenfold jump the older
rules waited for, and the snapshots taken meanwhile hold a state already on its way out. A small
quartic term makes such a state diverge under any batch, as large weights do.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import nanguard as ng
from nanguard.guard.config import GuardConfig
from nanguard.guard.history import History
from nanguard.guard.recovery import Recovery


class _Fit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (0.5 * x * x * (self.w - 1.0) ** 2 + 1e-4 * self.w**4 / 4).sum()


def _run(rate: float, policy: str, *, start: int, snapshot_every: int, steps: int) -> tuple[Any, ...]:
    model = _Fit()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    events: list[dict[str, Any]] = []
    guard = ng.Guard(
        model,
        opt,
        policy=policy,
        snapshot_every=snapshot_every,
        locate=False,
        module_stats=False,
        on_event=events.append,
    )
    hot = math.sqrt(1 + math.sqrt(rate))  # lr * x^2 - 1 = -sqrt(rate): the loss grows `rate` a step
    cool = 0.7  # lr * x^2 = 0.49: converges
    losses = []
    for i in range(steps):
        # The hot batches last until the rollback (a bad stretch of data the loader has passed).
        x = torch.tensor([hot if i >= start and guard.rollbacks == 0 else cool], dtype=torch.float64)

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x)
            loss.backward()
            return loss

        loss = guard.step(closure)
        if loss is not None:
            losses.append(float(loss.detach()))
    rollbacks = [(e["step"], e["restored_step"]) for e in events if e["kind"] == "rollback"]
    return rollbacks, losses, float(model.w.detach())


@pytest.mark.parametrize("policy", ["rollback", "auto"])
@pytest.mark.parametrize("rate", [1.3, 2.0, 4.0])
def test_a_steady_growth_rolls_back_to_before_it_began(rate: float, policy: str) -> None:
    rollbacks, losses, w = _run(rate, policy, start=0, snapshot_every=1, steps=60)
    assert len(rollbacks) == 1, rollbacks  # the old target (inside the growth) tripped again and again at x1.3
    tripped, restored = rollbacks[0]
    assert tripped > 5 and restored == 0  # the growth began with the first update: only step 0's state is before it
    assert abs(w - 1.0) < 1e-2 and losses[-1] < 1e-4  # recovered: back near the fit (loss floor 2.5e-5)


@pytest.mark.parametrize("rate", [2.0, 4.0])
def test_a_growth_after_healthy_steps_lands_at_or_before_its_start(rate: float) -> None:
    rollbacks, _, w = _run(rate, "rollback", start=15, snapshot_every=1, steps=75)
    assert len(rollbacks) == 1 and rollbacks[0][0] > 20
    assert rollbacks[0][1] <= 15  # a snapshot of the state before the first hot batch's update
    assert abs(w - 1.0) < 1e-3


def _history() -> History:
    return History.from_config(GuardConfig())


@pytest.mark.parametrize(
    ("losses", "onset", "growing"),
    [
        ([2.0, 1.9, 2.6, 5.2, 10.4], 1, True),  # three rises, x5.5
        ([2.0, 1.9, 2.47, 3.21, 4.17, 5.4], 1, True),  # x1.3 a step
        ([2.0, 1.9, 2.0, 2.1, 2.2], None, False),  # rises, but not twofold: noise
        ([1.0, 10.0, 100.0], None, True),  # two rises only: no onset, but a hundredfold within the window
        ([1.0, 3.0, 9.0, 27.0, 20.0], None, True),  # the last update fell: no onset; x20 within the window still
    ],
)
def test_onset_is_the_start_of_the_growth_under_way(losses: list[float], onset: int | None, growing: bool) -> None:
    history = _history()
    for step, loss in enumerate(losses):
        history.append(step, loss=loss, grad_norm=1.0)
    assert history.onset() == onset
    assert history.growing() is growing  # an onset is growth under way; so is a tenfold rise without one


def test_snapshots_are_kept_at_doubling_ages_and_reuse_their_memory() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recovery = Recovery(model, opt, scaler=None, config=GuardConfig(policy="rollback", snapshots=3))
    ptrs: dict[int, int] = {}
    for step in range(12):
        recovery.take_snapshot(step, loss=1.0)
        steps = [snap["step"] for snap in recovery.snapshots]
        assert steps[-1] == step and len(steps) == min(step + 1, 3)
        assert step < 3 or step - steps[0] >= 2  # the oldest is at least two refreshes back
        ptrs[step] = recovery.snapshot["model"]["weight"].data_ptr()  # type: ignore[index]
    assert len(set(list(ptrs.values())[3:])) == 3  # three slots' memory, reused
    # A rollback to the oldest drops the newer ones (taken on the way out).
    oldest = recovery.snapshots[0]["step"]
    diag = ng.Diagnosis(cause="optimizer.divergence", phase="optimizer")
    assert recovery.rollback(diag, onset=oldest) == oldest
    assert [snap["step"] for snap in recovery.snapshots] == [oldest]
