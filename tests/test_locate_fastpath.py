"""The tracer's fast paths flag exactly what the slow, elementwise tests flag."""

import math
from typing import Any

import pytest
import torch

import nanguard as ng
from nanguard.tracer.taint import TaintMap, many_nonfinite_flags, nonfinite_flags

NAN, INF = math.nan, math.inf
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)


def _reference(t: torch.Tensor) -> tuple[bool, bool]:
    """(has NaN, has Inf and no NaN), element by element."""
    nan = bool(torch.isnan(t).any())
    return nan, not nan and bool(torch.isinf(t).any())


def _planted(dtype: torch.dtype, values: tuple[float, ...], where: int, n: int = 70001) -> torch.Tensor:
    torch.manual_seed(0)
    t = torch.randn(n, dtype=torch.float64).to(dtype)
    for k, v in enumerate(values):
        t[(where + 7 * k) % n] = v
    return t


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fast_flags_match_the_elementwise_tests(dtype: torch.dtype, threads: int) -> None:
    # 70001 elements: past the size at which a reduction is split across threads, and odd, so
    # the planted values land in vectorized bodies and in a tail.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for values in [(), (NAN,), (INF,), (-INF,), (INF, -INF), (NAN, INF), (-INF, NAN)]:
            for where in (0, 35000, 70000):
                t = _planted(dtype, values, where)
                for view in (t, t[::3], t[:69967].reshape(-1, 37).t()):
                    expected = _reference(view)
                    assert nonfinite_flags(view) == expected, (values, where, view.shape)
                    assert nonfinite_flags(view, likely=True) == expected, (values, where, view.shape)
    finally:
        torch.set_num_threads(before)


def test_complex_parts_and_conjugates_are_read() -> None:
    assert nonfinite_flags(torch.tensor([1 + 1j, complex(0, INF)]).conj()) == (False, True)
    assert nonfinite_flags(torch.tensor([complex(NAN, 0), 1j])) == (True, False)


def test_empty_scalar_sparse_and_float8_tensors() -> None:
    assert nonfinite_flags(torch.empty(0, 3)) == nonfinite_flags(torch.empty(0), likely=True) == (False, False)
    # Finite values whose sum overflows: the sum is not the last word.
    huge = torch.full((4,), torch.finfo(torch.float32).max)
    assert nonfinite_flags(huge) == (False, False)
    assert nonfinite_flags(torch.tensor(-INF)) == (False, True)
    assert nonfinite_flags(torch.tensor([[0.0, NAN], [1.0, 0.0]]).to_sparse()) == (True, False)
    assert nonfinite_flags(torch.tensor([[0.0, 2.0], [1.0, 0.0]]).to_sparse()) == (False, False)
    if hasattr(torch, "float8_e4m3fn"):
        assert nonfinite_flags(torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)) == (False, False)
        assert nonfinite_flags(torch.tensor([1.0, NAN]).to(torch.float8_e4m3fn)) == (True, False)


def test_many_tensors_read_at_once_match_one_by_one() -> None:
    ts = [
        _planted(torch.float16, (NAN,), 3),
        torch.empty(0),
        _planted(torch.bfloat16, (-INF,), 9),
        torch.ones(4, dtype=torch.float64),
        _planted(torch.complex64, (INF,), 1),
    ]
    assert many_nonfinite_flags(ts) == [nonfinite_flags(t) for t in ts] == [_reference(t) for t in ts]
    assert many_nonfinite_flags([torch.empty(0)]) == [(False, False)]
    assert many_nonfinite_flags([]) == []


def _located(fn: Any, *args: Any) -> tuple[str | None, str]:
    diag = ng.locate(fn, *args)
    assert diag is not None
    return diag.op, diag.kind


def test_an_op_after_skipped_ones_that_creates_a_nonfinite_value_is_the_origin() -> None:
    # relu, a view, a cat and a gather keep finite values: their checks are skipped, the log's is not.
    x = torch.tensor([[-1.0, 2.0], [3.0, -4.0]], requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([x.relu().t(), x.abs()]).gather(1, torch.tensor([[0], [1], [0], [1]]))
        return y.log().sum()

    assert _located(fn, x) == ("aten.log.default", "inf")


def test_a_skippable_op_given_an_infinite_number_is_still_checked() -> None:
    # masked_fill keeps finite values finite, but here the number it writes is -inf.
    x = torch.tensor([1.0, 2.0, 3.0])

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x.masked_fill(x > 2.5, -INF) * 0).sum()

    diag = ng.locate(fn, x)
    assert diag is not None
    assert diag.evidence["origin"]["category"] == "write"
    assert diag.evidence["origin"]["op"] == "aten.masked_fill.Scalar"


def test_a_new_tensor_at_a_dead_ones_address_is_read_afresh() -> None:
    # Statuses are keyed by id(): an entry left by another tensor must not be taken for this one's.
    taint = TaintMap(lambda t, nan, inf: 0)
    old = torch.tensor([NAN])
    taint.set(old, True, False, frozenset({5}))
    new = torch.tensor([1.0])
    assert new._version == old._version
    taint.status[id(new)] = taint.status[id(old)]  # what a reused address would look like
    assert taint.status_of(new).nan is False
    assert taint.taint_of(new) == frozenset()


@pytest.mark.parametrize("values", [(), (NAN,), (INF,), (-INF,), (NAN, -INF)], ids=str)
def test_same_values_ops_keep_their_input_flags(values: tuple[float, ...]) -> None:
    # The tracer reads these ops' flags off their input instead of a pass over the output.
    from nanguard.tracer import ops

    x = torch.randn(4, 6)
    for k, v in enumerate(values):
        x[k, 2 * k + 1] = v
    aten = torch.ops.aten
    calls = [
        (aten.view.default, (x, [6, 4])),
        (aten._unsafe_view.default, (x, [24])),
        (aten.t.default, (x,)),
        (aten.transpose.int, (x, 0, 1)),
        (aten.permute.default, (x, [1, 0])),
        (aten.unsqueeze.default, (x, 1)),
        (aten.squeeze.dim, (x[None], 0)),
        (aten.expand.default, (x[:, None], [4, 3, 6])),
        (aten.alias.default, (x,)),
        (aten.detach.default, (x,)),
        (aten.clone.default, (x,)),
    ]
    for func, args in calls:
        assert ops.info(func).same_values, func
        out = func(*args)
        assert out.numel() >= args[0].numel()
        assert nonfinite_flags(out) == nonfinite_flags(args[0]) == _reference(x), func
    assert not ops.info(aten.view.dtype).same_values
    assert not ops.info(aten.slice.Tensor).same_values


def test_many_flags_of_tensors_starting_with_nan_match_the_elementwise_tests() -> None:
    # A NaN first element answers without a pass; an Inf beside it is not reported, as one by one.
    ts = [
        torch.tensor([NAN, INF, 1.0]),
        torch.tensor([[NAN, 1.0], [2.0, 3.0]]).t(),
        torch.tensor([1.0, NAN, -INF]),
        torch.tensor([NAN], dtype=torch.bfloat16),
        torch.tensor([-INF, 2.0], dtype=torch.float64),
        torch.ones(3),
    ]
    assert many_nonfinite_flags(ts) == [nonfinite_flags(t) for t in ts] == [_reference(t) for t in ts]


def test_a_parameter_written_after_a_view_of_it_was_made_is_read_again() -> None:
    # The view records the parameter's version when it is made; a write to the parameter after
    # that must not leave the view's old (finite) status trusted.
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.mul_(1.0)  # a version past 0, as after an optimizer step

    def fn(x: torch.Tensor) -> torch.Tensor:
        w = model.weight.t()
        with torch.no_grad():
            model.weight.fill_(NAN)
        return (x @ w).sum()

    diag = ng.locate(fn, torch.ones(1, 2), model=model)
    assert diag is not None
    assert diag.evidence["origin"]["category"] == "write"
    assert diag.evidence["origin"]["op"] == "aten.fill_.Scalar"
    assert bool(torch.isfinite(model.weight).all())


def test_views_of_unchanged_parameters_are_not_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from nanguard.tracer import taint

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0)
    read: list[torch.Tensor] = []
    real = taint.nonfinite_flags
    monkeypatch.setattr(taint, "nonfinite_flags", lambda t, likely=False: read.append(t) or real(t, likely))

    def fn(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        loss.backward()
        return loss

    assert ng.locate(fn, torch.ones(3, 4), model=model) is None
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not [t for t in read if t.untyped_storage().data_ptr() in params]


def test_a_mask_fill_after_a_nan_origin_leaves_the_origin_named() -> None:
    # The -inf written into an already-NaN tensor is no new origin worth a pass: the log stays the answer.
    x = torch.tensor([[-1.0, 2.0], [3.0, 4.0]], requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        scores = x.log() * 2
        masked = scores.masked_fill(torch.tensor([[False, True], [False, False]]), -INF)
        return masked.softmax(-1).sum()

    diag = ng.locate(fn, x)
    assert diag is not None
    assert diag.op == "aten.log.default"
    assert diag.evidence["origin"]["category"] == "op"


def test_list_arguments_are_walked_and_int_lists_are_not() -> None:
    from nanguard.tracer import ops

    aten = torch.ops.aten
    assert not ops.info(aten.cat.default).flat
    assert not ops.info(aten.index.Tensor).flat
    assert not ops.info(aten._foreach_add.List).flat
    assert ops.info(aten.view.default).flat
    assert ops.info(aten.sum.dim_IntList).flat
    assert ops.info(aten.addmm.default).flat


def test_finite_tensors_read_together_match_one_by_one() -> None:
    # A healthy step's gradients are shown finite by one norm over them; squares past float32's range, a
    # sparse gradient, mixed dtypes and a NaN/Inf away from the first element read as one by one.
    sparse = torch.tensor([[0.0, 2.0], [1.0, 0.0]]).to_sparse()
    cases = [
        [torch.ones(3), torch.randn(4, 4), torch.zeros(2, dtype=torch.float64)],
        [torch.ones(3), torch.full((5,), 3e38)],
        [torch.ones(3), sparse, _planted(torch.float16, (), 3)],
        [torch.ones(3), _planted(torch.float32, (INF,), 5), torch.ones(2)],
        [torch.ones(3), _planted(torch.float32, (NAN,), 5)],
        [torch.tensor([NAN, 1.0]), torch.ones(2), torch.full((2,), -INF)],
    ]
    for ts in cases:
        expected = [_reference(t.to_dense()) for t in ts]
        assert many_nonfinite_flags(ts) == [nonfinite_flags(t) for t in ts] == expected, ts


def test_a_step_under_inference_mode_is_located() -> None:
    # Inference tensors keep no version counter: views of them, in-place writes and the op that makes NaN.
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.view(4) * 2
        z = y.clone()
        z.add_(1.0)
        return z.log().sum()

    with torch.inference_mode():
        x = torch.tensor([[-1.0, 2.0], [3.0, 4.0]])
        diag = ng.locate(fn, x)
    assert diag is not None
    assert (diag.op, diag.kind, diag.cause) == ("aten.log.default", "nan", "op.log_domain")
    assert diag.evidence["origin"]["inputs"][0]["min"] == -1.0  # 2 * -1 + 1
