"""Capture and restore the random number generator states a step depends on.

States are plain ``uint8`` CPU tensors keyed by device (``"cpu"``, ``"cuda:0"``, ...), and by
``"python"`` and ``"numpy"`` for the global generators of Python's ``random`` and of
``numpy.random`` (a diffusion timestep sampler, an augmentation), packed as bytes: a bundle stores
them in safetensors with no pickle, and a replay draws the same numbers the step drew.
Generators the step owns (a ``numpy.random.Generator``, a ``random.Random``, a ``torch.Generator``
of its own) are not global: ``private_generators`` names the ones a closure can reach.

The guard captures before every step (``capture_rng``): torch's states as tensors, Python's as
``random.getstate()`` returned it, turned into bytes only when a trip, a bundle or a peer reads it,
and numpy's only once ``numpy.random`` is imported (before that no global numpy generator exists,
so none was drawn from; reading numpy's state through its public getter costs ~30 us).
"""

from __future__ import annotations

import array
import random
import re
import struct
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["RngCapture", "capture_rng", "fork_rng_state", "get_rng_state", "private_generators", "set_rng_state"]

# Python's random: version, whether a gaussian is cached, the cached value, then 625 words.
_PY_HEAD = struct.Struct("<iBd")
# numpy's legacy MT19937: position, whether a gaussian is cached, the cached value, then 624 words.
_NP_HEAD = struct.Struct("<iid")

_CUDA_KEY = re.compile(r"cuda:(\d+)")


def get_rng_state(cuda_devices: Iterable[int] | None = None) -> dict[str, torch.Tensor]:
    """The CPU generator state and that of the CUDA devices (all of them when ``cuda_devices``
    is None), once CUDA is initialized, and those of Python's ``random`` and numpy's global
    generator. Two captures of an unchanged ``random`` or numpy state may share its tensor:
    read the tensors, do not write them.

    Example:
        >>> state = get_rng_state()
        >>> a = torch.rand(3)
        >>> set_rng_state(state)
        >>> torch.equal(a, torch.rand(3))
        True
    """
    state = {"cpu": torch.get_rng_state(), "python": _python_state()}
    numpy_state = _numpy_state()
    if numpy_state is not None:
        state["numpy"] = numpy_state
    state.update(_cuda_states(cuda_devices))
    return state


def _cuda_states(cuda_devices: Iterable[int] | None) -> dict[str, torch.Tensor]:
    # Before CUDA is initialized no CUDA generator has drawn anything, and asking for its
    # state would initialize CUDA as a side effect.
    if not (torch.cuda.is_initialized() and torch.cuda.is_available()):
        return {}
    indices = range(torch.cuda.device_count()) if cuda_devices is None else cuda_devices
    return {f"cuda:{index}": torch.cuda.get_rng_state(index) for index in indices}


class RngCapture(Mapping[str, torch.Tensor]):
    """The states ``capture_rng`` took, read as ``get_rng_state``'s tensors; Python's and numpy's
    are kept as their getters returned them (immutable) and become tensors only when read.

    Example:
        >>> state = capture_rng()
        >>> _ = random.random()
        >>> set_rng_state(state)      # Python's generator set back from the kept tuple, no bytes made
        >>> state["python"].dtype     # the bytes, made now
        torch.uint8
    """

    __slots__ = ("_numpy", "_python", "_tensors")

    def __init__(self, tensors: dict[str, torch.Tensor], python: tuple[Any, ...], numpy: Any) -> None:
        self._tensors, self._python, self._numpy = tensors, python, numpy

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._tensors:
            if key == "python":
                self._tensors[key] = _fresh(_python_bytes(self._python))
            elif key == "numpy" and self._numpy is not None:
                self._tensors[key] = _fresh(_numpy_bytes(self._numpy))
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        yield from ("cpu", "python", *(("numpy",) if self._numpy is not None else ()))
        yield from (key for key in self._tensors if key not in ("cpu", "python", "numpy"))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def restore(self) -> None:
        """Put every captured state back (Python's and numpy's from what their getters returned)."""
        random.setstate(self._python)
        if self._numpy is not None and not _set_numpy(self._numpy):
            warnings.warn("RNG states ['numpy'] were not restored: no numpy here", UserWarning, stacklevel=3)
        set_rng_state({key: value for key, value in self._tensors.items() if key not in ("python", "numpy")})


def capture_rng(cuda_devices: Iterable[int] | None = None) -> RngCapture:
    """The states ``get_rng_state`` holds, as the guard takes them before every step: Python's kept as
    ``random.getstate()`` returned it, numpy's only once ``numpy.random`` is imported (no global numpy
    generator exists before), each made into bytes only when read.

    Example:
        >>> state = capture_rng()
        >>> a = (random.random(), torch.rand(3))
        >>> set_rng_state(state)
        >>> b = (random.random(), torch.rand(3))
        >>> a[0] == b[0] and torch.equal(a[1], b[1])
        True
    """
    tensors = {"cpu": torch.default_generator.get_state()}  # what torch.get_rng_state returns
    if cuda_devices is None or cuda_devices:
        tensors.update(_cuda_states(cuda_devices))
    rand = _GLOBAL_RANDOM_STATE[0] if _GLOBAL_RANDOM_STATE else _global_random_state()
    numpy = None
    if rand is not None and type(rand._bit_generator).__name__ == "MT19937":  # ``_mt19937``, inline: each step
        numpy = rand.get_state(legacy=False)
    return RngCapture(tensors, random.getstate(), numpy)


_GLOBAL_RANDOM_STATE: list[Any] = []
"""numpy.random's global RandomState once found: numpy keeps that one object for the process (``seed``,
``set_state`` and ``set_bit_generator`` change it in place), so each capture reads it without a lookup."""


def _global_random_state() -> Any:
    """numpy.random's global RandomState, looked up, never imported (numpy imports it lazily, and a run
    that never imported it never drew from it); None before it is imported."""
    rand = getattr(sys.modules.get("numpy.random.mtrand"), "_rand", None)
    if rand is not None:
        _GLOBAL_RANDOM_STATE.append(rand)
    return rand


def _mt19937(rand: Any) -> bool:
    return type(rand._bit_generator).__name__ == "MT19937"


def set_rng_state(state: Mapping[str, torch.Tensor]) -> None:
    """Restore states from ``get_rng_state``.

    CUDA states are skipped with a warning when CUDA is unavailable or the device does not
    exist here; unknown keys are skipped with a warning too. A state that is not a valid
    generator state raises ``ValueError``.

    Example:
        >>> state = get_rng_state()
        >>> set_rng_state(state)
    """
    if isinstance(state, RngCapture):
        state.restore()
        return
    skipped: list[str] = []
    for key, value in state.items():
        tensor = value.detach().to("cpu")
        if tensor.dtype != torch.uint8:
            raise ValueError(f"RNG state {key!r} must be a uint8 tensor, got {tensor.dtype}")
        match = _CUDA_KEY.fullmatch(key)
        try:
            if key == "cpu":
                torch.set_rng_state(tensor)
            elif key == "python":
                _set_python_state(tensor)
            elif key == "numpy":
                if not _set_numpy_state(tensor):
                    skipped.append(key)
            elif match is not None:
                index = int(match.group(1))
                if not torch.cuda.is_available() or index >= torch.cuda.device_count():
                    skipped.append(key)
                    continue
                torch.cuda.set_rng_state(tensor, index)
            else:
                skipped.append(key)
        except (RuntimeError, struct.error, TypeError, ValueError) as err:
            raise ValueError(f"RNG state {key!r} is not a valid generator state: {err}") from None
    if skipped:
        warnings.warn(
            f"RNG states {skipped} were not restored: no such device (or numpy) here",
            UserWarning,
            stacklevel=2,
        )


@contextmanager
def fork_rng_state() -> Iterator[dict[str, torch.Tensor]]:
    """Run a block and put every RNG state back afterwards, even if it raises.

    Example:
        >>> with fork_rng_state():
        ...     torch.manual_seed(0)
        ...     noise = torch.rand(3)
        >>> # the caller's random stream continues as if the block never ran
    """
    saved = get_rng_state()
    try:
        yield saved
    finally:
        set_rng_state(saved)


def _python_state() -> torch.Tensor:
    return _tensor("python", _python_bytes(random.getstate()))


def _set_python_state(t: torch.Tensor) -> None:
    raw = t.numpy().tobytes()
    version, has_gauss, gauss = _PY_HEAD.unpack_from(raw)
    words = array.array("I", raw[_PY_HEAD.size :])
    random.setstate((version, tuple(words), gauss if has_gauss else None))


def _numpy_random() -> Any:
    """numpy.random's global RandomState, when numpy is imported (never imported here for it)."""
    numpy = sys.modules.get("numpy")
    return getattr(getattr(getattr(numpy, "random", None), "mtrand", None), "_rand", None)


def _set_numpy(state: dict[str, Any]) -> bool:
    rand = _numpy_random()
    if rand is None:
        return False
    rand.set_state(state)
    return True


def _fresh(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _numpy_state() -> torch.Tensor | None:
    rand = _numpy_random()
    if rand is None or not _mt19937(rand):
        return None
    return _tensor("numpy", _numpy_bytes(rand.get_state(legacy=False)))


def _set_numpy_state(t: torch.Tensor) -> bool:
    rand = _numpy_random()
    if rand is None:
        return False
    import numpy

    raw = t.numpy().tobytes()
    pos, has_gauss, gauss = _NP_HEAD.unpack_from(raw)
    keys = numpy.frombuffer(raw[_NP_HEAD.size :], dtype="<u4").astype(numpy.uint32)
    rand.set_state(("MT19937", keys, pos, has_gauss, gauss))
    return True


def _python_bytes(state: tuple[Any, ...]) -> bytes:
    version, words, gauss = state
    return _PY_HEAD.pack(version, gauss is not None, gauss or 0.0) + array.array("I", words).tobytes()


def _numpy_bytes(state: dict[str, Any]) -> bytes:
    mt = state["state"]
    head = _NP_HEAD.pack(int(mt["pos"]), int(state["has_gauss"]), float(state["gauss"]))
    return head + mt["key"].astype("<u4").tobytes()


_LAST: dict[str, bytearray] = {}  # the buffer under the last tensor of each key (its live bytes)
_LAST_TENSOR: dict[str, torch.Tensor] = {}


def _tensor(key: str, raw: bytes) -> torch.Tensor:
    """``raw`` as a uint8 tensor; the last one of ``key`` again when it holds these bytes still (a
    generator the steps do not draw from: its state is the same bytes step after step)."""
    if _LAST.get(key) == raw:
        return _LAST_TENSOR[key]
    buffer = bytearray(raw)
    _LAST[key], _LAST_TENSOR[key] = buffer, torch.frombuffer(buffer, dtype=torch.uint8)
    return _LAST_TENSOR[key]


def private_generators(fn: Callable[..., Any], owner: Any = None) -> list[str]:
    """The random generators ``fn`` (a step's closure) can reach that are not the global ones a
    replay restores: a ``numpy.random.Generator``/``RandomState``, a ``random.Random``, a
    ``torch.Generator`` held in its closure cells, its defaults, the globals it names, or the
    attributes of ``owner`` (the model) and of a bound method's object, one level deep.

    Example:
        >>> rng = numpy.random.default_rng(0)
        >>> private_generators(lambda: rng.integers(10))
        ["numpy Generator 'rng' (closure variable)"]
    """
    found: list[str] = []
    seen: set[int] = set()
    functions = [fn]
    for holder, label in ((getattr(fn, "__self__", None), "attribute"), (owner, "model attribute")):
        for name, value in vars(holder).items() if hasattr(holder, "__dict__") else ():
            _note(found, seen, name, label, value)
    # The closure, and the functions it calls through its cells or globals (a step wrapped in a lambda).
    for depth in range(2):
        called: list[Callable[..., Any]] = []
        for f in functions:
            for name, where, value in _reachable(f):
                _note(found, seen, name, where, value)
                if depth == 0 and callable(value) and hasattr(value, "__code__") and id(value) not in seen:
                    seen.add(id(value))
                    called.append(value)
        functions = called
    return found


def _reachable(fn: Callable[..., Any]) -> Iterator[tuple[str, str, Any]]:
    """(name, where, value) of what ``fn`` holds: closure cells, defaults, the globals it names."""
    code = getattr(fn, "__code__", None)
    for name, cell in zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or (), strict=False):
        try:
            yield name, "closure variable", cell.cell_contents
        except ValueError:  # an empty cell
            continue
    glob = getattr(fn, "__globals__", {})
    for name in getattr(code, "co_names", ()):
        if name in glob:
            yield name, "global", glob[name]
    for i, value in enumerate(getattr(fn, "__defaults__", None) or ()):
        yield f"default {i}", "default argument", value


def _note(found: list[str], seen: set[int], name: str, where: str, value: Any) -> None:
    kind = _private_kind(value)
    if kind is not None and id(value) not in seen:
        seen.add(id(value))
        found.append(f"{kind} {name!r} ({where})")


def _private_kind(value: Any) -> str | None:
    if isinstance(value, random.Random) and value is not getattr(random, "_inst", None):
        return "random.Random"
    if isinstance(value, torch.Generator) and value is not torch.default_generator:
        return "torch.Generator"
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(value, numpy.random.Generator):
            return "numpy Generator"
        if isinstance(value, numpy.random.RandomState) and value is not _numpy_random():
            return "numpy RandomState"
    return None
