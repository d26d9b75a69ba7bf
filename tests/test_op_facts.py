"""The tracer's per-op registries: every registered op gets its facts, computed from its own arguments."""

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from nanguard.tracer import ops

aten = torch.ops.aten
INF = math.inf


@dataclass
class Case:
    target: Any  # what was registered: a packet or an overload
    func: Any  # the overload the op runs as
    args: tuple
    expect: dict[str, Any]


def _rows() -> torch.Tensor:
    return torch.tensor([[0.0, 1.0, 2.0], [-INF, -INF, -INF]])


def _flat_first_sample() -> torch.Tensor:
    x = torch.arange(24.0).reshape(2, 4, 3)
    x[0] = 5.0  # sample 0 is constant: variance 0
    return x


_LOGP = torch.zeros(3, 4)
_TARGETS = torch.tensor([0, -100, 2])
_LN_IN = torch.tensor([[3.0, 3.0, 3.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
_GROWS = torch.tensor([1.0, 50.0, -7.0])

CASES = [
    Case(
        aten._softmax,
        aten._softmax.default,
        (_rows(), 1, False),
        {"rows": 2, "fully_masked_rows": 1, "input_max": 2.0},
    ),
    Case(aten._log_softmax, aten._log_softmax.default, (_rows(), 1, False), {"fully_masked_rows": 1}),
    Case(
        aten.nll_loss_forward,
        aten.nll_loss_forward.default,
        (_LOGP, _TARGETS, None, 1, -100),
        {"targets": 3, "valid_targets": 2, "ignore_index": -100, "reduction": 1},
    ),
    Case(
        aten.nll_loss2d_forward,
        aten.nll_loss2d_forward.default,
        (torch.zeros(1, 4, 2, 2), torch.tensor([[[1, 5], [5, 5]]]), None, 2, 5),
        {"targets": 4, "valid_targets": 1, "ignore_index": 5, "reduction": 2},
    ),
    Case(
        aten.native_layer_norm,
        aten.native_layer_norm.default,
        (_LN_IN, [4], None, None, 1e-5),
        {"norm_eps": 1e-5, "min_variance": 0.0},
    ),
    Case(
        aten.native_group_norm,
        aten.native_group_norm.default,
        (_flat_first_sample(), None, None, 2, 4, 3, 2, 1e-3),
        {"norm_eps": 1e-3, "min_variance": 0.0},
    ),
    Case(
        aten.native_batch_norm,
        aten.native_batch_norm.default,
        (_LN_IN, None, None, None, None, True, 0.1, 1e-4),
        {"norm_eps": 1e-4, "min_variance": 0.0},
    ),
    Case(
        aten._native_batch_norm_legit,
        aten._native_batch_norm_legit.no_stats,
        (_LN_IN, None, None, True, 0.1, 1e-4),
        {"norm_eps": 1e-4, "min_variance": 0.0},
    ),
    Case(
        aten._native_batch_norm_legit_functional,
        aten._native_batch_norm_legit_functional.default,
        (_LN_IN, None, None, torch.zeros(4), torch.ones(4), True, 0.1, 1e-4),
        {"norm_eps": 1e-4, "min_variance": 0.0},
    ),
    Case(aten.exp, aten.exp.default, (_GROWS,), {"input_max": 50.0}),
    Case(aten.exp_, aten.exp_.default, (_GROWS.clone(),), {"input_max": 50.0}),
    Case(aten.pow, aten.pow.Tensor_Scalar, (_GROWS, 2), {"input_max": 50.0}),
    Case(aten.pow, aten.pow.Scalar, (2.0, _GROWS), {"input_max": 50.0}),  # 2 ** x: the tensor comes second
]
for _name, _args, _expect in (
    ("_safe_softmax", (_rows(), 1), {"rows": 2, "fully_masked_rows": 1}),
    ("_fused_rms_norm", (_LN_IN, [4], None, 1e-6), {"norm_eps": 1e-6, "min_variance": 0.0}),
    ("rms_norm", (_LN_IN, [4], None, 1e-6), {"norm_eps": 1e-6, "min_variance": 0.0}),
):
    if hasattr(aten, _name):
        CASES.append(Case(getattr(aten, _name), getattr(aten, _name).default, _args, _expect))


def test_every_registered_op_has_a_case() -> None:
    assert {case.target for case in CASES} == ops.registered()


@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c.func))
def test_registered_facts_fire_on_their_op(case: Case) -> None:
    facts = ops.creation_facts(case.func, case.args, {}, torch.zeros(1), module_eps=None)
    assert {k: facts.get(k) for k in case.expect} == case.expect


def test_unregistered_ops_get_only_the_module_eps() -> None:
    x = torch.ones(2)
    assert ops.creation_facts(aten.add.Tensor, (x, x), {}, x, module_eps=1e-6) == {"module_eps": 1e-6}


def test_facts_that_cannot_be_computed_are_left_out() -> None:
    # A softmax over a dim the input does not have: no facts, and no exception into the user's step.
    assert ops.creation_facts(aten._softmax.default, (torch.ones(2), 3, False), {}, torch.ones(2), None) == {}


@pytest.mark.parametrize(
    ("func", "args", "size"),
    [
        (aten.embedding.default, (torch.zeros(10, 3), torch.tensor([1])), 10),
        (aten.index.Tensor, (torch.zeros(7, 2), [torch.tensor([1])]), 7),
        (aten.index_select.default, (torch.zeros(4, 9), 1, torch.tensor([1])), 9),
        (aten.gather.default, (torch.zeros(4, 6), 1, torch.zeros(4, 1, dtype=torch.long)), 6),
        (aten.nll_loss_forward.default, (torch.zeros(3, 5), torch.tensor([0, 1, 2]), None, 1, -100), 5),
        (aten.nll_loss2d_forward.default, (torch.zeros(1, 4, 2, 2), _TARGETS.view(1, 3, 1), None, 1, -100), 4),
        (aten.one_hot.default, (torch.tensor([1]), 12), 12),
        (aten.take.default, (torch.zeros(3), torch.tensor([0])), None),
    ],
    ids=lambda v: str(v) if isinstance(v, torch._ops.OpOverload) else None,
)
def test_index_ops_say_how_many_entries_they_index(func, args, size) -> None:
    assert ops.is_index_op(func)
    assert ops.index_size(func, args) == size


def test_the_loss_ignore_index_comes_from_the_op_arguments() -> None:
    args = (torch.zeros(3, 5), torch.tensor([0, 1, 2]), None, 1, -1)
    assert ops.ignore_index(aten.nll_loss_forward.default, args) == -1
    assert ops.ignore_index(aten.embedding.default, (torch.zeros(3, 2), torch.tensor([1]))) is None
    assert not ops.is_index_op(aten.add.Tensor)


def test_registering_twice_or_a_non_op_is_refused() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        ops.op_facts(aten._softmax)(lambda args: {})
    with pytest.raises(ValueError, match="targets must be aten ops"):
        ops.op_facts("aten.exp")(lambda args: {})
