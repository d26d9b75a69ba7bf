"""The op tracer: sees every aten op of forward and backward under a ``TorchDispatchMode``.

For each op it learns whether the op *created* a non-finite value (NaN from NaN-free
inputs, Inf from all-finite inputs) and carries a *taint* (the set of origins behind a
non-finite tensor) from inputs to outputs, so the origin that reached the results can be
told from dead ends. Statistics are kept only for creations, never clones of tensors.

``Tracer`` holds the state; the private ``_TracerMode`` hands it each op, after the checks every op
needs (its facts, its inputs' taint), made in the mode's own frame: the tiny GPT runs ~325 ops a step.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from nanguard import compat
from nanguard.evidence import OriginEvidence
from nanguard.stats import float_groups, local, tensor_stats, total_norm
from nanguard.tracer import normalize, ops
from nanguard.tracer.calls import UserCalls, distribution_call
from nanguard.tracer.collectives import Communication
from nanguard.tracer.counts import BatchCounts
from nanguard.tracer.grads import GradWatch
from nanguard.tracer.modules import ModuleStack, user_source
from nanguard.tracer.nodes import ForwardSites
from nanguard.tracer.protect import Backup
from nanguard.tracer.taint import CLEAN, Inputs, TaintMap, has_inf_created, nonfinite_flags, storage_key, version
from nanguard.tree import op_leaves

__all__ = ["Failure", "Origin", "Tracer"]

_RECENT = 6
_AFTER = 8
_NONE: frozenset[int] = frozenset()


@dataclass
class Origin:
    """One place a non-finite value came from: an op that created it, or a source tensor."""

    id: int
    category: str  # "op" | "data" | "parameters" | "write" | "fill" | "blank" (allocated, unwritten) | "comm"
    kind: str  # "nan" | "inf" | "invalid" (an index op raised)
    index: int  # op index where it was created or first consumed
    op: str | None
    module: str | None
    phase: str
    source: str | None = None
    library_source: str | None = None
    node: str | None = None
    forward_op: str | None = None
    module_type: str | None = None
    path: str | None = None
    inputs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    scalars: list[Any] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    before: list[dict[str, Any]] = field(default_factory=list)
    after: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Where this origin's values came from, in a line of JSON: its category, op, module, path
        and the value it wrote."""
        found = {"category": self.category, "op": self.op, "module": self.module, "path": self.path}
        if "written" in self.extra:
            found["written"] = self.extra["written"]
        return {k: v for k, v in found.items() if v is not None}

    def to_evidence(self) -> dict[str, Any]:
        """The written origin (``diag.evidence["origin"]``), built through ``evidence.OriginEvidence``:
        its fields by keyword, the op's own facts after them."""
        return OriginEvidence(
            category=self.category,
            op=self.op,
            module=self.module,
            module_type=self.module_type,
            phase=self.phase,
            node=self.node,
            forward_op=self.forward_op,
            source=self.source,
            library_source=self.library_source,
            path=self.path,
            inputs=self.inputs,
            outputs=self.outputs,
            scalars=self.scalars,
            extra=dict(self.extra),
        ).to_dict()


@dataclass
class _Where:
    op: str | None
    module: str | None
    module_type: str | None
    phase: str
    node: str | None
    forward_op: str | None
    source: str | None
    library: str | None
    eps: float | None


class _Op(NamedTuple):
    """One op call as the dispatch saw it, for the output that it made non-finite."""

    func: Any
    facts: ops.OpInfo
    args: tuple
    kwargs: dict
    flat_in: Sequence[Any]
    out: Any


@dataclass
class Failure:
    """The first op that raised; ``index`` is set when it is an index op (an id out of range?)."""

    op: str
    where: _Where
    error: BaseException
    index: ops.IndexFacts | None


class _TracerMode(compat.DispatchMode):
    """Hands the tracer each op; the checks every op needs are made here, in one Python frame."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer
        self.facts: dict[int, tuple[Any, ops.OpInfo]] = {}  # ``ops.info`` per op, by id: no call a hit

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # The tracer never runs under torch.compile; skipping dynamo's wrapper saves a
        # Python frame on every op.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tracer = self.tracer
        hit = self.facts.get(id(func))
        facts = hit[1] if hit is not None and hit[0] is func else self._learn(func)
        kwargs = kwargs or {}
        if facts.comm:  # carries values between ranks, never creates one
            return tracer.communicate(func, args, kwargs)
        tracer.index += 1
        tracer.func, tracer.args = func, args
        flat_in = args[: facts.read] if facts.flat and not kwargs else _leaves(args, kwargs, facts.flat)
        if facts.beta or facts.writes:
            flat_in = tracer.before_write(func, facts, args, kwargs, flat_in)
        # An allocation reads its inputs' shapes only (``empty_like``): their values reach nothing.
        ins = CLEAN if facts.literal or facts.allocates else tracer.taint.inputs(flat_in)
        if ins.taint:  # what a raise right after it is about, and the first module to read unnamed data
            tracer.last_taint, tracer.last_taint_index = ins.taint, tracer.index
            if tracer.unnamed:
                tracer.first_reader(ins.taint)
        try:
            out = facts.call(*args, **kwargs)
        except BaseException as err:
            tracer.op_failed(func, args, err)
            raise
        if not facts.literal:  # left unseen: the op that consumes the literal writes its value
            tracer.after_op(func, facts, args, kwargs, flat_in, ins, out)
        return out

    def _learn(self, func: Any) -> ops.OpInfo:
        facts = ops.info(func)
        self.facts[id(func)] = (func, facts)
        return facts


class Tracer:
    """Runs ops as usual while entered, and records where non-finite values are created.

    ``sources`` are the user's input tensors with their paths (``batch['x']``);
    ``protected`` backs up the parameters and buffers that ops must not change for good,
    and ``restore()`` puts them back.
    """

    def __init__(
        self,
        modules: ModuleStack,
        sources: list[tuple[str, torch.Tensor]],
        protected: Backup,
    ) -> None:
        self.modules = modules
        self.sources = {id(t): path for path, t in sources}
        self.source_storage = {storage_key(t): path for path, t in reversed(sources)}
        self.counts = BatchCounts(sources)  # what the batch's labels and masks counted (mask.sum())
        self._counting = bool(self.counts)  # an empty one stays empty: it only follows what it holds
        self.protected = protected
        self.sites = ForwardSites(modules)
        self.leaves = self.sites.leaves
        self.taint, self.comm = _taint_and_comm(self)
        self.origins: list[Origin] = []
        self.recent: deque[tuple[Any, str | None, str]] = deque(maxlen=_RECENT)
        self.index = 0
        self.failure: Failure | None = None
        self._mode: _TracerMode | None = None
        self.func: Any = None  # the op being run, for the origins its inputs make
        self.args: tuple = ()  # its arguments
        # Gradient surgery (PCGrad, a hand-written clip) between backward() and optimizer.step(), on
        # the .grad tensors or on what torch.autograd.grad returned.
        self.grads = GradWatch(modules, self.leaves, protected)
        self.calls = UserCalls(on_gradients=self.grads.produced)
        self.norms = normalize.NormalizationWatch()
        # The taint of the latest op that read a non-finite value, and its index: what a raise
        # right after it (a distribution's validate_args, multinomial, an assert) is about.
        self.last_taint: frozenset[int] = _NONE
        self.last_taint_index = -1
        # Data origins made outside any module (named after their first reader), and the origins
        # whose list of the ops after them is full: checked on every op that reads a non-finite value.
        self.unnamed: list[Origin] = []
        self._full: set[int] = set()

    def __enter__(self) -> Tracer:
        _mark_finite(self.taint, self.protected)
        self.sites.start()
        self.calls.__enter__()
        self._mode = _TracerMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)
            self.calls.__exit__(*exc)

    def restore(self) -> None:
        """Put the backed-up parameters and buffers back."""
        self.protected.restore()

    # -- per-op work ------------------------------------------------------------------
    def communicate(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run a communication op: it carries values between ranks and never creates one."""
        self.index += 1
        return self.comm.run(func, args, kwargs, self.taint, self.index, lambda: _comm_where(self))

    def before_write(
        self, func: Any, facts: ops.OpInfo, args: tuple, kwargs: dict, flat_in: Sequence[Any]
    ) -> Sequence[Any]:
        """Before an addmm-family op or one that writes into an argument runs: the inputs it reads
        (not the first when ``beta`` is 0), and a copy of the protected tensors it writes into."""
        if facts.beta and flat_in and ops.ignores_first(func, args, kwargs):
            flat_in = flat_in[1:]  # not read: whatever it holds does not reach the output
        if facts.overwrites:  # written whole, never read (a copy's destination, an out= buffer)
            dest = kwargs.get("out") if facts.overwrites == "out" else args[0] if args else None
            flat_in = [x for x in flat_in if x is not dest]
        if facts.writes:
            self.protected.before(facts.writes, args, kwargs)
        return flat_in

    def first_reader(self, taint: frozenset[int]) -> None:
        """Bad data first touched outside any module (a pipeline schedule splitting the batch into
        microbatches, the loop's own arithmetic) is named after the first module that reads it."""
        module = self.modules.top
        if module is None:
            return
        for origin in self.unnamed:
            if origin.id in taint and origin.category == "data" and origin.module is None:
                origin.module = self.modules.top_name
                origin.module_type = type(module).__name__

    def op_failed(self, func: Any, args: tuple, err: BaseException) -> None:
        if self.failure is None:
            facts = _index_facts(func, args, self._path)
            self.failure = Failure(ops.op_name(func), self._where(func), err, facts)

    def _path(self, t: torch.Tensor) -> str | None:
        return self.sources.get(id(t)) or self.source_storage.get(storage_key(t))

    def after_op(
        self, func: Any, facts: ops.OpInfo, args: tuple, kwargs: dict, flat_in: Sequence[Any], ins: Inputs, out: Any
    ) -> None:
        flat_out = [out] if isinstance(out, torch.Tensor) else _tensors(out)
        if self._counting and not self.counts.known.keys().isdisjoint(map(id, flat_in)):
            self.counts.note(flat_in, flat_out)  # only an op that reads a count can carry one
        node = current_autograd_node()
        grads = self.grads
        if node is not None:
            if not grads.in_backward:  # inside a backward it stays there: nothing to tell it
                grads.before(True, flat_in, facts, args, kwargs)
        elif grads.seen_backward:
            grads.before(False, flat_in, facts, args, kwargs)
        if ins is CLEAN:
            self._clean_outputs(func, facts, args, kwargs, flat_in, out, flat_out)
        else:
            self._tainted_outputs(func, facts, args, kwargs, flat_in, out, ins, flat_out)
        if grads.phase is not None:
            grads.after(flat_out)
        if flat_out and (node is None or self.modules.top is not None):  # a backward op outside a module has no site
            self.sites.note(facts, flat_in, node is not None)
        if not facts.quiet:
            self.recent.append((func, self.modules.top_name, "forward" if node is None else "backward"))

    def _clean_outputs(
        self, func: Any, facts: ops.OpInfo, args: tuple, kwargs: dict, flat_in: Sequence[Any], out: Any, flat_out: list
    ) -> None:
        """Flags of an op's outputs when none of its inputs is non-finite: a finite sum (or an op that
        keeps finite values finite) proves an output finite; any other is read by ``_outputs``."""
        if facts.allocates:
            self._allocated(func, flat_out)
            return
        base = _base_version(args) if facts.view else None
        if facts.keeps_finite:
            self.taint.set_finite(flat_out, base)
            return
        source = _values_source(facts, args)
        status = self.taint.status
        for i, o in enumerate(flat_out):
            if not (o.is_floating_point() or o.is_complex()):
                continue
            if (source is not None and o.numel() >= source.numel() > 0) or _sum_is_finite(o):
                status[id(o)] = (weakref.ref(o), version(o), False, False, _NONE, base)
            else:
                self._outputs(_Op(func, facts, args, kwargs, flat_in, out), CLEAN, flat_out[i:])
                return

    def _allocated(self, func: Any, flat_out: list[torch.Tensor]) -> None:
        """Memory an allocation returned (``torch.empty``, ``new_empty``) holds whatever the allocator left
        there: NaN on a GPU block a freed tensor held, finite garbage on another run. The tracer fills its
        floating outputs with NaN under a "blank" origin, so an element read before any op wrote it carries
        that origin (and an element written over carries nothing): a read of uninitialized memory reproduces
        on every replay, whatever the memory held in the step itself."""
        floats = [o for o in flat_out if (o.is_floating_point() or o.is_complex()) and o.numel() and _poisoned(o)]
        if not floats:
            return
        where = self._where(func)
        taint = frozenset({self._record(where, "blank", "nan", outputs=[{"shape": list(o.shape)} for o in floats]).id})
        status = self.taint.status
        for o in floats:  # the tensor's own taint, not its storage's: an element written over carries nothing
            status[id(o)] = (weakref.ref(o), version(o), True, False, taint, None)

    def _tainted_outputs(
        self,
        func: Any,
        facts: ops.OpInfo,
        args: tuple,
        kwargs: dict,
        flat_in: Sequence[Any],
        out: Any,
        ins: Inputs,
        flat_out: list[torch.Tensor],
    ) -> None:
        """Flags and taint of the outputs of an op that read a non-finite value: after a NaN flood's
        (``_flooded``), or any other's (``_outputs``)."""
        if ins.nan and not (ins.inf or ins.written or self.norms.pending):
            self._flooded(func, facts, args, ins.taint, flat_out)
        else:
            self._outputs(_Op(func, facts, args, kwargs, flat_in, out), ins, flat_out)

    def _flooded(self, func: Any, facts: ops.OpInfo, args: tuple, taint: frozenset[int], flat_out: list) -> None:
        """``_outputs`` of an op whose inputs hold NaN, and no Inf nor non-finite number: nothing is created
        from a NaN, so an output that holds NaN/Inf carries its inputs' ``taint`` (most ops of a faulty step)."""
        base = _base_version(args) if facts.view else None
        source = _values_source(facts, args)
        for o in flat_out:
            if not (o.is_floating_point() or o.is_complex()):
                continue
            same = source is not None and o.numel() >= source.numel() > 0  # its input's values: its flags
            nan, inf = (True, False) if same else nonfinite_flags(o, likely=True)
            if not (nan or inf):
                self.taint.set(o, False, False, _NONE, base)
                continue
            self.taint.set(o, nan, inf, taint, base)
            if not same and facts.writes and args and o is args[0]:
                self._written_into(o, taint)
            if not taint <= self._full:
                self._note_after(func, facts, taint, nan, None)

    def _outputs(self, op: _Op, ins: Inputs, flat_out: list[torch.Tensor]) -> None:
        """Flags and taint of each floating output of an op that may have made NaN/Inf."""
        if ins.inf or self.norms.pending:
            self._inputs_read(op, ins)
        args = op.args
        base = _base_version(args) if op.facts.view else None  # the version of the tensor a view's outputs view
        source = _values_source(op.facts, args)
        where: _Where | None = None
        for o in flat_out:
            if not (o.is_floating_point() or o.is_complex()):
                continue
            if source is not None and o.numel() >= source.numel() > 0:
                self.taint.set(o, ins.nan, ins.inf, ins.taint, base)  # its input's values: nothing created
                if not ins.taint <= self._full:
                    self._note_after(op.func, op.facts, ins.taint, ins.nan, where)
            else:
                where = self._checked(op, ins, o, base, where)

    def _inputs_read(self, op: _Op, ins: Inputs) -> None:
        """What an op learns of the non-finite inputs it reads: an additive mask weighed as features is
        data, a -inf it reads beside the batch's mask was a fill by that mask, a pending normalization's
        statistic is used."""
        if ins.inf and op.facts.weighted:
            self._features(ins)
        if ins.inf_taint and self._counting:
            self._mask_fills(op.func, op.args, ins.inf_taint)
        if self.norms.pending and ins.taint:
            self.norms.used(op.facts.name, op.flat_in, ins.taint, self.taint.taint_of)

    def _checked(self, op: _Op, ins: Inputs, o: torch.Tensor, base: int | None, where: _Where | None) -> _Where | None:
        """Read one output's flags and record its taint: none when finite, its inputs' after a NaN input
        (nothing is created from one), else what ``_nonfinite_output`` finds. Returns where the op ran,
        once found."""
        nan, inf = nonfinite_flags(o, likely=ins.nan or ins.inf)
        if not (nan or inf):
            self.taint.set(o, False, False, _NONE, base)
            return where
        if ins.nan and not ins.written:
            taint = ins.taint
        else:
            taint, where = self._nonfinite_output(op, ins, o, nan, inf, where)
        self.taint.set(o, nan, inf, taint, base)
        if op.facts.writes and op.args and o is op.args[0]:
            self._written_into(o, taint)
        if not taint <= self._full:  # an empty one too
            self._note_after(op.func, op.facts, taint, nan, where)
        return where

    def _written_into(self, t: torch.Tensor, taint: frozenset[int]) -> None:
        """An in-place write of this op left ``t`` non-finite: its aliases are read again at their next use
        (``TaintMap.written``), and a write origin made here says what it wrote into: the tensor whose
        storage ``t`` is a view or an alias of, and the op and module that made that tensor."""
        made = [self.origins[i] for i in taint if self.origins[i].index == self.index]
        aliases = self.taint.written(t)
        for origin in made:
            if origin.category == "write" and "written_into" not in origin.extra:
                origin.extra["written_into"] = self._into(t, aliases)
                if not origin.outputs:  # a value given as a tensor (x[i] = -inf): what it wrote into
                    origin.outputs = [tensor_stats(t)]

    def _into(self, t: torch.Tensor, aliases: list[torch.Tensor]) -> dict[str, Any]:
        """``{"through", "shape", "base": {"shape", "op", "module"}}``: a write through a view (``x[i]``,
        ``x.view(...)``) or an alias (``x.data``, ``x.detach()``) lands in the base's storage."""
        base: torch.Tensor | None = t._base if t._is_view() else None
        through = "view" if base is not None else "tensor"
        if base is None and aliases:
            # The alias the autograd graph knows (the one the model returned), else the largest.
            base = max(aliases, key=lambda a: (a.grad_fn is not None, a.numel()))
            through = "alias"
        into: dict[str, Any] = {"through": through, "shape": list(t.shape)}
        made_by = base if base is not None else t
        node = made_by.grad_fn
        module, _, forward_op, source, _, _ = self.sites.of(node) if node is not None else (None,) * 6
        into["base"] = {
            "shape": list(made_by.shape),
            "op": forward_op,
            "node": node.name() if node is not None else None,
            "module": module,
            "source": source,
        }
        return into

    def _nonfinite_output(
        self, op: _Op, ins: Inputs, o: torch.Tensor, nan: bool, inf: bool, where: _Where | None
    ) -> tuple[frozenset[int], _Where | None]:
        """The taint of an output holding NaN/Inf: a new origin when this op created them, a fill when
        it wrote a value it was given, else its inputs' (and where the op ran, once found)."""
        created_nan = nan and not ins.nan
        created_inf = inf and not ins.nan and (not ins.inf or has_inf_created(o, op.flat_in))
        if created_nan or created_inf:
            # Two infinities combined (-inf - (-inf) in a running max): that arithmetic made the NaN,
            # even where each infinity was written on purpose.
            met = ops.infinities_met(op.func, op.flat_in, o) if created_nan and ins.inf_taint else None
            if created_nan and not met and self._from_written_inf(op.func, ins):
                return ins.taint, where
            return self._created(op, ins, created_nan, met, where)
        if ins.written and not self._outranked(ins.taint):
            return self._given(op, ins, o), where
        return ins.taint, where

    def _given(self, op: _Op, ins: Inputs, o: torch.Tensor) -> frozenset[int]:
        """The taint of an output that holds a non-finite number the op was given (a fill value), if it
        does: its inputs' and the fill's."""
        value = _written(o, ins.written)
        if value is None:
            return ins.taint
        return ins.taint | {self._fill(op.func, op.args, value, o).id}

    def _created(
        self, op: _Op, ins: Inputs, created_nan: bool, met: Any, where: _Where | None
    ) -> tuple[frozenset[int], _Where]:
        """This op created the output's NaN (``created_nan``) or Inf: a new origin, where the op ran."""
        if where is None:
            self.grads.recheck(op.flat_in, op.facts, op.args, op.kwargs)
        where = where or self._where(op.func)
        origin = self._creation(op.func, op.args, op.kwargs, op.out, where, "nan" if created_nan else "inf")
        self._inf_facts(origin, ins.inf_taint, met)
        # A NaN made from an Inf keeps the Inf's origin: the Inf came first.
        return frozenset({origin.id}) | (ins.inf_taint if created_nan else _NONE), where

    # -- helpers -----------------------------------------------------------------------
    def _source(self, t: torch.Tensor, nan: bool, inf: bool) -> Origin:
        """A tensor that arrived non-finite: user data, a parameter/buffer, a literal or a constant."""
        path = self._path(t)
        kind = "nan" if nan else "inf"
        stats = tensor_stats(t)
        # A tensor holding only -inf (and finite values) is a mask fill, not an origin by itself.
        neginf_only = not nan and not stats.get("posinf")
        parameter = path is None and (isinstance(t, torch.nn.Parameter) or self.protected.protects(t))
        if path is None and not parameter and t.dim() == 0:
            # A Python number the op got as a tensor (h[i] = nan): the op writes it.
            return self._write(self.func, _value_name(stats), inputs=[stats], tensor=t)
        where = self._where(None)
        category, path, owner = self._source_kind(t, path, parameter, neginf_only)
        origin = Origin(
            id=len(self.origins),
            category=category,
            kind=kind,
            index=self.index,
            op=None,
            module=owner if owner is not None else where.module,
            module_type=where.module_type,
            phase="data" if category in ("data", "fill") else "parameters",
            source=where.source,
            library_source=where.library,
            path=path,
            inputs=[stats],
            extra={"consumer_op": where.op, "consumer_module": where.module},
            before=self.recent_ops(),
        )
        self.origins.append(origin)
        if origin.module is None and category in ("data", "fill"):
            self.unnamed.append(origin)
        return origin

    def _source_kind(
        self, t: torch.Tensor, path: str | None, parameter: bool, neginf_only: bool
    ) -> tuple[str, str | None, str | None]:
        """(category, path, owning module) of a source tensor: the user's data (or mask fill), a
        parameter or buffer of the model, or a tensor captured from outside fn."""
        if path is not None:
            # The user's own -inf is data unless it is an additive mask: only 0 and -inf.
            return ("fill" if neginf_only and _mask_values(t) else "data"), path, None
        if parameter:
            path = self.modules.state_name(t)
            return "parameters", path, path.rpartition(".")[0] if path is not None else None
        # Captured from outside fn (a closure's batch): treated as data.
        return ("fill" if neginf_only else "data"), None, None

    def _write(
        self,
        func: Any,
        value: str,
        *,
        inputs: Sequence[dict[str, Any]] = (),
        outputs: Sequence[dict[str, Any]] = (),
        tensor: torch.Tensor | None = None,
    ) -> Origin:
        """An op that wrote an explicit NaN/Inf (``value``: "nan", "inf" or "-inf"): a mask fill or a marker.

        A NaN or +Inf written inside torch's own implementation of the user's call (``torch.logdet``
        returns NaN for a negative determinant through an internal ``where``) is that call's result
        by definition, not a write of the user's: it is a creation by the user-level op."""
        kind = "nan" if value == "nan" else "inf"
        where = self._where(func)
        if value != "-inf" and where.node is None and func is not None and self.calls.inside(func, value, tensor):
            user_op, facts = self.calls.by_definition(where.op, value)
            return self._record(replace(where, op=user_op), "op", kind, **facts)
        return self._record(where, "write", kind, inputs=list(inputs), outputs=list(outputs), extra={"written": value})

    def _from_written_inf(self, func: Any, ins: Inputs) -> bool:
        """Is a NaN this op makes only the consequence of an Inf some op wrote on purpose
        (0 * -inf in an entropy over masked logits)? Softmax-like ops are exempt: a NaN
        from their all -inf row is a fully masked row, theirs to name."""
        if not ins.inf_taint or not all(self.origins[i].category == "write" for i in ins.inf_taint):
            return False
        if ops.info(func).mask_aware:
            return False
        node = compat.current_autograd_node()
        if node is None or not node.name().startswith(ops.MASK_AWARE_NODES):
            return True
        # A softmax's backward kernel given an Inf gradient (d(p * logp)/dp over a filtered logit) makes
        # 0 * Inf: the write's consequence. Given a finite one, its NaN is a fully masked row's.
        return ops.op_name(func) in ops.GRAD_FIRST and self._nonfinite_first(func)

    def _nonfinite_first(self, func: Any) -> bool:
        """Does the op's first argument, the gradient flowing in to a ``*_backward_data`` kernel, hold NaN/Inf?"""
        first = self.args[0] if self.args and isinstance(self.args[0], torch.Tensor) else None
        if first is None:
            return False
        status = self.taint.status_of(first)
        return status.nan or status.inf

    def _fill(self, func: Any, args: tuple, value: str, out: torch.Tensor) -> Origin:
        """The write of an explicit ``value`` into ``out``; a -inf fill remembers the batch tensor its
        mask was computed from (``masked_fill(batch_mask == 0, -inf)``)."""
        written = self._write(func, value, outputs=[tensor_stats(out)])
        mask = _mask_argument(func, args) if value == "-inf" else None
        path = (self.counts.path(mask) or self._path(mask)) if mask is not None else None
        if path is not None:
            written.extra["mask_from"] = path
        return written

    def _inf_facts(self, origin: Origin, inf_taint: frozenset[int], met: str | None) -> None:
        """What a creation from Inf inputs learns of them: the batch mask behind a fully masked
        row, and which sentinels two infinities that met came from."""
        if origin.extra.get("fully_masked_samples") and inf_taint:
            self._masked_by(origin, inf_taint)
        if met:
            origin.extra["infinities_met"] = met
            origin.extra["infinity_sources"] = [self.origins[i].summary() for i in sorted(inf_taint)]

    def _mask_fills(self, func: Any, args: tuple, inf_taint: frozenset[int]) -> None:
        """``where(batch_mask, scores, full_like(scores, -inf))``: the -inf written beforehand becomes a
        fill by the batch's mask here."""
        mask = _mask_argument(func, args)
        path = (self.counts.path(mask) or self._path(mask)) if mask is not None else None
        if path is None:
            return
        for oid in inf_taint:
            origin = self.origins[oid]
            if origin.category == "write" and origin.extra.get("written") == "-inf":
                origin.extra.setdefault("mask_from", path)

    def _masked_by(self, origin: Origin, inf_taint: frozenset[int]) -> None:
        """A softmax over fully masked rows whose -inf came from a mask of the batch's (``batch[0][1]``,
        ``batch['attention_mask']``, or an additive mask passed in): that tensor, and the samples
        (dim 0) whose rows are empty, so a quarantine can take them."""
        for oid in sorted(inf_taint):
            source = self.origins[oid]
            path = source.extra.get("mask_from") or (source.path if source.category == "fill" else None)
            if path is not None:
                origin.extra["masked_by"] = {"path": path, "rows": origin.extra["fully_masked_samples"]}
                return

    def _outranked(self, taint: frozenset[int]) -> bool:
        """Would any write origin made now lose to one in ``taint``? Every origin but a fill
        does (``locate`` ranks writes after the rest, and an earlier write first), and a tensor
        carrying the new one carries ``taint`` too: recording it would cost a pass for nothing."""
        return any(self.origins[i].category != "fill" for i in taint)

    def _features(self, ins: Inputs) -> None:
        """A user input kept as an additive mask (only 0 and -inf) is data after all when an
        op weighs it as features (a matmul, a product)."""
        for oid in ins.inf_taint:
            origin = self.origins[oid]
            if origin.category == "fill" and origin.path is not None:
                origin.category = "data"

    def _where(self, func: Any) -> _Where:
        node = compat.current_autograd_node()
        module = self.modules.current
        op = ops.op_name(func) if func is not None else None
        if node is None:
            source, library = user_source()
            return _Where(
                op=op,
                module=self.modules.current_name(),
                module_type=type(module).__name__ if module is not None else None,
                phase=self.grads.phase or "forward",
                node=None,
                forward_op=None,
                source=source,
                library=library,
                eps=self.modules.eps(module),
            )
        mod_name, mod_type, fwd, source, library, eps = self.sites.of(node)
        return _Where(op, mod_name, mod_type, "backward", node.name(), fwd, source, library, eps)

    def _creation(self, func: Any, args: tuple, kwargs: dict, out: Any, where: _Where, kind: str) -> Origin:
        flat_args = op_leaves(args)
        extra = ops.creation_facts(func, args, kwargs, out, where.eps)
        if where.node is None:
            extra.update(self._call_facts(func, flat_args))
        origin = self._record(
            where,
            "op",
            kind,
            inputs=[_with_count(tensor_stats(t), self.counts.path(t)) for t in flat_args if isinstance(t, Tensor)],
            outputs=[tensor_stats(t) for t in op_leaves(out) if isinstance(t, torch.Tensor)],
            scalars=[_scalar(x) for x in flat_args if isinstance(x, (int, float, bool))],
            extra=extra,
        )
        if where.node is None:
            self.norms.created(origin, flat_args)
        return origin

    def _call_facts(self, func: Any, flat_args: list[Any]) -> dict[str, Any]:
        """The user-level call around a forward creation, and the gradients a gradient-surgery op read."""
        facts = {"user_op": self.calls.name} if self.calls.implements(ops.op_name(func)) else {}
        method = distribution_call()
        if method is not None:
            facts["user_op"] = method
        return facts | self.grads.facts(flat_args)

    def _record(self, where: _Where, category: str, kind: str, **facts: Any) -> Origin:
        """A new origin at ``where``, with the ops that ran just before it."""
        origin = Origin(
            id=len(self.origins),
            category=category,
            kind=kind,
            index=self.index,
            op=where.op,
            module=where.module,
            module_type=where.module_type,
            phase=where.phase,
            source=where.source,
            library_source=where.library,
            node=where.node,
            forward_op=where.forward_op,
            before=self.recent_ops(),
            **facts,
        )
        self.origins.append(origin)
        return origin

    def recent_ops(self) -> list[dict[str, Any]]:
        return [{"op": ops.op_name(func), "module": module, "phase": phase} for func, module, phase in self.recent]

    def _note_after(self, func: Any, facts: ops.OpInfo, taint: frozenset[int], nan: bool, where: _Where | None) -> None:
        """Add this op to the ops after each origin in ``taint`` (the first ``_AFTER`` of them)."""
        if facts.quiet or not taint or taint <= self._full:
            return
        for oid in taint:
            origin = self.origins[oid]
            if origin.index == self.index or len(origin.after) >= _AFTER:
                continue
            if origin.after and origin.after[-1].get("index") == self.index:
                continue
            where = where or self._where(func)
            origin.after.append(
                {"index": self.index, "op": where.op, "module": where.module, "phase": where.phase, "nan": nan}
            )
            if len(origin.after) >= _AFTER:
                self._full.add(oid)


current_autograd_node = compat.current_autograd_node


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors among an op's outputs."""
    return [o for o in op_leaves(out) if isinstance(o, torch.Tensor)]


def _leaves(args: tuple, kwargs: dict, flat: bool) -> list[Any]:
    """An op's arguments as flat leaves: the positional ones (walked unless ``flat``), then the keyword ones."""
    found = list(args) if flat else op_leaves(args)
    if kwargs:
        op_leaves(kwargs, found)
    return found


def _poisoned(t: torch.Tensor) -> bool:
    """Fill ``t`` with NaN; False where its dtype or layout cannot hold or take one (a float8 without NaN on
    this device, a sparse layout): left as the allocator gave it, as before."""
    try:
        with torch.no_grad():
            t.fill_(math.nan)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _sum_is_finite(t: torch.Tensor) -> bool:
    """Does a finite sum prove ``t`` finite (a plain, strided float32/float64 tensor): ``nonfinite_flags``'
    first test, made here without its other cases."""
    return type(t) in _PLAIN and t.dtype in _SUMMED and t.layout == torch.strided and math.isfinite(t.sum().item())


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SUMMED = (torch.float32, torch.float64)


def _values_source(facts: ops.OpInfo, args: tuple) -> torch.Tensor | None:
    """The tensor whose values a ``same_values`` op's outputs hold (its first argument), else None."""
    return args[0] if facts.same_values and args and isinstance(args[0], torch.Tensor) else None


def _base_version(args: tuple) -> int | None:
    """The version of the tensor a view op views (its first argument)."""
    try:
        return args[0]._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return -1
    except (IndexError, AttributeError):  # no tensor to view
        return None


def _index_facts(func: Any, args: tuple, path_of: Callable[[torch.Tensor], str | None]) -> ops.IndexFacts | None:
    """An index op's integer inputs (with the batch path each came from) and the size it indexes."""
    if not ops.is_index_op(func):
        return None
    inputs = []
    for x in op_leaves(args):
        if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dtype != torch.bool:
            stats = tensor_stats(x)
            stats["path"] = path_of(x)
            inputs.append(stats)
    return ops.IndexFacts(inputs, ops.index_size(func, args), ops.ignore_index(func, args))


def _taint_and_comm(tracer: Tracer) -> tuple[TaintMap, Communication]:
    """The tracer's taint map and its handling of communication ops. A tensor that arrives
    non-finite from a collective this rank sent finite values to was made on another rank: an
    origin of category "comm"; any other is one of the tracer's sources."""
    comm = Communication()

    def source(t: torch.Tensor, nan: bool, inf: bool) -> int:
        user = id(t) in tracer.sources or storage_key(t) in tracer.source_storage
        sent = comm.sent(t) if comm.ops and not user else None
        if sent is None:
            return tracer._source(t, nan, inf).id
        origin = Origin(
            len(tracer.origins),
            "comm",
            "nan" if nan else "inf",
            sent.index,
            sent.op,
            sent.module,
            sent.phase,
            outputs=[tensor_stats(t)],
            before=tracer.recent_ops(),
        )
        tracer.origins.append(origin)
        return origin.id

    return TaintMap(source), comm


def _comm_where(tracer: Tracer) -> tuple[str | None, str]:
    """The module and phase a collective is issued in."""
    return tracer.modules.current_name(), "forward" if compat.current_autograd_node() is None else "backward"


def _with_count(stats: dict[str, Any], path: str | None) -> dict[str, Any]:
    if path is not None:
        stats["counted_from"] = path
    return stats


def _written(out: torch.Tensor, values: Sequence[float]) -> str | None:
    """The explicit non-finite number an op was given (``masked_fill(m, -inf)``,
    ``fill_(nan)``, ``full(..., inf)``) if its output holds it: "nan", "inf" or "-inf"."""
    for x in values:
        if out.dtype.is_floating_point:
            hit = torch.isnan(out).any() if math.isnan(x) else (out == x).any()
            if bool(hit):
                return "nan" if math.isnan(x) else "-inf" if x < 0 else "inf"
    return None


def _mask_argument(func: Any, args: tuple) -> torch.Tensor | None:
    """The boolean mask a fill op took: ``masked_fill(x, mask, v)``'s second argument, ``where(mask, x, v)``'s first."""
    name = ops.op_name(func)
    position = 1 if name.startswith("aten.masked_fill") else 0 if name.startswith("aten.where") else None
    if position is None or len(args) <= position or not isinstance(args[position], torch.Tensor):
        return None
    return args[position]


def _value_name(stats: dict[str, Any]) -> str:
    return "nan" if stats.get("nan") else "inf" if stats.get("posinf") else "-inf"


def _mask_values(t: torch.Tensor) -> bool:
    """Does ``t`` hold only 0 and -inf (or the dtype's lowest value): an additive mask?"""
    x = local(t).detach()
    return bool(((x == 0) | (x == -math.inf) | (x == torch.finfo(x.dtype).min)).all())


def _scalar(x: Any) -> Any:
    return x if not isinstance(x, float) or math.isfinite(x) else str(x)


def _mark_finite(taint: TaintMap, protected: Backup) -> None:
    """Read the parameters and buffers in one fused pass: when all are finite (the usual
    case), no op has to read one of them on first use."""
    floats = [t for t in protected.ids.values() if t.is_floating_point() and not t.is_sparse]
    try:
        finite = bool(floats) and math.isfinite(total_norm(float_groups(floats)).item())
    except (RuntimeError, NotImplementedError):  # meta or exotic tensors: each is read on first use
        finite = False
    if finite:
        taint.set_finite(floats)
