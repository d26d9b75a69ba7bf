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
    Case(
        aten._weight_norm_interface,
        aten._weight_norm_interface.default,
        (torch.tensor([[0.0, 0.0], [3.0, 4.0]]), torch.ones(2, 1), 0),
        {
            "normalizes": True,
            "denominator": {"what": "the L2 norm of weight_v per output channel", "size": 2, "zeros": 1, "min": 0.0},
        },
    ),
    Case(
        aten.logdet,
        aten.logdet.default,
        (torch.tensor([[0.0, 1.0], [1.0, 0.0]]),),
        {"matrices": 1, "negative_determinants": 1, "zero_determinants": 0},
    ),
    Case(
        aten.linalg_slogdet,
        aten.linalg_slogdet.default,
        (torch.stack([torch.eye(2), torch.zeros(2, 2)]),),
        {"matrices": 2, "negative_determinants": 0, "zero_determinants": 1},
    ),
    Case(aten.slogdet, aten.slogdet.default, (-torch.eye(3),), {"negative_determinants": 1}),
    Case(aten.exp, aten.exp.default, (_GROWS,), {"input_max": 50.0}),
    Case(aten.exp_, aten.exp_.default, (_GROWS.clone(),), {"input_max": 50.0}),
    Case(aten.pow, aten.pow.Tensor_Scalar, (_GROWS, 2), {"input_max": 50.0}),
    Case(aten.pow, aten.pow.Scalar, (2.0, _GROWS), {"input_max": 50.0}),  # 2 ** x: the tensor comes second
    # The log family: values on the edge of the domain, and past it.
    Case(
        aten.xlogy,
        aten.xlogy.Tensor,
        (torch.tensor([1.0, 0.0, 2.0, 1.0]), torch.tensor([0.0, 0.0, -1.0, 3.0])),
        {"at_boundary": 1, "outside_domain": 1},
    ),
    Case(
        aten.special_xlog1py,
        aten.special_xlog1py.default,
        (torch.tensor([1.0, 0.0]), torch.tensor([-1.0, -1.0])),
        {"at_boundary": 1, "outside_domain": 0},
    ),
    Case(aten.log1p, aten.log1p.default, (torch.tensor([-1.0, -2.0, 0.5]),), {"at_boundary": 1, "outside_domain": 1}),
    Case(aten.log1p_, aten.log1p_.default, (torch.tensor([-1.0]),), {"at_boundary": 1}),
    Case(aten.logit, aten.logit.default, (torch.tensor([0.0, 1.0, 1.5]),), {"at_boundary": 2, "outside_domain": 1}),
    Case(aten.logit_, aten.logit_.default, (torch.tensor([0.0, 0.5]), 1e-6), {"at_boundary": 0}),  # eps clamps
    Case(aten.lgamma, aten.lgamma.default, (torch.tensor([0.0, -2.0, 1.5, -0.5]),), {"at_boundary": 2}),
    Case(aten.lgamma_, aten.lgamma_.default, (torch.tensor([0.0]),), {"at_boundary": 1}),
    Case(aten.digamma, aten.digamma.default, (torch.tensor([0.0, 3.0]),), {"at_boundary": 1}),
    Case(aten.digamma_, aten.digamma_.default, (torch.tensor([-1.0]),), {"at_boundary": 1}),
    Case(aten.polygamma, aten.polygamma.default, (1, torch.tensor([0.0, 2.0])), {"at_boundary": 1}),
    Case(aten.mvlgamma, aten.mvlgamma.default, (torch.tensor([0.0, 2.0]), 1), {"at_boundary": 1}),
    Case(aten.special_entr, aten.special_entr.default, (torch.tensor([-1.0, 0.5]),), {"outside_domain": 1}),
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


def test_a_class_weighted_nll_loss_reports_its_total_weight() -> None:
    # Class 0 weighs 0; every valid target is class 0: the weighted mean divides by 0.
    weight = torch.tensor([0.0, 1.0, 1.0, 1.0])
    args = (_LOGP, torch.tensor([0, -100, 0]), weight, 1, -100)
    facts = ops.creation_facts(aten.nll_loss_forward.default, args, {}, torch.zeros(1), module_eps=None)
    assert facts["valid_targets"] == 2 and facts["target_classes"] == [0]
    assert facts["denominator"]["value"] == 0.0 and facts["denominator"]["zeros"] == 1
    assert facts["class_weights"] == {"classes": 4, "zero_weight_classes": 1, "sum": 3.0}
    args = (_LOGP, torch.tensor([1, -100, 0]), weight, 1, -100)
    facts = ops.creation_facts(aten.nll_loss_forward.default, args, {}, torch.zeros(1), module_eps=None)
    assert facts["denominator"] == {"what": "the total class weight of the valid targets", "value": 1.0, "zeros": 0}


def test_group_norm_facts_count_the_elements_of_a_group() -> None:
    x = torch.arange(8.0).reshape(2, 4, 1)  # 4 channels, 4 groups, one element each
    facts = ops.creation_facts(aten.native_group_norm.default, (x, None, None, 2, 4, 1, 4, 0.0), {}, x, None)
    assert facts["group_elements"] == 1 and facts["min_variance"] == 0.0


def test_a_user_level_call_names_its_aten_op_and_facts() -> None:
    assert ops.user_op_name("logdet") == "aten.logdet.default"
    assert ops.user_op_name("not_a_torch_op") == "torch.not_a_torch_op"
    assert ops.user_facts("aten.logdet.default", (-torch.eye(3),))["negative_determinants"] == 1
    assert ops.user_facts("torch.not_a_torch_op", (torch.eye(2),)) == {}


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


# -- the class of ops that keep finite inputs finite (their output check is skipped) -------

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _extremes(dtype: torch.dtype) -> torch.Tensor:
    """A 3x4 finite tensor at the dtype's edges: its largest, smallest normal, zeros, signs."""
    info = torch.finfo(dtype)
    values = [info.max, -info.max, info.tiny, -info.tiny, 0.0, -0.0, 1.0, -1.0, 3.5, -2.25, info.max / 2, -7.0]
    return torch.tensor(values, dtype=torch.float64).to(dtype).reshape(3, 4)


_IDX = torch.tensor([2, 0])
# One call per member of ops.KEEPS_FINITE on the extreme tensor x.
KEEPERS: dict[Any, Any] = {
    aten.clone: lambda x: (x,),
    aten.cat: lambda x: ([x, x.flip(0)],),
    aten.stack: lambda x: ([x, x],),
    aten.embedding: lambda x: (x, torch.tensor([[0, 2], [1, 0]])),
    aten.index_select: lambda x: (x, 0, _IDX),
    aten.gather: lambda x: (x, 1, torch.tensor([[0, 1], [2, 3], [1, 1]])),
    aten.index: lambda x: (x, [_IDX]),
    aten.zeros_like: lambda x: (x,),
    aten.ones_like: lambda x: (x,),
    aten.new_zeros: lambda x: (x, [2, 3]),
    aten.new_ones: lambda x: (x, [2, 3]),
    aten.zero_: lambda x: (x.clone(),),
    aten._unsafe_view: lambda x: (x, [4, 3]),
    aten.constant_pad_nd: lambda x: (x, [1, 1], 0.0),
    aten.flip: lambda x: (x, [0]),
    aten.roll: lambda x: (x, [1], [0]),
    aten.repeat: lambda x: (x, [2, 1]),
    aten.slice_backward: lambda x: (x, [6, 4], 0, 0, 6, 2),
    aten.select_backward: lambda x: (x, [2, 3, 4], 0, 1),
    aten.relu: lambda x: (x,),
    aten.tanh: lambda x: (x,),
    aten.sigmoid: lambda x: (x,),
    aten.abs: lambda x: (x,),
    aten.neg: lambda x: (x,),
    aten.clamp: lambda x: (x, -1.0, 1.0),
    aten.clamp_min: lambda x: (x, 0.0),
    aten.clamp_max: lambda x: (x, 0.0),
    aten.where: lambda x: (x > 0, x, x.flip(1)),
    aten.masked_fill: lambda x: (x, x > 0, 2.0),
    aten.threshold_backward: lambda x: (x, x.flip(0), 0.0),
    aten._softmax: lambda x: (x, 1, False),
    aten.maximum: lambda x: (x, x.flip(0)),
    aten.minimum: lambda x: (x, x.flip(0)),
    aten.max: lambda x: (x,),
    aten.min: lambda x: (x,),
    aten.amax: lambda x: (x, [1]),
    aten.amin: lambda x: (x, [0]),
    aten.sort: lambda x: (x,),
    aten.topk: lambda x: (x, 2),
    aten.relu_: lambda x: (x.clone(),),
    aten.clamp_: lambda x: (x.clone(), -1.0, 1.0),
    aten.masked_fill_: lambda x: (x.clone(), x > 0, 2.0),
}
# They allocate without writing: what they hold is not a value until an op writes it (and is checked).
ALLOCATORS = {aten.empty_like, aten.new_empty, aten.new_empty_strided}


def test_every_op_that_keeps_finite_values_has_a_case() -> None:
    assert set(KEEPERS) | ALLOCATORS == ops.KEEPS_FINITE


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op", list(KEEPERS), ids=str)
def test_ops_that_keep_finite_values_do_on_every_float_dtype(op: Any, dtype: torch.dtype) -> None:
    x = _extremes(dtype)
    assert all(ops.info(getattr(op, name)).keeps_finite for name in op.overloads())
    out = op(*KEEPERS[op](x))
    floats = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if t.is_floating_point()]
    assert floats
    for t in floats:
        assert bool(torch.isfinite(t).all()), f"{op} made a non-finite value from finite {dtype} inputs"


# Ops that make NaN/Inf from finite inputs: never in the class, each shown on an extreme tensor.
_H, _B = torch.float16, torch.bfloat16
CREATORS = [
    (aten.exp.default, _H, lambda x: (x,)),
    (aten.log.default, _H, lambda x: (x,)),
    (aten.sqrt.default, _H, lambda x: (x,)),
    (aten.reciprocal.default, _H, lambda x: (x,)),
    (aten.div.Tensor, _H, lambda x: (x, torch.zeros_like(x))),
    (aten.mul.Tensor, _H, lambda x: (x, x)),
    (aten.add.Tensor, _H, lambda x: (x, x)),
    (aten.pow.Tensor_Scalar, _H, lambda x: (x, 2)),
    (aten.sum.default, _H, lambda x: (x.abs(),)),
    (aten.mm.default, _H, lambda x: (x, x.t())),
    (aten.gelu.default, _B, lambda x: (x,)),  # rounds bfloat16's largest value up to Inf
    (aten._to_copy.default, _H, lambda x: (x.double() * 4,)),  # cast down: dtype=float16 below
    (aten.view.dtype, _H, lambda x: (torch.full(x.shape, -1, dtype=torch.int16), _H)),  # all-ones bits: NaN
    (aten._softmax_backward_data.default, _H, lambda x: (x, x, 1, torch.float16)),
]


@pytest.mark.parametrize(("op", "dtype", "args"), CREATORS, ids=lambda v: str(v) if not callable(v) else None)
def test_ops_that_make_nonfinite_values_are_not_in_the_class(op: Any, dtype: torch.dtype, args: Any) -> None:
    kwargs = {"dtype": torch.float16} if op is aten._to_copy.default else {}
    out = op(*args(_extremes(dtype)), **kwargs)
    assert not bool(torch.isfinite(out).all())
    assert not ops.info(op).keeps_finite


@pytest.mark.parametrize(
    "op",
    [
        aten.view.default,
        aten.t.default,
        aten.transpose.int,
        aten.expand.default,
        aten.select.int,
        aten.slice.Tensor,
        aten.unsqueeze.default,
        aten.permute.default,
        aten.split.Tensor,
        aten.detach.default,
        aten.view_as_real.default,
    ],
    ids=str,
)
def test_plain_views_keep_finite_values(op: Any) -> None:
    assert ops.info(op).keeps_finite


def test_views_that_reread_bits_or_reach_past_their_input_are_checked() -> None:
    # as_strided can read storage outside its input; view(dtype) reinterprets bits.
    base = torch.tensor([1.0, 2.0, math.nan])
    assert bool(aten.as_strided.default(base[:2], [3], [1]).isnan().any())
    for op in (aten.as_strided.default, aten.view.dtype, aten.as_strided_.default):
        assert not ops.info(op).keeps_finite


def test_op_info_is_cached_per_overload_and_reads_the_schema() -> None:
    assert ops.info(aten.add_.Tensor) is ops.info(aten.add_.Tensor)
    assert ops.info(aten.add_.Tensor).writes == ((0, "self"),)
    assert ops.info(aten.add.Tensor).writes == ()
    assert ops.info(aten.exp.default).name == "aten.exp.default"
    assert ops.info(aten.lift_fresh.default).literal and ops.info(aten.detach.default).quiet
    assert ops.info(aten._softmax.default).mask_aware and not ops.info(aten.exp.default).mask_aware
    assert ops.info(aten.mm.default).weighted and not ops.info(aten.add.Tensor).weighted


@pytest.mark.parametrize(
    ("func", "a", "b", "met"),
    [
        (aten.sub.Tensor, -INF, -INF, "-inf - (-inf)"),
        (aten.sub.Tensor, INF, INF, "inf - inf"),
        (aten.add.Tensor, INF, -INF, "inf + (-inf)"),
        (aten.div.Tensor, -INF, INF, "-inf / inf"),
        (aten.rsub.Tensor, -INF, -INF, "-inf - (-inf)"),
        (aten.div.Tensor, 0.0, 0.0, None),  # 0/0: no infinity met
        (aten.mul.Tensor, 0.0, INF, None),  # not an op that combines two infinities
    ],
)
def test_infinities_met_names_the_two_infinities_an_op_combined(func, a, b, met) -> None:
    x, y = torch.tensor([1.0, a]), torch.tensor([2.0, b])
    out = func(x, y)
    assert ops.infinities_met(func, [x, y], out) == met


def test_baddbmm_with_beta_zero_does_not_read_its_buffer() -> None:
    """torch's contract: ``beta=0`` ignores the input, NaN included (Megatron's attention passes an
    uninitialized buffer there); with ``beta=1`` the same NaN buffer is read, and is the origin."""
    import nanguard as ng

    buffer = torch.full((2, 3, 3), math.nan)  # captured from outside: what torch.empty may hold
    q, k = torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 4, 3)

    def scores(beta: float) -> torch.Tensor:
        return torch.baddbmm(buffer, q, k, beta=beta, alpha=0.5).softmax(-1).sum()

    assert ops.ignores_first(aten.baddbmm.default, (buffer, q, k), {"beta": 0.0})
    assert not ops.ignores_first(aten.baddbmm.default, (buffer, q, k), {"beta": 1.0})
    assert not ops.ignores_first(aten.bmm.default, (q, k), {})
    assert ng.locate(scores, 0.0) is None
    diag = ng.locate(scores, 1.0)
    assert diag is not None and diag.cause == "data.nonfinite"
