"""The cross-rank choice of the rank that created a value, the pipeline stage evidence and their
text, on hand-built records (the spawned-rank runs are in ``test_parallel.py``)."""

from __future__ import annotations

import pytest
import torch

from nanguard.findings import Diagnosis
from nanguard.pipeline_stages import Boundary, StageWatch
from nanguard.text import diagnosis_text
from nanguard.tracer.collectives import Choice, choose, is_comm


def _diag(
    *, arrived: bool = False, index: int = 10, phase: str = "forward", stage: int | None = None, collectives: int = 4
) -> Diagnosis:
    evidence = {
        "origin": {"phase": phase},
        "communication": {"collectives": collectives, "arrived": arrived, "index": index},
    }
    if stage is not None:
        evidence["stage"] = {"index": stage, "stages": 4}
    return Diagnosis(cause="unknown" if arrived else "op.sqrt_domain", phase=phase, evidence=evidence)


def test_a_replay_without_communication_leaves_the_choice_to_the_replays() -> None:
    assert choose({0: _diag(collectives=0), 1: _diag(collectives=0)}, [0, 1]) is None


@pytest.mark.parametrize(
    ("per_rank", "flagged", "expected"),
    [
        ({0: _diag(index=12), 1: _diag(arrived=True, index=20)}, [0, 1], Choice(0, [0])),
        ({0: _diag(arrived=True, index=20), 1: _diag(index=12)}, [0, 1], Choice(1, [1])),
        # Under TP the ranks run the same ops: a later "creation" came through a hidden redistribute.
        ({0: _diag(index=30), 1: _diag(index=12), 2: _diag(index=12)}, [0, 1, 2], Choice(1, [1, 2])),
        ({0: _diag(index=12), 1: _diag(index=12)}, [1], Choice(1, [0, 1])),
        ({0: _diag(arrived=True), 1: _diag(arrived=True)}, [0, 1], Choice(None, [])),
        # Pipeline: forward through the stages in order, then backward in reverse.
        ({0: _diag(stage=0, index=90), 1: _diag(stage=1, index=3)}, [0, 1], Choice(0, [0])),
        ({2: _diag(stage=2, phase="backward"), 3: _diag(stage=3, phase="backward")}, [2, 3], Choice(3, [3])),
        ({1: _diag(stage=1, phase="backward"), 2: _diag(stage=2)}, [1, 2], Choice(2, [2])),
        ({1: _diag(stage=1, phase="parameters"), 0: _diag(stage=0)}, [0, 1], Choice(1, [1])),
    ],
)
def test_the_creator_is_the_rank_whose_own_compute_made_it(per_rank, flagged, expected) -> None:
    assert choose(per_rank, flagged) == expected


def test_communication_ops_are_told_from_compute() -> None:
    assert is_comm(torch.ops._c10d_functional.all_reduce.default)
    assert is_comm(torch.ops._c10d_functional.wait_tensor.default)
    assert is_comm(torch.ops.c10d.recv_.default)
    assert not is_comm(torch.ops.aten.add.Tensor)


def _watch(*boundaries: tuple[int, str, bool, bool]) -> StageWatch:
    nan, ok = torch.tensor([float("nan")]), torch.ones(1)
    return StageWatch([Boundary(s, 3, phase, [nan if r else ok], [nan if o else ok]) for s, phase, r, o in boundaries])


def test_the_stage_that_received_finite_values_and_sent_non_finite_ones_made_them() -> None:
    made = _watch((1, "forward", False, True), (1, "backward", True, True)).evidence()
    assert made is not None and (made["index"], made["created"]) == (1, "forward")
    assert made["forward"] == {"received": False, "sent": True}
    passed_on = _watch((2, "forward", True, True), (2, "backward", False, True)).evidence()
    assert passed_on is not None and passed_on["created"] is None  # its backward ran on NaN activations
    backward = _watch((1, "forward", False, False), (1, "backward", False, True)).evidence()
    assert backward is not None and backward["created"] == "backward"
    assert StageWatch().evidence() is None


def test_the_text_says_who_made_it_and_who_received_it() -> None:
    evidence = {
        "flagged_ranks": [0, 1],
        "per_rank_causes": {"0": "op.sqrt_domain", "1": "unknown"},
        "received_ranks": [1],
        "stage": {"index": 0, "stages": 2, "created": "forward"},
    }
    text = diagnosis_text(Diagnosis(cause="op.sqrt_domain", rank=0, ranks=[0], evidence=evidence))
    assert "made by the own compute of rank(s) 0, it reached rank(s) 1 through communication" in text
    assert "rank 1: received" in text and "replayed alone" not in text
    assert "pipeline stage 0 of 2: in forward it received finite values, sent non-finite ones" in text
