"""The guard's precursor check: every ``precursor_every`` steps, the per-layer precursors of a blow-up
(``nanguard.precursors``) sampled on the device, read without a sync of their own, and warned once
per (layer, signal) with the growth, the steps left and the published fix.

A sampled step is the user's own step, run once: the guard calls ``arm`` when its step count reaches
``next`` (a comparison, no call, on the other steps), which installs the model's hooks for that step
alone and removes them at the next call: its training forward runs under a ``tracer.precursors.Capture``
(attention, router and output logits, each layer's output RMS); the optimizer's step pre- and
post-hooks, on for the run (a ``LoopGuard`` arms the next sample from inside them) and returning at once
between samples, take the update-to-weight ratio of each module from the weights copied before the
update, and Adam's update per unit of LR from the same update (its decoupled weight decay taken out:
what the step did, for any Adam variant), with its second moment's scale from the state. The values are
stacked into one device tensor and copied to the host without waiting (pinned memory and an event on
a GPU); the copy is read at a later optimizer step once its event has completed, which the step's own
health read in between makes sure of: no host sync is added. ``headroom`` events (``headroom_every``)
feed the trend too. A warning carries the module's other signals of its sample as context; Adam's update
never warns alone (``precursors.SIGNALS``).

Under ``policy="auto"`` with ``precursor_lower_lr=True`` (off by default) a warning lowers the LR
by ``lr_factor`` once, as the ``optimizer.divergence`` remedy does, recorded as a ``lower_lr``
remedy; not under torch.distributed, where the ranks' activations differ and one rank's LR
must never move alone.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from nanguard import dist
from nanguard.guard.config import GuardConfig
from nanguard.guard.optim_state import current_lr
from nanguard.guard.progress import Progress
from nanguard.guard.recorder import NullRecorder
from nanguard.guard.remedies import Remedies
from nanguard.precursors import SIGNALS, Precursor, SecondMoment, Trend
from nanguard.stats import local
from nanguard.tracer.compiled import compiled_modules
from nanguard.tracer.headroom import Headroom
from nanguard.tracer.precursors import Capture, Values, layers, owners_of

__all__ = ["PrecursorCheck"]

log = logging.getLogger("nanguard")


_ADAM_STATE = {"exp_avg", "exp_avg_sq", "step"}


class _AdamGroup:
    """One Adam-like param group: its second moments and steps, listed once, each weight's place in the
    check's list and module index, and whether its weight decay is decoupled (AdamW's)."""

    def __init__(self, group: dict[str, Any], params: list[torch.Tensor], state: Any, check: PrecursorCheck) -> None:
        self.group, self.params, self.state = group, params, state
        self.beta2 = float(group["betas"][1])
        self.first = state[params[0]]["exp_avg_sq"]  # the state's own tensor: replaced on a resume
        self.v = [local(state[p]["exp_avg_sq"]) for p in params]
        self.step = [state[p]["step"] for p in params]
        place = {id(p): i for i, p in enumerate(check._params)}
        self.places = [place[id(p)] for p in params]
        self.at = torch.tensor(self.places)
        self.index = torch.tensor([check._order.index(check._module_of.get(id(p), "")) for p in params])
        self.sizes = torch.tensor([float(v.numel()) for v in self.v])
        self._tensors = all(isinstance(s, torch.Tensor) and s.device == self.step[0].device for s in self.step)
        # torch's AdamW (and Adam(decoupled_weight_decay=True)), apex's and DeepSpeed's fused Adam in AdamW mode
        self.decoupled = bool(group.get("decoupled_weight_decay")) or bool(getattr(check.optimizer, "adam_w_mode", 0))
        self.decoupled |= isinstance(check.optimizer, torch.optim.AdamW)

    def steps(self) -> torch.Tensor:
        """Each weight's step count, one float32 vector: torch's Adam keeps them as tensors it increments in place
        (stacked in one call); a count kept as a number is a new object each step, read from the state again."""
        if self._tensors:
            return torch.stack(self.step).float()
        return torch.tensor([float(self.state[p]["step"]) for p in self.params])


class _Queued:
    """One sample on its way to the host: read once its copy completed, never waited for."""

    def __init__(self, step: int, keys: list[tuple[str, str]], packed: torch.Tensor, raw: set[tuple[str, str]]) -> None:
        self.step, self.keys, self.raw = step, keys, raw
        self.event: Any = None
        if packed.device.type == "cuda":
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = packed

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def read(self) -> dict[tuple[str, str], float]:
        return dict(zip(self.keys, self.host.tolist(), strict=True))


class PrecursorCheck:
    """Samples the precursors every ``every`` steps and records the warnings (module docstring).

    Example:
        >>> check = PrecursorCheck(model, optimizer, config, progress, recorder, remedies)
        >>> if progress.step >= check.next:   # the guard, at a step's start and after an update
        ...     check.arm(progress.step)
        >>> check.trend.warned   # (module, signal) pairs warned so far
        set()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: GuardConfig,
        progress: Progress,
        recorder: NullRecorder,
        remedies: Remedies,
        *,
        every: int | None = None,
    ) -> None:
        inner = getattr(optimizer, "optimizer", None)  # a wrapper's (accelerate's) optimizer steps the weights
        optimizer = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
        self.model, self.optimizer, self.config = dist.unwrap(model), optimizer, config
        self.progress, self.recorder, self.remedies = progress, recorder, remedies
        self.every = config.precursor_every if every is None else every
        self.next: float = math.inf
        """The step the guard calls ``arm`` at (a step count, compared without a call; inf: never)."""
        self.trend = Trend()
        self.moments = SecondMoment()
        self._adam: list[_AdamGroup] = []
        self._adam_n: torch.Tensor | None = None  # each module's size over the Adam groups, clamped at 1
        self._indexes: dict[torch.device, torch.Tensor] = {}
        self._beta2: dict[str, float] = {}
        self._measured: tuple[int, Values | None] | None = None  # the sampled step's forward values
        self._before: list[torch.Tensor] | None = None  # the weights before the sampled step's update
        self._pending: list[_Queued] = []
        self._acted = False
        self._handles: list[Any] = []
        self._params: list[torch.Tensor] = []
        self._step_handles: list[Any] = []
        self._module_of: dict[int, str] = {}
        if not self.every or compiled_modules(self.model):  # a compiled model would run eagerly under the mode
            self.every = 0
            return
        try:
            self._setup()
        except Exception as err:
            self._stop(err)

    def _setup(self) -> None:
        names = owners_of(self.model)
        self._capture = Capture(self.model, names, layers(self.model))  # one, kept: its module names cached
        self._params = [p for g in self.optimizer.param_groups for p in g["params"] if p.is_floating_point()]
        modules = [names.get(id(p), "") for p in self._params]
        self._module_of = {id(p): m for p, m in zip(self._params, modules, strict=True)}
        self._order = list(dict.fromkeys(modules))
        self._index = [self._order.index(m) for m in modules]
        self._ratio_keys = [(m, "update_ratio") for m in self._order]  # the packed vector's names, made once
        self._adam_keys = [(m, signal) for signal in ("adam_update", "adam_v") for m in self._order]
        self._sharded = any(local(p) is not p for p in self._params)
        for group in self.optimizer.param_groups:
            betas = group.get("betas")
            if isinstance(betas, (tuple, list)):
                self._beta2.update((names.get(id(p), ""), float(betas[1])) for p in group["params"])
        # On for the run (each returns at once between samples): a LoopGuard arms the next sample from inside the
        # optimizer's post-step hooks, whose dict torch forbids changing while it runs them.
        self._step_handles = [
            self.optimizer.register_step_pre_hook(_weak(self._pre_step)),
            self.optimizer.register_step_post_hook(_weak(self._post_step)),
        ]
        self.next = self.every

    def due(self, step: int) -> bool:
        """Every ``every``-th step from step ``every`` on (step 0's values are the initialization's)."""
        return bool(self.every) and step > 0 and step % self.every == 0

    def arm(self, step: int) -> None:
        """The guard reached ``next``: the last sample's hooks come off and its values are read when
        ready; the hooks go on for ``step`` when it is due, and come off at the next call."""
        self._disarm()
        self._read_ready()
        if not self.due(step):
            # a copy still on its way (a GPU's): called again after the next step, whose health read waits for it
            self.next = step + 1 if self._pending else (step // self.every + 1) * self.every if self.every else math.inf
            return
        self.next = step + 1
        self._measured = None
        try:
            self._handles.append(self.model.register_forward_pre_hook(_weak(self._enter)))
            self._handles.append(self.model.register_forward_hook(_weak(self._leave), always_call=True))
        except (AttributeError, RuntimeError, TypeError) as err:
            self._stop(err)

    def close(self) -> None:
        self._disarm()
        for handle in self._step_handles:
            handle.remove()
        self._step_handles = []
        self.next = math.inf

    def _disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._measured is not None and self._measured[1] is None:  # a forward that raised inside the mode
            self._capture.__exit__(None, None, None)
        self._measured = self._before = None

    # -- the sampled forward -------------------------------------------------------------
    def _enter(self, module: nn.Module, args: Any) -> None:
        if self._measured is not None or not (module.training and torch.is_grad_enabled()):
            return  # one forward a sampled step (the first micro-batch's), a training one
        try:
            self._capture.enter_within(module)
            self._measured = (self.progress.step, None)
        except Exception as err:
            self._stop(err)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        measured, capture = self._measured, self._capture
        if measured is None or measured[1] is not None:
            return
        self._measured = (measured[0], capture.values)  # the mode is left here, whatever happens
        try:
            try:
                capture.model_output(output)
            finally:
                capture.__exit__(None, None, None)
        except Exception as err:
            self._stop(err)

    def _stop(self, err: BaseException) -> None:
        """nanguard's own failure never stops the run: the check says so once and turns off."""
        log.warning("nanguard: the precursor check failed and stops: %r", err)
        self.every = 0
        self._disarm()  # the step hooks stay, inert: this may run inside the optimizer's own hooks
        self.next = math.inf

    # -- the sampled update ----------------------------------------------------------------
    def _weights(self) -> list[torch.Tensor]:
        return [local(p) for p in self._params] if self._sharded else self._params

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._measured is not None and self._measured[1]:
            try:
                with torch.no_grad():
                    self._before = list(torch._foreach_mul(self._weights(), 1.0))
            except Exception as err:
                self._stop(err)

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        measured, before = self._measured, self._before
        if measured is None or not measured[1] or before is None:
            return
        step, values = measured[0], measured[1]
        self._measured = (step, {})  # read once: a second optimizer step adds nothing
        try:
            with torch.no_grad():
                keys, moved = [*values, *self._ratio_keys], self._moved(before)
                if len(moved) > len(self._order):
                    keys += self._adam_keys
                packed = torch.cat([_stacked(list(values.values())).to(moved.device), moved])
            self._pending.append(_Queued(step, keys, packed, self._capture.raw))
            self._read_ready()  # on the CPU the copy is the tensor: read now; on a GPU, once its event completed
        except Exception as err:
            self._stop(err)

    def _moved(self, before: list[torch.Tensor]) -> torch.Tensor:
        """Per module (``self._order``), one device vector: |w_new - w_old| / |w_old|, then with Adam-like groups
        Adam's update per unit of LR and its second moment's scale (``_adam_moments``). ``before``, the weights
        before the update (our copy), becomes the update in place."""
        weights = self._weights()
        size = _stacked(torch._foreach_norm(before))
        torch._foreach_sub_(before, weights)  # w_old - w_new, the update
        moved = _stacked(torch._foreach_norm(before)).to(size.device)
        norms = torch.stack([moved, size]).square()
        sums = norms.new_zeros(2, len(self._order)).index_add_(1, self._index_on(norms.device), norms)
        ratio = (sums[0] / sums[1].clamp_min(1e-30)).sqrt()
        groups = self._adam_groups()
        if not groups:
            return ratio
        return torch.cat([ratio, self._adam_moments(groups, norms, weights)])

    def _index_on(self, device: torch.device) -> torch.Tensor:
        """Each weight's module (``self._order``) as a tensor on ``device``, made once."""
        index = self._indexes.get(device)
        if index is None:
            index = self._indexes[device] = torch.tensor(self._index, device=device)
        return index

    def _adam_groups(self) -> list[_AdamGroup]:
        """The optimizer's Adam-like groups (``betas``, ``eps``, ``exp_avg``/``exp_avg_sq``/``step`` state),
        their state tensors listed once and listed again when the state was replaced (a resume)."""
        state = self.optimizer.state
        cached = self._adam
        if cached and all(state.get(g.params[0], {}).get("exp_avg_sq") is g.first for g in cached):
            return cached
        self._adam_n = None
        self._adam = [
            _AdamGroup(group, params, state, self)
            for group in self.optimizer.param_groups
            if isinstance(group.get("betas"), (tuple, list))
            and group.get("eps") is not None
            and (params := [p for p in group["params"] if state.get(p, {}).keys() >= _ADAM_STATE])
        ]
        return self._adam

    def _adam_moments(self, groups: list[_AdamGroup], norms: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        """Per module (``self._order``): Adam's update per unit of LR, the RMS over the weights that moved of
        what the step did with its weight decay taken out (m_hat / (sqrt(v_hat) + eps), whatever the variant);
        then its second moment's scale (mean v_hat^2)^(1/4), bias-corrected by each weight's own step (the
        steps stay tensors, never read). ``norms``: each weight's |update|^2 and |w_old|^2."""
        device = norms.device
        sums = torch.zeros(3, len(self._order), device=device)  # sum of u^2, of v_hat^2, size of what moved
        for g in groups:
            lr, decay = g.group["lr"], float(g.group.get("weight_decay") or 0.0)  # an LR may be a tensor: not read
            update, size = norms[:, g.at]  # squared norms
            adam = update  # |lr u|^2
            if g.decoupled and decay:
                # w_new = w_old (1 - a) - lr u with a = lr wd and d = w_old - w_new: expanding |lr u|^2 through
                # <d, w_new> = (|w_old|^2 - |w_new|^2 - |d|^2) / 2 leaves one norm to take, of the new weights
                a = lr * decay
                new = _stacked(torch._foreach_norm([weights[i] for i in g.places])).to(device).square()
                adam = ((1 - a) * update + a * (new - (1 - a) * size)).clamp_min(0)
            steps = g.steps().to(device)
            v2 = (_stacked(torch._foreach_norm(g.v)).to(device) / (1 - g.beta2**steps)).square()
            went = update > 0  # a weight the step left alone (no gradient) says nothing of Adam's update
            parts = torch.stack([torch.where(went, adam / lr**2, 0.0), v2, torch.where(went, g.sizes.to(device), 0.0)])
            sums.index_add_(1, g.index.to(device), parts)
        if self._adam_n is None:  # each module's size, summed over the groups once
            n = torch.zeros(len(self._order), device=device)
            for g in groups:
                n.index_add_(0, g.index.to(device), g.sizes.to(device))
            self._adam_n = n.clamp_min(1)
        return torch.cat([(sums[0] / sums[2].clamp_min(1)).sqrt(), (sums[1] / self._adam_n).sqrt().sqrt()])

    # -- the read and the warnings -----------------------------------------------------------
    def watch_headroom(self, emit: Callable[[int, Headroom], None]) -> Callable[[int, Headroom], None]:
        """``emit`` (the headroom check's), then the measurement folded into the trend as ``headroom``:
        how close the module's low-precision outputs came to the dtype's largest finite value."""

        # A weak reference: the remedies hold this emit and this check holds the remedies, and a cycle
        # would keep the user's model alive past its loop (until a garbage collection).
        check = weakref.ref(self)

        def both(step: int, h: Headroom) -> None:
            emit(step, h)
            me = check()
            if me is not None and me.every:
                me._warn(me.trend.add(step, {(h.module, "headroom"): h.absmax / h.limit}))

        return both

    def _read_ready(self) -> None:
        while self._pending and self._pending[0].ready():
            queued = self._pending.pop(0)
            values = queued.read()
            stalled = self.moments.add(queued.step, values, self._beta2)  # turns adam_v into adam_v_decay
            self._warn(stalled + self.trend.add(queued.step, values, queued.raw))

    def _warn(self, found: list[Precursor]) -> None:
        for w in found:
            signal = SIGNALS[w.signal]
            lr = current_lr(self.optimizer)
            where = f" of '{w.module}'" if w.module else ""
            fix = f"{signal.fix} (lr={lr})"
            adam = w.context.get("adam_update")
            if w.signal == "update_ratio" and adam is not None and adam >= SIGNALS["adam_update"].limit * 0.9:
                fix += f"; Adam's update per unit of LR is {adam:.3g} here: {SIGNALS['adam_update'].fix}"
            self.recorder.warning(
                w.series[-1][0],
                signal=w.signal,
                module=w.module,
                value=w.value,
                trend=w.trend,
                steps_left=w.steps_left,
                fix=fix,
                lr=lr,
                level=w.level,
                limit=signal.limit,
                series=[list(p) for p in w.series],
                context=w.context,
            )
            log.warning(
                "nanguard: step %d: %s%s is %.4g, growing x%.4g a step: %s %s; fix: %s",
                w.series[-1][0],
                w.signal,
                where,
                w.value,
                w.trend,
                signal.blowup,
                f"in about {w.steps_left} steps" if w.steps_left else "(armed now)",
                fix,
            )
        if found and self._acts():
            self._acted = True
            self.remedies.lower_lr()
            w = found[0]
            why = f"precursor {w.signal} of '{w.module}' grows x{w.trend:.4g} a step: LR x{self.config.lr_factor:g}"
            self.remedies.record(w.series[-1][0], "optimizer.divergence", "lower_lr", w.module, why)

    def _acts(self) -> bool:
        c = self.config
        return c.precursor_lower_lr and c.policy == "auto" and not self._acted and not dist.is_distributed()


def _stacked(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-dim values as one float32 vector: one stack when they share a dtype and device, else each moved."""
    try:
        return torch.stack(values).float()  # type: ignore[arg-type]
    except RuntimeError:
        device = values[0].device
        return torch.stack([v.float().to(device).reshape(()) for v in values])


def _weak(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` as a hook that does not keep its object alive: the model and the optimizer hold their
    hooks, and a check they kept alive would keep them alive in turn (a cycle: the user's model would
    outlive its loop until a garbage collection). A reference to the object and the plain function, not a
    ``WeakMethod``: the step hooks run at every step, and rebuilding the bound method costs five calls."""
    bound: Any = method  # a bound method
    ref, func = weakref.ref(bound.__self__), bound.__func__

    def hook(*args: Any, **kwargs: Any) -> Any:
        me = ref()
        return None if me is None else func(me, *args, **kwargs)

    return hook
