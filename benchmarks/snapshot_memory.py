"""Peak host memory of a rollback snapshot refresh, as a multiple of one snapshot's size.

A refresh that builds the new snapshot beside the old one peaks at 2x (model + optimizer);
one that copies into the previous snapshot's tensors stays near 0x extra. Linux only: it
resets the peak RSS through /proc/self/clear_refs and reads VmHWM.

It also measures what the kept snapshots cost at rest (``GuardConfig.snapshots``, at doubling
ages): the resident memory after as many refreshes as fill every slot, over one snapshot's size.

Run: ``.venv/bin/python benchmarks/snapshot_memory.py [--params-millions N] [--snapshots K]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from nanguard.guard.config import GuardConfig
from nanguard.guard.recovery import Recovery


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params-millions", type=int, default=16)
    parser.add_argument("--snapshots", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    width = 1024
    layers = max(1, args.params_millions * 2**20 // (width * width))
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()  # Adam's two moments exist from here on
    rest = _kib("VmRSS")
    config = GuardConfig(policy="rollback", snapshots=args.snapshots)
    recovery = Recovery(model, optimizer, scaler=None, config=config)
    recovery.take_snapshot(0)
    snapshot_mib = sum(p.numel() * p.element_size() for p in model.parameters()) * 3 / 2**20
    for step in range(1, 4 * args.snapshots):  # every slot filled
        recovery.take_snapshot(step)
    kept = len(recovery.snapshots)
    held_mib = (_kib("VmRSS") - rest) / 1024
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _kib("VmRSS")
    recovery.take_snapshot(4 * args.snapshots)
    extra_mib = (_kib("VmHWM") - before) / 1024
    print(f"snapshot (weights + Adam moments): {snapshot_mib:.0f} MiB")
    print(
        f"{kept} snapshot(s) kept (steps {[s['step'] for s in recovery.snapshots]}): {held_mib:.0f} MiB resident "
        f"= {held_mib / snapshot_mib:.2f}x a snapshot"
    )
    print(f"refresh peak above the resting RSS: {extra_mib:.0f} MiB = {extra_mib / snapshot_mib:.2f}x a snapshot")


if __name__ == "__main__":
    main()
