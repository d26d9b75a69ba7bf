"""Corruption that stays finite: a loss or grad-norm spike that one rank's device made.

Most silent corruption is a wrong finite value, not a NaN. When the spike detectors flag a finite
step under data parallelism (``guard/history.py``), and only then, every rank re-computes its own step
with gradient communication off and the ranks gather their local loss and gradient norm (one
all-gather). When one rank stands apart (``outlier``), a peer re-computes that rank's batch, as for a
non-finite trip (``guard/proof.py``):

- the peer's values differ from the suspect's beyond the tolerance a re-computation allows
  (``proof.RTOL`` by dtype: 1e-3 in float32; on the CPU the two are bitwise alike in practice, the
  tolerance is for GPUs' reductions in another order): the suspect's device computes that batch
  differently, ``hardware.faulty_device`` although nothing was NaN (``kind="invalid"``);
- alike: the batch itself makes the value (a genuine data outlier), and the spike stays a spike.

Every rank gets the same verdict. A healthy step pays nothing; a spike pays one forward-backward on
every rank and two more on the suspect and its peer, and leaves the gradients, buffers and RNG state
of the step as they were, so the update that follows a spike is the one it would have been.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from nanguard.diagnose import faulty_device
from nanguard.findings import Diagnosis
from nanguard.guard.proof import difference, exchange, peer_of, provable, recompute, rtol_of, run_alone
from nanguard.rng import get_rng_state, set_rng_state

__all__ = ["FACTOR", "outlier", "prove_spike"]

FACTOR = 10.0
"""How far one rank's local value must stand from the other ranks' to be proven: beyond ``FACTOR - 1``
times their level (their median) and their spread. An order of magnitude, as the divergence rules'
``divergence_factor``: ranks' local losses on different batches differ by tens of percent, a rank that
makes a loss spike alone differs by multiples."""


def outlier(values: Sequence[float], factor: float = FACTOR) -> int | None:
    """The one rank whose value stands apart from the others' (beyond ``factor - 1`` times the larger of
    their median's size and their spread), or None when no rank does, or several do (a spike every rank
    shares is the run's, not a rank's).

    Example:
        >>> outlier([0.9, 1.1, 2.4e4])
        2
        >>> outlier([0.9, 1.1, 1.3]) is None
        True
    """
    if len(values) < 2 or not all(math.isfinite(v) for v in values):
        return None
    apart = []
    for r, v in enumerate(values):
        others = [*values[:r], *values[r + 1 :]]
        level, spread = statistics.median(others), max(others) - min(others)
        if abs(v - level) > (factor - 1.0) * max(abs(level), spread, 1e-30):
            apart.append(r)
    return apart[0] if len(apart) == 1 else None


def prove_spike(
    model: nn.Module,
    closure: Callable[[], Any],
    *,
    step: int,
    metric: str,
    batch: Any,
    rng: Mapping[str, torch.Tensor] | None,
) -> tuple[Diagnosis | None, dict[str, Any]]:
    """On a spike (every rank calls it, with the agreed ``metric`` that spiked): ``hardware.faulty_device``
    when one rank's local value stands apart and a peer computes that rank's batch differently, else None
    (no rank stands apart, a peer reproduces it, or the proof cannot run); with what was found (``verdict``:
    "device", "reproduced", "no_outlier" or "unproven", and why). The step's gradients, buffers and RNG
    state are left as they were."""
    if (why_not := provable(model)) is not None or rng is None:
        return None, {"verdict": "unproven", "why": why_not or "the step's RNG state was not captured"}
    with _kept(model):
        own = run_alone(model, closure, rng)
        local = [r or {} for r in _gather(own)]
        values = [{k: c.get(k) for k in ("loss", "grad_norm")} for c in local]
        suspect = _suspect(local, metric)
        if suspect is None:
            return None, {"verdict": "no_outlier", "local": values, "why": "no rank's local value stands apart"}
        peer = peer_of(suspect, [suspect])
        results, unproven = recompute(model, closure, batch, rng, suspect, peer, own_loss=local[suspect]["loss"])
    found: dict[str, Any] = {"suspect": suspect, "peer": peer, "metric": metric, "local": values}
    if unproven is not None:
        return None, {**found, "verdict": "unproven", "why": unproven}
    return _judged(model, results[suspect], results[peer], found, step)


def _judged(
    model: nn.Module, s: dict[str, Any], p: dict[str, Any], found: dict[str, Any], step: int
) -> tuple[Diagnosis | None, dict[str, Any]]:
    """The suspect's (``s``) and its peer's (``p``) re-computations of the suspect's batch compared:
    ``hardware.faulty_device`` when they differ beyond the tolerance, else None; with what was found."""
    suspect, peer, metric, values = found["suspect"], found["peer"], found["metric"], found["local"]
    if s.get("error") or p.get("error") or not (s["finite"] and p["finite"]):
        why = "a re-computation failed or went non-finite (a non-finite step is the NaN proof's, on its own trip)"
        return None, {**found, "verdict": "unproven", "why": why}
    rtol = rtol_of(model)
    diff = difference(s, p)
    if diff <= rtol:
        why = (
            f"a peer computes rank {suspect}'s batch alike (within {rtol:g}): the batch makes the value, not the device"
        )
        return None, {**found, "verdict": "reproduced", "difference": diff, "why": why}
    proof = {
        "suspect": suspect,
        "peer": peer,
        "verdict": "device",
        "why": f"rank {suspect}'s {metric} stands apart from the other ranks' (a spike); a peer computes its batch "
        f"with values that differ by {diff:.3g} (> {rtol:g}): its device computes differently",
        "metric": metric,
        "local": values,
        "difference": diff,
        "suspect_where": s.pop("where"),
        "peer_where": p.pop("where"),
        "suspect_result": _words(s),
        "peer_result": _words(p),
        "computations": {"original": {"loss": s.pop("own_loss")}, "suspect": _brief(s), "peer": _brief(p)},
    }
    loss_apart = abs(s["loss"] - p["loss"]) > rtol * max(abs(s["loss"]), abs(p["loss"]), 1e-30)
    origin = Diagnosis(
        cause="unknown",
        kind="invalid",
        phase="forward" if loss_apart else "backward",  # the loss is right where only the backward's matmuls err
        rank=suspect,
        ranks=[suspect],
        step=step,
        evidence={"why": f"a finite {metric} spike made on rank {suspect} only"},
    )
    return replace(faulty_device(step=step, origin=origin, proof=proof), kind="invalid"), proof


def _suspect(local: list[dict[str, Any]], metric: str) -> int | None:
    """The rank whose local value of the spiking metric (else of the other) stands apart."""
    order = ["loss", "grad_norm"] if metric == "loss" else ["grad_norm", "loss"]
    for key in order:
        values = [c.get(key) for c in local]
        if not all(isinstance(v, float) for v in values):
            continue
        if (r := outlier([float(v) for v in values if v is not None])) is not None:
            return r
    return None


def _gather(own: dict[str, Any]) -> list[dict[str, Any] | None]:
    norms = own.get("grad_norms")
    mine = {"loss": own.get("loss"), "grad_norm": math.sqrt(sum(n * n for n in norms)) if norms else None}
    return exchange(mine if not own.get("error") else None)


@contextlib.contextmanager
def _kept(model: nn.Module) -> Iterator[None]:
    """The step's gradients, buffers and RNG state as they were when opened, put back when closed: the
    update after a spike is the one it would have been."""
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = list(model.buffers())
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    values = [b.detach().clone() for b in buffers]
    rng = get_rng_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            for b, v in zip(buffers, values, strict=True):
                b.copy_(v)
        set_rng_state(rng)


def _brief(c: Mapping[str, Any]) -> dict[str, Any]:
    norms = c["grad_norms"]
    return {"loss": c["loss"], "grad_norm": math.sqrt(sum(n * n for n in norms)), "finite": c["finite"]}


def _words(c: Mapping[str, Any]) -> str:
    return f"finite but different (loss {c['loss']:.4g}, grad norm {_brief(c)['grad_norm']:.4g})"
