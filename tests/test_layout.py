"""The package's shape: every module imports on its own (no import cycle), and classes stay small."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
MAX_CLASS_LINES = 350
# Optional dependencies: a module that needs one is left out when it is not installed.
OPTIONAL = {"nanguard.integrations.lightning": "lightning", "nanguard.integrations.hf": "transformers"}
# Each module is imported first, with no other nanguard module loaded: a module in an import
# cycle then meets a half-initialized partner ("partially initialized module"). torch and the
# other dependencies stay loaded between modules, so one fresh interpreter serves them all.
_PROBE = """
import importlib, importlib.util, json, sys, traceback
failures = {}
for name, extra in json.loads(sys.argv[1]):
    if extra and importlib.util.find_spec(extra) is None:
        continue
    for loaded in [m for m in sys.modules if m == "nanguard" or m.startswith("nanguard.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failures[name] = traceback.format_exc(limit=-3)
print(json.dumps(failures))
"""


def _modules() -> list[str]:
    names = []
    for path in sorted((SRC / "nanguard").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__main__":  # importing it runs the command
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_module_imports_first_and_alone() -> None:
    names = _modules()
    assert "nanguard.text" in names and "nanguard.zoo.spawn" in names and "nanguard.cli.replay" in names
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    todo = json.dumps([(name, OPTIONAL.get(name)) for name in names])
    proc = subprocess.run([sys.executable, "-c", _PROBE, todo], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert failures == {}, "\n".join(f"{name}:\n{tb}" for name, tb in failures.items())


def test_a_cycle_would_be_caught(tmp_path: Path) -> None:
    pkg = tmp_path / "cyclic"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclic.b import B\nA = 1\n")
    (pkg / "b.py").write_text("from cyclic.a import A\nB = 2\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    probe = _PROBE.replace('"nanguard"', '"cyclic"').replace('"nanguard."', '"cyclic."')
    todo = json.dumps([("cyclic.a", None)])
    proc = subprocess.run([sys.executable, "-c", probe, todo], capture_output=True, text=True, env=env, timeout=60)
    assert "partially initialized" in json.loads(proc.stdout.strip().splitlines()[-1])["cyclic.a"]


def test_text_imports_nothing_from_nanguard_at_run_time() -> None:
    # findings imports text for str(diag); text importing any nanguard module back would close a cycle.
    tree = ast.parse((SRC / "nanguard" / "text.py").read_text(encoding="utf-8"))
    runtime = [
        alias.name if isinstance(node, ast.Import) else node.module
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert runtime and not [name for name in runtime if name and name.startswith("nanguard")], runtime


def _long_classes() -> list[str]:
    long = []
    for path in sorted((SRC / "nanguard").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.name} ({lines} lines)")
    return long


def test_no_class_is_longer_than_the_limit() -> None:
    assert _long_classes() == []
