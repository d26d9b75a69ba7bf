"""The RNG capture a guarded step takes before its forward: exact for Python's ``random``,
numpy's legacy generator (its cached gaussian included) and torch, read through their public getters."""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import nanguard as ng
from nanguard import rng
from nanguard.rng import get_rng_state, set_rng_state


@pytest.fixture(autouse=True)
def _global_states_back() -> Iterator[None]:
    generator = np.random.get_bit_generator()
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    np.random.set_bit_generator(generator)
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


def _decoded(state: dict[str, torch.Tensor]) -> tuple[tuple, tuple]:
    """(Python's getstate(), numpy's legacy get_state() without the name), read back from the bytes."""
    py = state["python"].numpy().tobytes()
    version, has_gauss, gauss = struct.unpack_from("<iBd", py)
    python = (version, tuple(np.frombuffer(py[13:], dtype="<u4").tolist()), gauss if has_gauss else None)
    raw = state["numpy"].numpy().tobytes()
    pos, np_has_gauss, np_gauss = struct.unpack_from("<iid", raw)
    return python, (np.frombuffer(raw[16:], dtype="<u4").tolist(), pos, np_has_gauss, np_gauss)


def _public() -> tuple[tuple, tuple]:
    name, key, pos, has_gauss, gauss = np.random.get_state()
    assert name == "MT19937"
    return random.getstate(), (key.tolist(), pos, has_gauss, gauss)


def _same_key_with_a_cached_gaussian() -> None:
    # The MT19937 words and position stay; only the cached gaussian changes: a capture that
    # compared the words alone would keep the state from before.
    np.random.seed(4)
    get_rng_state()
    _, key, pos, _, _ = np.random.get_state()
    np.random.set_state(("MT19937", key, pos, 1, 0.625))


def _another_bit_generator() -> None:
    np.random.set_bit_generator(np.random.MT19937(11))
    np.random.standard_normal()


STATES: dict[str, Callable[[], None]] = {
    "seeded": lambda: (random.seed(1), np.random.seed(1)),
    "odd gaussian draws (one cached)": lambda: (random.gauss(0, 1), np.random.randn(3)),
    "even gaussian draws (none cached)": lambda: (random.gauss(0, 1), np.random.randn(4)),
    "a cached gaussian consumed, the words unchanged": lambda: (np.random.randn(1), get_rng_state(), np.random.randn()),
    "the same words, a cached gaussian set": _same_key_with_a_cached_gaussian,
    "a new bit generator under numpy.random": _another_bit_generator,
}


@pytest.mark.parametrize("name", list(STATES))
def test_a_capture_holds_what_the_public_getters_return(name: str) -> None:
    get_rng_state()  # a capture of the states before (an unchanged state's tensor is handed out again)
    STATES[name]()
    assert _decoded(get_rng_state()) == _public()


def test_the_capture_reads_no_interpreter_memory() -> None:
    # Public getters only: nothing reads CPython's or numpy's objects through ctypes.
    import inspect

    assert "ctypes" not in inspect.getsource(rng)


def test_a_capture_written_over_does_not_leak_into_the_next() -> None:
    # An unchanged state's tensor is handed out again; one written over in place is not.
    first = get_rng_state()
    again = get_rng_state()
    assert again["python"] is first["python"] and again["numpy"] is first["numpy"]
    first["python"].zero_(), first["numpy"].zero_()
    assert _decoded(get_rng_state()) == _public()


def test_a_wrapped_random_getstate_is_read_through(monkeypatch) -> None:
    # A wrapper (a mock, a tracer) hides the generator behind random.getstate: its result is what counts.
    inner = random.getstate
    monkeypatch.setattr(random, "getstate", lambda: inner())
    random.gauss(0.0, 1.0)
    assert _decoded(get_rng_state())[0] == random.getstate()


def test_a_global_generator_other_than_mt19937_is_not_captured() -> None:
    np.random.set_bit_generator(np.random.PCG64(0))
    assert "numpy" not in get_rng_state()


def _draws() -> tuple:
    """What a data pipeline's step draws from every global generator: the gaussians first, so a
    cached one (left by the draws before the step) is what they return."""
    return (
        np.random.standard_normal(),
        random.gauss(0.0, 1.0),
        np.random.randn(3).tolist(),
        random.random(),
        int(np.random.randint(1000)),
        torch.rand(2).tolist(),
    )


def _before_the_step() -> None:
    # An odd number of gaussians in each: the step starts with one cached.
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    random.gauss(0.0, 1.0), np.random.randn(3)
    assert np.random.get_state()[3] == 1 and random.getstate()[2] is not None


def _guarded(bad: dict[str, bool], runs: list[tuple]) -> tuple[ng.Guard, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    guard = ng.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="skip")

    def step() -> torch.Tensor:
        runs.append(_draws())
        model.zero_grad()
        loss = model(torch.ones(2, 3)).sum() * (float("nan") if bad["now"] else 1.0)
        loss.backward()
        return loss

    return guard, step


def test_a_replayed_step_draws_what_the_step_drew() -> None:
    bad, runs = {"now": True}, []
    guard, step = _guarded(bad, runs)
    _before_the_step()
    guard.step(step)
    assert guard.last_diagnosis is not None and len(runs) >= 2  # the trip was replayed
    assert all(run == runs[0] for run in runs[1:])


def test_a_skipped_step_leaves_the_next_one_drawing_what_it_drew() -> None:
    bad, runs = {"now": True}, []
    guard, step = _guarded(bad, runs)
    _before_the_step()
    assert guard.step(step) is None  # skipped: the RNG states are put back
    first = runs[0]
    bad["now"], runs[:] = False, []
    guard.step(step)
    assert runs == [first]
    _before_the_step()
    assert _draws() == first  # and those are the draws from the state before the skipped step


def test_set_rng_state_restores_a_capture_taken_mid_gaussian_pair() -> None:
    _before_the_step()
    state = get_rng_state()
    expected = _draws()
    set_rng_state(state)
    assert _draws() == expected


def test_a_rollback_leaves_every_generator_as_before_the_tripped_step() -> None:
    # The guard's capture keeps Python's and numpy's states as their getters returned them: a
    # rollback puts them back bit for bit, so the next batch draws what the tripped one drew.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    guard = ng.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="rollback", snapshot_every=1)
    bad, runs = {"now": False}, []

    def step() -> torch.Tensor:
        runs.append(_draws())
        model.zero_grad()
        loss = model(torch.ones(2, 3)).sum() * (float("nan") if bad["now"] else 1.0)
        loss.backward()
        return loss

    for _ in range(3):
        guard.step(step)
    before = _public(), torch.get_rng_state()
    bad["now"], runs[:] = True, []
    assert guard.step(step) is None and guard.rollbacks == 1
    after = _public(), torch.get_rng_state()
    assert after[0] == before[0] and torch.equal(after[1], before[1])
    assert _draws() == runs[0]  # the draws of the rolled-back step, from the state before it


def test_the_guards_capture_reads_as_the_public_one() -> None:
    _before_the_step()
    captured, public = rng.capture_rng(), get_rng_state()
    assert list(captured) == list(public)
    assert all(torch.equal(captured[key], public[key]) for key in public)
    assert _decoded(dict(captured)) == _public()


def test_the_guards_capture_never_imports_numpy_random() -> None:
    # numpy imports numpy.random lazily: before it is imported no global numpy generator exists to
    # draw from, so the capture neither imports nor reads it; once imported, it is captured.
    import subprocess
    import sys

    code = (
        "import sys, random, torch\n"
        "from nanguard.rng import capture_rng, set_rng_state\n"
        "state = capture_rng(); a = random.random(); set_rng_state(state)\n"
        "print('numpy.random' in sys.modules, 'numpy' in state, random.random() == a)\n"
        "import numpy.random\n"
        "print('numpy' in capture_rng())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "True", "True"]
