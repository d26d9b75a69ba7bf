"""``tensor_stats`` gives the numbers a straightforward, element-by-element count gives."""

import math
import warnings
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


_EVERY_DTYPE = sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype)} - set(FLOATS), key=lambda d: str(d)
)


def _made(dtype: torch.dtype, values: list[float]) -> torch.Tensor | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32: "experimental"
        try:
            return torch.tensor(values, dtype=torch.float64).to(dtype)
        except (RuntimeError, TypeError):  # quantized and sub-byte dtypes: not made by a cast
            return None


@pytest.mark.parametrize("dtype", _EVERY_DTYPE, ids=str)
def test_stats_work_on_every_dtype_torch_has(dtype: torch.dtype) -> None:
    t = _made(dtype, [0.0, 3.0, 2.0, 1.0])
    if t is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # quantized dtypes: "deprecated"
                raw = torch.empty(4, dtype=dtype)
        except (RuntimeError, TypeError):
            pytest.skip(f"torch makes no {dtype} tensor here")
        found = tensor_stats(raw)  # whatever its bytes hold: described or the reason why not, never raised
        assert found["dtype"] == str(dtype).removeprefix("torch.") and found["shape"] == [4]
        return
    found = tensor_stats(t)
    assert "stats_error" not in found, found
    assert found["dtype"] == str(dtype).removeprefix("torch.") and found["shape"] == [4]
    if t.is_complex():
        assert (found["absmax"], found["zeros"], found["nan"], found["inf"]) == (3.0, 1, 0, 0)
    elif t.is_floating_point():
        top = float(t.float().max())  # 3.0 where the dtype holds it (float8_e8m0fnu holds powers of 2)
        assert found["max"] == found["absmax"] == top and found["nan"] == 0
    else:
        top = 1 if dtype == torch.bool else 3
        assert (found["min"], found["max"], found["zeros"], found["negative"]) == (0, top, 1, 0)


def test_unsigned_extremes_are_exact_and_complex_non_finite_values_are_counted() -> None:
    top = tensor_stats(torch.tensor([2**64 - 1, 5], dtype=torch.uint64))
    assert (top["min"], top["max"], top["zeros"]) == (5, 2**64 - 1, 0)
    assert tensor_stats(torch.tensor([65531, 7], dtype=torch.uint16))["max"] == 65531
    assert tensor_stats(torch.tensor([2**32 - 1], dtype=torch.uint32))["min"] == 2**32 - 1
    z = tensor_stats(torch.tensor([3 + 4j, complex(NAN, 0), complex(INF, 1), 0j]))
    assert (z["absmax"], z["zeros"], z["nan"], z["inf"]) == (5.0, 1, 1, 1)


def test_a_statistic_that_fails_is_named_and_never_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    from nanguard import stats

    def broken(x: torch.Tensor) -> dict[str, Any]:
        raise NotImplementedError('"min_all" not implemented for this dtype')

    monkeypatch.setattr(stats, "_float_stats", broken)
    found = tensor_stats(torch.ones(3))
    assert found["dtype"] == "float32" and "min_all" in found["stats_error"] and "min" not in found


class _Terrain(torch.nn.Module):
    """A height map stored as uint16 (a DEM tile) cast to float16 for a half-precision model: an
    elevation past float16's max (65504) becomes inf in the cast."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 8).half()

    def forward(self, heights: torch.Tensor) -> torch.Tensor:
        h = heights.to(torch.float16)
        h = (h - h.mean()) / 1000.0
        return self.proj(h).float().pow(2).mean()


def _heights() -> torch.Tensor:
    heights = torch.randint(0, 3000, (4, 16), generator=torch.Generator().manual_seed(0)).to(torch.uint16)
    heights[1, 5] = 65531
    return heights


def test_a_uint16_cast_overflowing_float16_is_named_with_its_inputs_statistics() -> None:
    import nanguard as ng

    model = _Terrain()
    diag = ng.locate(model, _heights(), model=model)
    assert (diag.cause, diag.op, diag.phase, diag.kind) == (
        "precision.overflow",
        "aten._to_copy.default",
        "forward",
        "inf",
    )
    (given,) = diag.evidence["origin"]["inputs"]
    assert (given["dtype"], given["max"], given["negative"]) == ("uint16", 65531, 0)


def test_under_the_guard_the_cast_is_diagnosed_not_unknown() -> None:
    import nanguard as ng

    model = _Terrain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, opt)
    heights = _heights()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(heights)
        loss.backward()
        return loss

    assert guard.step(closure, batch={"heights": heights}) is None
    diag = guard.last_diagnosis
    assert (diag.cause, diag.op, diag.phase) == ("precision.overflow", "aten._to_copy.default", "forward")
    guard.close()


def _mask_counts(t: torch.Tensor) -> dict[str, int]:
    """The counts as bool masks give them (one comparison per statistic)."""
    return {
        "zeros": int((t == 0).sum()),
        "negative": int((t < 0).sum()),
        "nan": int(torch.isnan(t).sum()),
        "posinf": int(torch.isposinf(t).sum()),
        "neginf": int(torch.isneginf(t).sum()),
    }


@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nonfinite"])
def test_counts_past_float32s_exact_range_sum_exactly(nonfinite: bool) -> None:
    # More than 2**22 elements: the sums of the counting codes (up to 4 per element) leave float32's exact integers.
    t = torch.randn(2**22 + 7, generator=torch.Generator().manual_seed(0))
    t[::5] = 0.0
    t[1::9] = -0.0
    if nonfinite:
        t[2::11], t[3::13], t[4::17] = NAN, INF, -INF
    stats = tensor_stats(t)
    assert {k: stats[k] for k in ("zeros", "negative", "nan", "posinf", "neginf")} == _mask_counts(t)
    finite = t[torch.isfinite(t)]
    assert (stats["min"], stats["max"]) == (finite.min().item(), finite.max().item())


def test_init_ratios_are_each_weights_init_ratio() -> None:
    from nanguard.stats import init_ratio, init_ratios

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(64, 3, 5, generator=gen) * 10.0**k for k in (-3, 0, 3, 20)]
    weights += [torch.randn(7, 1, dtype=torch.float64) * 1e25, torch.full((3, 4), INF), torch.randn(128, 512)]
    one_by_one = [init_ratio(w).item() for w in weights]
    assert init_ratios(weights).tolist() == one_by_one
    assert math.isinf(one_by_one[-2]) and 20 < one_by_one[-1] < 25  # rms 1 times sqrt(512)
