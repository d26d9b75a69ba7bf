"""``Guard``: check every step for NaN/Inf at near-zero cost, diagnose a trip, recover.

Per step the guard reduces the loss and all gradients to one small device tensor (total
grad norm, loss, loss scale, and the previous update's parameter flag) with foreach
kernels, and reads it back once. Under torch.distributed the same tensor carries one flag
per rank through a single all-reduce, so every rank takes the same decision.

Which path steps the optimizer:

- **host path** (default): the guard reads the health tensor, then calls
  ``optimizer.step()`` only for a finite step.
- **device path**: with a fused optimizer (``fused=True`` Adam/AdamW/SGD, the ones that
  accept GradScaler's ``found_inf``), the guard hands the flag to the optimizer, which
  skips the update on the device; the host read then overlaps with the update.

A parameter check after the update is folded into the next step's read, so it adds no
host sync; it finds finite gradients turned into non-finite parameters
(``optimizer.nonfinite_update``).

``Guard.step`` (``core``) reads attempt -> measure (``Verdict``) -> decide (``Policy.decide(verdict,
state)`` -> ``Action``) -> apply (and record), over parts that each own their state:

- ``policy``: ``Policy``, every decision (skip, rollback, raise, the remedy, the budgets),
  read from the cause table (``nanguard.causes``);
- ``config``: ``GuardConfig``, every option, validated;
- ``health``: the device-side measurement, the flags (``HealthFlag``) and the one host
  read (``StepHealth``);
- ``recovery``: buffer backup, snapshots, rollback, and the skip/overflow counters;
- ``history``: recent loss and grad norm, spike detectors, divergence evidence;
- ``diagnoser``: a tripped step replayed under the tracer and diagnosed (``Diagnoser``);
- ``remedies``: carries out and records the remedies the policy chose;
- ``recorder``: event log and repro bundles (``NullRecorder`` without a ``run_dir``).

The diagnoses it builds from its own state are pure functions in ``nanguard.diagnose``.
"""

from nanguard.guard.config import POLICIES, GuardConfig
from nanguard.guard.core import Guard

__all__ = ["POLICIES", "Guard", "GuardConfig"]
