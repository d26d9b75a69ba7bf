"""W&B: the guard's values on an axis of their own (``define_metric``), so a loop that logs with its own step
axis loses none of them. Run against a real offline W&B run, whose records are read back from its file."""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import nanguard as ng
from nanguard.integrations.scalars import to_wandb

BATCH = 8  # the loop's own step axis: samples seen


def _records(path: Path) -> list[bytes]:
    """The records of a W&B run file: a 7-byte file header, then 32 KiB blocks of chunks, each with a
    7-byte header (checksum, length, type: 1 whole, 2 first, 3 middle, 4 last)."""
    data, pos, records, pending = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        pending = chunk if kind in (0, 1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def _history(run_dir: Path) -> list[dict[str, str]]:
    """The run's history rows, once its file holds the run's exit record: W&B's service may still be
    writing the file when ``run.finish()`` returns."""
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + 120
    while True:
        rows, ended = [], False
        for path in run_dir.glob("wandb/offline-run-*/run-*.wandb"):
            for data in _records(path):
                record = pb.Record()
                try:
                    record.ParseFromString(data)
                except Exception:  # a record still being written: read the file again
                    continue
                kind = record.WhichOneof("record_type")
                ended = ended or kind == "exit"
                if kind == "history":
                    rows.append(
                        {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                    )
        if ended or time.monotonic() > deadline:
            assert ended, "the W&B run file never got its exit record"
            return rows
        time.sleep(0.2)


def _train(on_event: Any, log: Any, steps: int = 6, bad: int = 3) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, optimizer, on_event=on_event)
    x, y = torch.randn(BATCH, 4), torch.randn(BATCH, 1)
    for step in range(steps):
        xb = x.clone()
        if step == bad:
            xb[0, 0] = float("nan")

        def closure(xb: torch.Tensor = xb) -> torch.Tensor:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), y)
            loss.backward()
            return loss

        loss = guard.step(closure)
        log({"train/loss": float(loss.detach()) if loss is not None else None}, step=(step + 1) * BATCH)
    guard.close()


def test_a_loop_with_its_own_step_axis_loses_no_trip_on_a_real_wandb_run(tmp_path, monkeypatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run = wandb.init(project="nanguard-test", dir=str(tmp_path), mode="offline")
    try:
        _train(to_wandb(run), run.log)
    finally:
        run.finish()
    rows = _history(tmp_path)
    guard_rows = [r for r in rows if "nanguard/step" in r]
    # Every guard step reached the run, on the guard's axis, beside the loop's own samples-seen axis.
    assert sorted({int(r["nanguard/step"]) for r in guard_rows}) == list(range(6))
    trips = {int(r["nanguard/step"]): float(r["nanguard/trips"]) for r in guard_rows if "nanguard/trips" in r}
    assert trips == {0: 0.0, 1: 0.0, 2: 0.0, 3: 1.0, 4: 1.0, 5: 1.0}
    assert [r["nanguard/cause"] for r in guard_rows if "nanguard/cause" in r] == ['"data.nonfinite"']
    assert [int(r["_step"]) for r in rows if "train/loss" in r] == [(s + 1) * BATCH for s in range(6)]


class FakeRun:
    """A W&B run as its API is documented: ``define_metric``, and ``log`` refusing a step below the current."""

    def __init__(self) -> None:
        self.metrics: dict[str, dict[str, Any]] = {}
        self.rows: list[tuple[int, dict[str, Any]]] = []
        self.refused: list[dict[str, Any]] = []
        self.step = 0

    def define_metric(self, name: str, step_metric: str | None = None, hidden: bool = False) -> None:
        self.metrics[name] = {"step_metric": step_metric, "hidden": hidden}

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        if step is not None and step < self.step:
            self.refused.append(values)
            return
        self.step = self.step if step is None else step
        self.rows.append((self.step, values))


def test_to_wandb_declares_its_axis_and_never_passes_a_step() -> None:
    run = FakeRun()
    _train(to_wandb(run), run.log)
    assert run.metrics["nanguard/*"]["step_metric"] == "nanguard/step" and run.metrics["nanguard/step"]["hidden"]
    assert run.refused == []
    guard_values = [v for _, v in run.rows if "nanguard/step" in v]
    assert {v["nanguard/step"] for v in guard_values} == set(range(6))
    assert [v["nanguard/cause"] for v in guard_values if "nanguard/cause" in v] == ["data.nonfinite"]
