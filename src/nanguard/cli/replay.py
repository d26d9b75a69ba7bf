"""``nanguard replay``: build the user's model from ``pkg.module:factory``, load weights, replay a bundle.

Only the code the ``--model`` and ``--fn`` specs name runs; weights load as safetensors or
with ``torch.load(weights_only=True)``. Wrong options raise ValueError naming the option.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from nanguard.bundle import WEIGHTS_FILE, Bundle, load_bundle, replay
from nanguard.errors import NanguardError
from nanguard.findings import Diagnosis

__all__ = ["Replayed", "main_replay", "version_note"]


class Replayed(NamedTuple):
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
) -> Replayed:
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
    _parse_spec(model_spec, "--model", "pkg.module:factory")
    if fn_spec is not None:
        _parse_spec(fn_spec, "--fn", "pkg.module:function")
    bundle = load_bundle(bundle_path)

    factory = _resolve(model_spec, "--model", "pkg.module:factory")
    model = _call(factory, "--model", model_spec)
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
        fn = _call(_resolve(fn_spec, "--fn", "pkg.module:function"), "--fn", fn_spec, model)
        if not callable(fn):
            raise ValueError(f"--fn: {fn_spec!r} returned a {type(fn).__name__}, not a function")
    if starting is not None:
        starting()
    try:
        return Replayed(bundle, replay(bundle, model, fn), source)
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


def _call(obj: Callable[..., Any], option: str, spec: str, *args: Any) -> Any:
    """Call what a spec names; whatever it raises becomes one line naming the option (``os:system``
    needs an argument, a factory may fail), not a traceback."""
    needed = _required_after(obj, len(args))
    if needed:
        given = "none" if not args else "only the model"
        raise ValueError(
            f"{option}: {spec!r} needs argument(s) {', '.join(needed)} but is called with {given}: "
            "name a function that builds it without them"
        )
    try:
        return obj(*args)
    except Exception as err:
        raise ValueError(f"{option}: calling {spec!r} failed: {type(err).__name__}: {err}") from None


def _required_after(obj: Callable[..., Any], given: int) -> list[str]:
    """The names of the parameters ``obj`` requires beyond the first ``given`` positional ones."""
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some builtins): calling it tells
        return []
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = [p for p in required if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [p.name for p in positional[given:]] + [p.name for p in required if p.kind is p.KEYWORD_ONLY]


def _parse_spec(spec: str, option: str, example: str) -> tuple[str, str]:
    module, sep, attr = spec.partition(":")
    names = [*module.split("."), *attr.split(".")]
    if not sep or not all(name.isidentifier() for name in names):
        hint = ""
        if "/" in module or "\\" in module or module.endswith(".py"):
            hint = " (a module's import name, not a file path: run from the folder it imports from)"
        raise ValueError(f"{option} must look like {example!r}, got {spec!r}{hint}")
    return module, attr


def _resolve(spec: str, option: str, example: str) -> Callable[..., Any]:
    module_name, attr = _parse_spec(spec, option, example)
    # The CLI is run from the user's project: let its modules import as under `python -m`.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = _import_quietly(module_name, option)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ValueError(f"{option}: no module named {missing!r} (in {spec!r})") from None
        raise ValueError(f"{option}: importing {module_name!r} failed: {err}") from None
    except Exception as err:  # a syntax error or a failing import in the user's module
        raise ValueError(f"{option}: importing {module_name!r} failed: {type(err).__name__}: {err}") from None
    for name in attr.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise ValueError(f"{option}: {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{option}: {spec!r} is not callable")
    return obj


def _import_quietly(module_name: str, option: str) -> Any:
    """Import the user's module; one that runs its command line on import (argparse at module level) would
    print its usage under our name and exit: that is one line saying what to change, not its exit."""
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = [module_name]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            module = importlib.import_module(module_name)
    except SystemExit as exit_:
        said = [line for line in (err.getvalue() + out.getvalue()).splitlines() if line.strip()]
        why = f" ({said[-1].strip()})" if said else ""
        raise ValueError(
            f"{option}: importing {module_name!r} ran its command line and exited with {exit_.code}{why}: "
            'keep its argument parsing under `if __name__ == "__main__":`, or name a module that only '
            "defines the model"
        ) from None
    finally:
        sys.argv = argv
    sys.stdout.write(out.getvalue())  # what an import that went well printed, in its place
    sys.stderr.write(err.getvalue())
    return module


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
