"""Capture and restore the random number generator states a step depends on.

States are plain ``uint8`` CPU tensors keyed by device (``"cpu"``, ``"cuda:0"``, ...), so a
bundle can store them in safetensors and a replay can put them back.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch

__all__ = ["fork_rng_state", "get_rng_state", "set_rng_state"]

_CUDA_KEY = re.compile(r"cuda:(\d+)")


def get_rng_state(cuda_devices: Iterable[int] | None = None) -> dict[str, torch.Tensor]:
    """The CPU generator state and that of the CUDA devices (all of them when ``cuda_devices``
    is None), once CUDA is initialized.

    Example:
        >>> state = get_rng_state()
        >>> a = torch.rand(3)
        >>> set_rng_state(state)
        >>> torch.equal(a, torch.rand(3))
        True
    """
    state = {"cpu": torch.get_rng_state()}
    # Before CUDA is initialized no CUDA generator has drawn anything, and asking for its
    # state would initialize CUDA as a side effect.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        indices = range(torch.cuda.device_count()) if cuda_devices is None else cuda_devices
        for index in indices:
            state[f"cuda:{index}"] = torch.cuda.get_rng_state(index)
    return state


def set_rng_state(state: Mapping[str, torch.Tensor]) -> None:
    """Restore states from ``get_rng_state``.

    CUDA states are skipped with a warning when CUDA is unavailable or the device does not
    exist here; unknown keys are skipped with a warning too. A state that is not a valid
    generator state raises ``ValueError``.

    Example:
        >>> state = get_rng_state()
        >>> set_rng_state(state)
    """
    skipped: list[str] = []
    for key, value in state.items():
        tensor = value.detach().to("cpu")
        if tensor.dtype != torch.uint8:
            raise ValueError(f"RNG state {key!r} must be a uint8 tensor, got {tensor.dtype}")
        match = _CUDA_KEY.fullmatch(key)
        try:
            if key == "cpu":
                torch.set_rng_state(tensor)
            elif match is not None:
                index = int(match.group(1))
                if not torch.cuda.is_available() or index >= torch.cuda.device_count():
                    skipped.append(key)
                    continue
                torch.cuda.set_rng_state(tensor, index)
            else:
                skipped.append(key)
        except RuntimeError as err:
            raise ValueError(f"RNG state {key!r} is not a valid generator state: {err}") from None
    if skipped:
        warnings.warn(
            f"RNG states {skipped} were not restored: no such device here",
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
