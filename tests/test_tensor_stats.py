"""``tensor_stats`` gives the numbers a straightforward, element-by-element count gives."""

import math
from typing import Any

import pytest
import torch

from nanguard.stats import tensor_stats

NAN, INF = math.nan, math.inf
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)


def _reference(t: torch.Tensor) -> dict[str, Any]:
    """Each statistic from its own pass over the values as Python floats."""
    values = [float(v) for v in t.reshape(-1).to(torch.float64).tolist()]
    finite = [v for v in values if math.isfinite(v)]
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "min": min(finite) if finite else None,
        "max": max(finite) if finite else None,
        "absmax": max((abs(v) for v in finite), default=0.0),
        "zeros": sum(v == 0 for v in values),
        "negative": sum(v < 0 for v in values),
        "nan": sum(math.isnan(v) for v in values),
        "posinf": sum(v == INF for v in values),
        "neginf": sum(v == -INF for v in values),
    }


def _planted(dtype: torch.dtype, values: tuple[float, ...], n: int) -> torch.Tensor:
    torch.manual_seed(0)
    t = torch.randn(n, dtype=torch.float64)
    t[1::5] = 0.0
    for k, v in enumerate(values):
        t[(3 + 11 * k) % n] = v
    return t.to(dtype).reshape(-1, n // 7) if n % 7 == 0 else t.to(dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_stats_match_an_elementwise_count(dtype: torch.dtype) -> None:
    # float8_e4m3fn has no Inf: a cast saturates, and the reference counts what the tensor holds.
    plants = [(), (NAN,), (INF,), (-INF,), (INF, -INF), (NAN, INF, -INF), (-INF, -INF, 0.0)]
    for values in plants:
        for n in (1, 49, 4097):
            t = _planted(dtype, values[:n], n)
            assert tensor_stats(t) == _reference(t), (dtype, values, n)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_stats_without_finite_values(dtype: torch.dtype) -> None:
    # float8_e4m3fn has no Inf (a cast saturates): only NaN leaves it without finite values.
    t = torch.tensor([NAN, INF, -INF, NAN] if dtype != torch.float8_e4m3fn else [NAN, NAN]).to(dtype)
    stats = tensor_stats(t)
    assert stats == _reference(t)
    assert stats["min"] is None and stats["max"] is None and stats["absmax"] == 0.0


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_stats_of_an_empty_tensor_name_only_dtype_and_shape(dtype: torch.dtype) -> None:
    assert tensor_stats(torch.empty(0, 3, dtype=dtype)) == {"dtype": str(dtype).removeprefix("torch."), "shape": [0, 3]}


def test_float64_keeps_its_range() -> None:
    t = torch.tensor([1e300, -1e300, 0.0], dtype=torch.float64)
    stats = tensor_stats(t)
    assert stats == _reference(t)
    assert stats["posinf"] == 0 and stats["max"] == 1e300


def test_a_non_contiguous_view_is_counted_as_it_reads() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6) - 10
    t[0, 0] = NAN
    view = t.t()[::2]
    assert tensor_stats(view) == _reference(view)
