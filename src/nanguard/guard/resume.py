"""A guard's state for a resumed run (``Guard.state_dict``/``load_state_dict``): the counters,
the history and detector windows, the last diagnosis and the remedies, gathered from the parts
that own them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nanguard.findings import Diagnosis
from nanguard.guard.arguments import check_state
from nanguard.guard.config import GuardConfig
from nanguard.guard.history import History
from nanguard.guard.policy import Policy
from nanguard.guard.progress import Progress
from nanguard.guard.recovery import Recovery
from nanguard.guard.remedies import Remedies

__all__ = ["Resume"]


class Resume:
    """Saves and loads the state the guard's parts keep across a restart.

    Example:
        >>> Resume(config, progress, recovery, history, remedies, policy).state_dict()["step_count"]
        0
    """

    def __init__(
        self,
        config: GuardConfig,
        progress: Progress,
        recovery: Recovery,
        history: History,
        remedies: Remedies,
        policy: Policy,
    ) -> None:
        self.config, self.progress, self.recovery, self.history = config, progress, recovery, history
        self.remedies, self.policy = remedies, policy

    def state_dict(self) -> dict[str, Any]:
        return {
            "step_count": self.progress.step,
            **self.recovery.state_dict(),
            **self.history.state_dict(),
            "last_diagnosis": self.progress.diagnosis.to_dict() if self.progress.diagnosis else None,
            "remedies": {**self.remedies.state_dict(), **self.policy.state_dict()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state(state, self.config)  # a bad entry is a ValueError, and nothing is applied
        self.progress.step = int(state.get("step_count", 0))
        self.recovery.load_state_dict(state)
        self.history.load_state_dict(state)
        last = state.get("last_diagnosis")
        self.progress.diagnosis = Diagnosis.from_dict(last) if last else None
        remedies = state.get("remedies") or {}
        self.remedies.load_state_dict(remedies)
        self.policy.load_state_dict(remedies)
