"""Code a user names on the command line (or to ``ng.bisect``) as ``"pkg.module:function"``:
imported as under ``python -m`` from the current folder, and called, every failure one line that
names the option, never a traceback. ``nanguard replay`` and ``nanguard bisect`` both use it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["call", "import_quietly", "parse_spec", "required_after", "resolve"]


def call(obj: Callable[..., Any], option: str, spec: str, *args: Any) -> Any:
    """Call what a spec names; whatever it raises becomes one line naming the option (``os:system``
    needs an argument, a factory may fail), not a traceback."""
    needed = required_after(obj, len(args))
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


def required_after(obj: Callable[..., Any], given: int) -> list[str]:
    """The names of the parameters ``obj`` requires beyond the first ``given`` positional ones."""
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some builtins): calling it tells
        return []
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = [p for p in required if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [p.name for p in positional[given:]] + [p.name for p in required if p.kind is p.KEYWORD_ONLY]


def parse_spec(spec: str, option: str, example: str) -> tuple[str, str]:
    module, sep, attr = spec.partition(":")
    names = [*module.split("."), *attr.split(".")]
    if not sep or not all(name.isidentifier() for name in names):
        hint = ""
        if "/" in module or "\\" in module or module.endswith(".py"):
            hint = " (a module's import name, not a file path: run from the folder it imports from)"
        raise ValueError(f"{option} must look like {example!r}, got {spec!r}{hint}")
    return module, attr


def resolve(spec: str, option: str, example: str) -> Callable[..., Any]:
    module_name, attr = parse_spec(spec, option, example)
    # The CLI is run from the user's project: let its modules import as under `python -m`.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = import_quietly(module_name, option)
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


def import_quietly(module_name: str, option: str) -> Any:
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
