import math

import pytest

from nanguard.spikes import SpikeDetector


def test_spike_after_warmup_and_nonfinite_never_enters_the_window() -> None:
    det = SpikeDetector("loss", window=20, warmup=5, threshold=6.0)
    assert [det.update(2.0 + 0.01 * (i % 3)) for i in range(4)] == [None] * 4
    assert det.update(float("nan")) is None and det.update(math.inf) is None
    assert all(math.isfinite(v) for v in det.values)
    for i in range(6):
        assert det.update(2.0 + 0.01 * (i % 3)) is None
    spike = det.update(9.0)
    assert spike is not None and spike.metric == "loss" and spike.score > 6.0 and spike.median == pytest.approx(2.01)


def test_no_spike_during_warmup_and_state_round_trip() -> None:
    det = SpikeDetector("grad_norm", window=10, warmup=5)
    assert det.update(1.0) is None and det.update(1000.0) is None
    other = SpikeDetector("grad_norm", window=10, warmup=5)
    other.load_state_dict(det.state_dict())
    assert list(other.values) == [1.0, 1000.0]


@pytest.mark.parametrize(("kwargs", "name"), [({"window": 2}, "window"), ({"warmup": 0}, "warmup"),
                                              ({"threshold": 0.0}, "threshold")])  # fmt: skip
def test_bad_settings(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        SpikeDetector("loss", **kwargs)
