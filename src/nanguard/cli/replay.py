"""``nanguard replay``: build the user's model from ``pkg.module:factory``, load weights, replay a bundle.

Only the code the ``--model`` and ``--fn`` specs name runs; weights load as safetensors or
with ``torch.load(weights_only=True)``. Wrong options raise ValueError naming the option.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from nanguard.bundle import WEIGHTS_FILE, Bundle, load_bundle, replay
from nanguard.errors import NanguardError
from nanguard.findings import Diagnosis
from nanguard.specs import call, parse_spec, resolve

__all__ = ["ReplayResult", "main_replay", "version_note"]


class ReplayResult(NamedTuple):
    """What ``main_replay`` did: the bundle, the diagnosis (None: the replay is finite), and
    where the weights came from (None: as the factory built them)."""

    bundle: Bundle
    diagnosis: Diagnosis | None
    weights: str | None

    def finite_hint(self) -> str:
        """The one line for a finite replay: what may be missing, and how to get it."""
        where = f"{self.bundle.path}: the replay is finite"
        if self.weights is not None:
            return f"{where}: the fault does not reproduce on this machine (weights: {self.weights})"
        record = self.bundle.meta.get("weights", {})
        if record.get("stored"):
            why = f"this bundle carries {record.get('note')}, which one process cannot load"
            return f"{where}; the fault may live in the weights: {why}: pass --weights PATH with the full state dict"
        if "bytes" in record:
            how = f"raise Guard(bundle_weights=N bytes) or pass --weights PATH ({record.get('reason')})"
        else:
            how = "record them with Guard(bundle_weights=True) or pass --weights PATH"
        return f"{where} with the factory's weights; the fault may live in the weights, which this bundle lacks: {how}"


def main_replay(
    bundle_path: str,
    model_spec: str,
    weights: str | None,
    fn_spec: str | None,
    *,
    starting: Callable[[], None] | None = None,
) -> ReplayResult:
    """``nanguard replay``: load a bundle, build the model, replay the step under ``locate``.

    ``model_spec`` is ``"pkg.module:factory"``; the factory is called with no arguments.
    ``weights`` is a ``.safetensors`` file or a ``torch.save`` state dict (loaded with
    ``weights_only=True``); without it, the weights the bundle carries are loaded, if any
    (``Guard(bundle_weights=True)``), unless they are one rank's shards. ``fn_spec`` is
    ``"pkg.module:function"``, called as ``function(model)`` to get the step closure. Only
    the code these specs name runs. ``starting()`` is called once all is loaded, as the replay starts.

    Example:
        >>> bundle, diag, weights = main_replay("runs/a/bundles/step-00000812-rank-0",
        ...                                     "mytrain.model:build", None, None)
        >>> weights
        'the bundle (weights.safetensors)'
    """
    parse_spec(model_spec, "--model", "pkg.module:factory")
    if fn_spec is not None:
        parse_spec(fn_spec, "--fn", "pkg.module:function")
    bundle = load_bundle(bundle_path)

    factory = resolve(model_spec, "--model", "pkg.module:factory")
    model = call(factory, "--model", model_spec)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model: {model_spec!r} returned a {type(model).__name__}, not a torch.nn.Module")
    source = None
    if weights is not None:
        _fit(model, _read_weights(weights), f"--weights: {weights!r}")
        source = weights
    elif bundle.weights_stored and not bundle.meta["weights"].get("note"):  # a note: one rank's shards
        _fit(model, bundle.load_weights(), f"--model: the bundle's {WEIGHTS_FILE}")
        source = f"the bundle ({WEIGHTS_FILE})"
    fn = None
    if fn_spec is not None:
        fn = call(resolve(fn_spec, "--fn", "pkg.module:function"), "--fn", fn_spec, model)
        if not callable(fn):
            raise ValueError(f"--fn: {fn_spec!r} returned a {type(fn).__name__}, not a function")
    if starting is not None:
        starting()
    try:
        return ReplayResult(bundle, replay(bundle, model, fn), source)
    except NanguardError:
        raise
    except Exception as err:
        if fn is not None:
            raise ValueError(f"--fn: the step {fn_spec!r} made raised {_first_line(err)}") from None
        raise ValueError(
            f"--fn: the default step ({_default_call(bundle.batch)}, then backward of the loss) does not fit "
            f"{model_spec!r}: {_first_line(err)}; pass --fn PKG.MODULE:FUNCTION, where FUNCTION(model) returns "
            "step(batch): the forward and backward of one step, returning the loss"
        ) from None


def version_note(bundle: Bundle) -> str | None:
    """A line when the bundle was captured under another torch: kernels, and so values, may differ."""
    recorded = bundle.meta.get("torch")
    if not isinstance(recorded, str) or recorded == torch.__version__:
        return None
    return (
        f"note: this bundle was captured under torch {recorded} and is replayed under torch {torch.__version__}: "
        "kernels and their rounding may differ, so a fault may not reproduce"
    )


def _default_call(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return f"model(**batch) with keys {', '.join(map(str, batch))}"
    if isinstance(batch, (list, tuple)):
        return f"model(*batch) with {len(batch)} positional argument(s)"
    return "model(batch)"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _read_weights(weights: str) -> Mapping[str, Any]:
    path = Path(weights)
    if not path.is_file():
        raise ValueError(f"--weights: no such file {weights!r}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--weights: cannot load {weights!r}: {first_line}") from None
    if isinstance(state, Mapping):
        for key in ("state_dict", "model_state_dict", "model"):
            if isinstance(state.get(key), Mapping):
                state = state[key]
                break
    if not isinstance(state, Mapping):
        raise ValueError(f"--weights: {weights!r} holds a {type(state).__name__}, not a state dict")
    return state


def _fit(model: torch.nn.Module, state: Mapping[str, Any], what: str) -> None:
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        detail = " ".join(str(err).split())  # one line, however many keys torch lists
        if len(detail) > 300:
            detail = detail[:300] + "..."
        raise ValueError(f"{what} does not fit the model: {detail}") from None
