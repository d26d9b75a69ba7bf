"""``nanguard doctor``: check the environment a NaN hunt depends on.

Versions (torch, CUDA, cuDNN, NCCL, GPUs), debug switches left on that cost speed, and
the debug variables worth setting when a NaN shows up only in distributed runs.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TextIO

import torch

from nanguard import environ

__all__ = ["DISTRIBUTED_DEBUG_LEVELS", "MIN_TORCH", "NCCL_NAN_CHECK_SINCE", "STATUSES", "DoctorItem", "collect", "run"]

STATUSES = ("ok", "warning", "error")
MIN_TORCH = (2, 4)  # the oldest torch nanguard supports (pyproject's torch>=2.4)
NCCL_NAN_CHECK_SINCE = (2, 5)  # TORCH_NCCL_NAN_CHECK first shipped in torch 2.5

DISTRIBUTED_DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")  # what torch accepts, in any case
# (variable, advice) for debug variables worth setting when hunting a distributed NaN.
DEBUG_VARIABLES: tuple[tuple[str, str], ...] = (
    (
        "TORCH_DISTRIBUTED_DEBUG",
        "Set DETAIL while hunting a distributed NaN: checks that ranks call matching "
        "collectives and reports unused parameters; leave unset in production (slower).",
    ),
    (
        "NCCL_DEBUG",
        "Set WARN (or INFO for topology) to see NCCL errors behind hangs or garbage all-reduce results.",
    ),
    (
        "TORCH_SHOW_CPP_STACKTRACES",
        "Set 1 to get C++ stack traces from errors raised inside torch.",
    ),
)


@dataclass
class DoctorItem:
    """One environment check: what was found, whether it is fine, what to do.

    Example:
        >>> DoctorItem("torch", "ok", "2.5.1", "").to_dict()["status"]
        'ok'
    """

    name: str
    status: str
    value: str
    advice: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def collect() -> list[DoctorItem]:
    """Run every check and return its items; never raises for a failing probe.

    Example:
        >>> [item.name for item in collect()][:2]
        ['python', 'torch']
    """
    items: list[DoctorItem] = []
    for name, probe in _PROBES:
        try:
            result = probe()
        except Exception as exc:  # a broken driver must not take the doctor down with it
            result = DoctorItem(name, "warning", f"could not check: {exc}", "")
        items.extend(result if isinstance(result, list) else [result])
    return items


def run(as_json: bool = False, file: TextIO | None = None) -> int:
    """Print the checks as a table (or JSON) to ``file``; return 1 if any is an error.

    Example:
        >>> exit_code = run(as_json=True)
        {"items": [...], "summary": {"ok": 14, "warning": 1, "error": 0}}
    """
    out = sys.stdout if file is None else file
    items = collect()
    summary = {status: sum(item.status == status for item in items) for status in STATUSES}
    if as_json:
        json.dump({"items": [i.to_dict() for i in items], "summary": summary}, out, indent=2)
        out.write("\n")
    else:
        _print_table(items, summary, out)
    return 1 if summary["error"] else 0


def _print_table(items: list[DoctorItem], summary: dict[str, int], out: TextIO) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    styles = {"ok": "green", "warning": "yellow", "error": "bold red"}
    table = Table(title="nanguard doctor", show_lines=False)
    for column in ("check", "status", "value", "advice"):
        table.add_column(column, overflow="fold")
    for item in items:
        table.add_row(
            Text(item.name),
            Text(item.status, style=styles[item.status]),
            Text(item.value),
            Text(item.advice),
        )
    console = Console(file=out, width=None if out.isatty() else 140)
    console.print(table)
    console.print(Text(", ".join(f"{n} {status}" for status, n in summary.items())))


# --------------------------------------------------------------------------- probes


def _version(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", str(text))
    return (int(match[1]), int(match[2])) if match else (0, 0)


def _torch_version() -> tuple[int, int]:
    return _version(torch.__version__)


def _check_python() -> DoctorItem:
    return DoctorItem("python", "ok", platform.python_version(), "")


def _check_torch() -> DoctorItem:
    version = str(torch.__version__)
    if _torch_version() < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        return DoctorItem("torch", "error", version, f"nanguard needs torch >= {need}; upgrade torch.")
    return _newer_than_tested(version) or DoctorItem("torch", "ok", version, "")


def _newer_than_tested(version: str) -> DoctorItem | None:
    """A torch newer than the one ``nanguard.compat``'s private internals were checked against."""
    from nanguard.compat import TESTED_TORCH

    if _version(version) <= _version(TESTED_TORCH):
        return None
    return DoctorItem(
        "torch",
        "warning",
        version,
        f"newer than torch {TESTED_TORCH}, the newest nanguard.compat was tested with: the private internals it "
        "uses may have changed; run tests/test_compat.py, and report a failure of a compat check.",
    )


def _check_cuda() -> DoctorItem:
    built = torch.version.cuda or getattr(torch.version, "hip", None)
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return DoctorItem("cuda", "ok", f"available ({built}, {n} device(s))", "")
    if built:
        return DoctorItem(
            "cuda",
            "warning",
            f"built for {built}, but no GPU is visible",
            "Check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES.",
        )
    return DoctorItem("cuda", "ok", "not available (CPU-only build)", "CPU runs work; GPUs need a CUDA build.")


def _check_cudnn() -> DoctorItem:
    if not torch.backends.cudnn.is_available():
        return DoctorItem("cudnn", "ok", "not available", "")
    return DoctorItem("cudnn", "ok", str(torch.backends.cudnn.version()), "")


def _check_nccl() -> DoctorItem:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_nccl_available()):
        return DoctorItem("nccl", "ok", "not available", "Multi-GPU runs need NCCL (or gloo).")
    version = torch.cuda.nccl.version()
    text = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return DoctorItem("nccl", "ok", text, "")


def _check_gpus() -> DoctorItem:
    if not torch.cuda.is_available():
        return DoctorItem("gpus", "ok", "none", "")
    names = []
    old = False
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        old |= major < 8
        names.append(f"{torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    advice = "GPUs before sm_80 lack fast bfloat16: use float16 with a GradScaler." if old else ""
    return DoctorItem("gpus", "ok", ", ".join(names), advice)


def _check_anomaly() -> DoctorItem:
    if torch.is_anomaly_enabled():
        return DoctorItem(
            "anomaly_mode",
            "warning",
            "enabled",
            "Anomaly mode slows every backward 1.15-3x; turn it off "
            "(torch.autograd.set_detect_anomaly(False)) and let nanguard locate on demand.",
        )
    return DoctorItem("anomaly_mode", "ok", "disabled", "")


def _check_launch_blocking() -> DoctorItem:
    value = os.environ.get("CUDA_LAUNCH_BLOCKING")
    if value == "1":
        return DoctorItem(
            "CUDA_LAUNCH_BLOCKING",
            "warning",
            "1",
            "Serializes every kernel launch (much slower); unset it outside debugging.",
        )
    return DoctorItem("CUDA_LAUNCH_BLOCKING", "ok", value or "unset", "")


def _check_determinism() -> DoctorItem:
    algorithms = torch.are_deterministic_algorithms_enabled()
    cudnn = bool(torch.backends.cudnn.deterministic)
    value = f"use_deterministic_algorithms={algorithms}, cudnn.deterministic={cudnn}"
    if algorithms or cudnn:
        return DoctorItem(
            "deterministic_algorithms",
            "warning",
            value,
            "Deterministic kernels cost speed; keep them for reproducing a NaN, not for production runs.",
        )
    return DoctorItem("deterministic_algorithms", "ok", value, "")


def _check_debug_variables() -> list[DoctorItem]:
    items = [DoctorItem(name, "ok", os.environ.get(name, "unset"), advice) for name, advice in DEBUG_VARIABLES]
    value = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    if value is not None and value.upper() not in DISTRIBUTED_DEBUG_LEVELS:
        items[0] = DoctorItem(
            "TORCH_DISTRIBUTED_DEBUG",
            "error",
            repr(value),
            f"Set it to one of {', '.join(DISTRIBUTED_DEBUG_LEVELS)} or unset it: "
            "with any other value `import torch` fails with a ValueError.",
        )
    return items


def _check_nanguard_variables() -> list[DoctorItem]:
    items = []
    for name, meaning in environ.VARIABLES:
        value = os.environ.get(name)
        bad = name == "NANGUARD_POLICY" and value is not None and bool(value) and value.strip() not in environ.POLICIES
        advice = f"must be one of {environ.POLICIES}: every Guard will refuse to start" if bad else meaning
        items.append(DoctorItem(name, "error" if bad else "ok", value if value is not None else "unset", advice))
    return items


def _check_nccl_nan_check() -> DoctorItem:
    value = os.environ.get("TORCH_NCCL_NAN_CHECK")
    need = ".".join(map(str, NCCL_NAN_CHECK_SINCE))
    advice = (
        "Set TORCH_NCCL_NAN_CHECK=1 while hunting a distributed NaN: NCCL collectives then "
        "fail on the rank that sends a NaN."
    )
    if _torch_version() < NCCL_NAN_CHECK_SINCE:
        if value:
            return DoctorItem(
                "TORCH_NCCL_NAN_CHECK",
                "warning",
                f"{value} (ignored: needs torch >= {need})",
                f"Upgrade torch to >= {need} for the check, or unset it.",
            )
        return DoctorItem("TORCH_NCCL_NAN_CHECK", "ok", f"not available (torch < {need})", "")
    dist = torch.distributed
    nccl = dist.is_available() and dist.is_nccl_available()
    where = f"supported by torch {torch.__version__}" + ("" if nccl else " (no NCCL in this build)")
    return DoctorItem("TORCH_NCCL_NAN_CHECK", "ok", f"{value or 'unset'}; {where}", "" if value else advice)


def _check_tf32() -> list[DoctorItem]:
    matmul = torch.backends.cuda.matmul.allow_tf32
    cudnn = torch.backends.cudnn.allow_tf32
    precision = torch.get_float32_matmul_precision()
    advice = (
        "TF32 keeps float32's range (no extra overflow) but rounds matmul inputs to 10 "
        "mantissa bits; set 'highest' when comparing against a float32 reference."
    )
    return [
        DoctorItem("tf32", "ok", f"matmul.allow_tf32={matmul}, cudnn.allow_tf32={cudnn}", ""),
        DoctorItem("float32_matmul_precision", "ok", precision, advice if precision != "highest" else ""),
    ]


_PROBES: tuple[tuple[str, Callable[[], DoctorItem | list[DoctorItem]]], ...] = (
    ("python", _check_python),
    ("torch", _check_torch),
    ("cuda", _check_cuda),
    ("cudnn", _check_cudnn),
    ("nccl", _check_nccl),
    ("gpus", _check_gpus),
    ("anomaly_mode", _check_anomaly),
    ("CUDA_LAUNCH_BLOCKING", _check_launch_blocking),
    ("deterministic_algorithms", _check_determinism),
    ("debug_variables", _check_debug_variables),
    ("TORCH_NCCL_NAN_CHECK", _check_nccl_nan_check),
    ("tf32", _check_tf32),
    ("nanguard_variables", _check_nanguard_variables),
)
