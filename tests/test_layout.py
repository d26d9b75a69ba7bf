"""The package's shape: every module imports on its own, no import cycle (not even one for type
checking), methods stay short, and no object probes itself for attributes it may lack."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
MAX_METHOD_LINES = 60
# Optional dependencies: a module that needs one is left out when it is not installed.
OPTIONAL = {
    "nanguard.integrations.lightning": "lightning",
    "nanguard.integrations.fabric": "lightning",
    "nanguard.integrations.hf": "transformers",
    "nanguard.integrations.deepspeed": "deepspeed",
}
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


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Each module and the nanguard modules it imports anywhere: at the top, inside functions,
    under ``TYPE_CHECKING`` or through ``__import__``."""
    paths = {_module_name(p): p for p in sorted((SRC / "nanguard").rglob("*.py"))}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets: list[str | None] = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets += [known(f"{node.module}.{alias.name}") for alias in node.names]
            elif isinstance(node, ast.Import):
                targets += [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" and node.args:
                arg = node.args[0]
                literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                targets.append(known(arg.value) if literal else None)
        graph[name] = {t for t in targets if t and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_at_all() -> None:
    graph = _import_graph()
    assert {"nanguard.guard.core", "nanguard.zoo.scenarios"} <= set(graph)
    assert "nanguard.guard.accumulate" in graph["nanguard.guard.core"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def _long_methods() -> list[str]:
    long = []
    for path in sorted((SRC / "nanguard").rglob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_METHOD_LINES:
                        long.append(f"{path.relative_to(SRC)}:{cls.name}.{node.name} ({lines} lines)")
    return long


def test_no_method_is_longer_than_the_limit() -> None:
    # A class may grow as long as its job needs; a method that cannot be read at once is the smell.
    assert _long_methods() == []


def test_no_object_probes_itself_for_attributes_it_may_lack() -> None:
    # getattr(self, "x", default) / hasattr(self, "x"): an attribute that may not exist hid a lost
    # feature once (the remedies' scheduler); every attribute is set in __init__.
    found = []
    for path in sorted((SRC / "nanguard").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
                continue
            probe = (node.func.id == "getattr" and len(node.args) == 3) or node.func.id == "hasattr"
            if probe and isinstance(node.args[0], ast.Name) and node.args[0].id == "self":
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found == []
