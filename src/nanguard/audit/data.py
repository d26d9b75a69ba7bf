"""``check_batch``: find data that will turn a step non-finite before the step runs.

Every count is computed on the tensors' device; all of them come to the host together in
one read, so checking a batch on a GPU costs one synchronization.
"""

from __future__ import annotations

import functools
import struct
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from nanguard import tree
from nanguard.findings import Finding

__all__ = ["CHUNK_ELEMENTS", "ID_KEYS", "LABEL_KEYS", "MAX_DEPTH", "MAX_LISTED", "check_batch", "vocab_of"]

ID_KEYS = frozenset({"input_ids", "token_ids", "ids", "tokens", "idx", "decoder_input_ids"})
LABEL_KEYS = frozenset({"labels", "targets", "target", "label"})
MAX_LISTED = 8  # sample indices listed in one finding
MAX_DEPTH = 256  # nesting levels walked; deeper values are reported as not checked
CHUNK_ELEMENTS = 1 << 20  # checks run over pieces this size, so their temporaries stay small
# Additive masks mark masked positions with -inf, finfo.min or a large negative constant;
# -1e4 is the mildest of those in use (fp16-safe BERT masks).
_ADDITIVE_MASKED = -1e4

_Done = Callable[[list[int]], list[Finding]]


def check_batch(
    batch: Any,
    model: nn.Module | None = None,
    vocab_size: int | None = None,
    *,
    ignore_index: int = -100,
) -> list[Finding]:
    """Audit one batch for values that make a training step non-finite.

    ``batch`` may be a tensor, or any nesting of mappings (dicts, ``BatchEncoding``,
    ``ModelOutput``), dataclasses, lists and tuples. Keys name a tensor's role: token ids
    (``input_ids``, ``tokens``, ...), labels (``labels``, ``targets``, ...) and masks (keys
    ending in ``mask``; ``*padding_mask`` means 1/True = padding; a loss mask needs one kept
    position in the batch, an attention mask one per sample). The vocabulary size is
    ``vocab_size``, or else the input embedding of ``model``. Unnamed integer tensors (in a
    tuple batch) are range-checked like labels when the vocabulary size is known; an unnamed 2-D
    0/1 integer tensor right after one of the same shape (``(input_ids, attention_mask, labels)``)
    is checked as that tensor's attention mask.

    Returns one ``Finding`` per problem, ``[]`` for a clean batch; ``where`` is the path in
    the batch, e.g. ``batch['input_ids']``, ``batch[0]`` or ``batch.pixel_values``.

    Example:
        >>> ids = torch.tensor([[1, 2, 120]])
        >>> [f.cause for f in check_batch({"input_ids": ids}, vocab_size=100)]
        ['data.index_out_of_range']
    """
    _check_arguments(batch, model, vocab_size, ignore_index)
    vocab = _resolve_vocab(model, vocab_size)
    reader = _Reader()
    pending: list[_Done] = []
    ids_shape: torch.Size | None = None  # of the latest unnamed integer tensor: token ids in a tuple batch
    for where, key, tensor in _leaves(batch):
        t = tensor.detach()
        if key is None and t.ndim == 2 and not (t.is_floating_point() or t.is_complex()) and t.dtype != torch.bool:
            if ids_shape is not None and t.shape == ids_shape:
                # (input_ids, attention_mask, ...): the integer tensor right after the ids, of their shape,
                # is read as their attention mask (1 keeps a position), if it holds only 0 and 1.
                ids_shape = None
                pending.append(_check_mask(reader, where, "attention_mask", t, inferred=True))
                continue
            ids_shape = t.shape
        pending += _checks(reader, where, key, t, vocab, ignore_index)
    if not pending:
        return []
    counts = reader.read()
    return [finding for done in pending for finding in done(counts)]


def _check_arguments(batch: Any, model: nn.Module | None, vocab_size: int | None, ignore_index: int) -> None:
    if isinstance(vocab_size, bool) or not (vocab_size is None or isinstance(vocab_size, int)):
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
    if vocab_size is not None and vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
    if model is not None and not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int (usually -100), got {ignore_index!r}")
    if not tree.is_container(batch) and not isinstance(batch, torch.Tensor):
        raise ValueError(
            f"batch must be a tensor, a mapping, a list/tuple or a dataclass of tensors, got {type(batch).__name__}"
        )


def _checks(
    reader: _Reader, where: str, key: str | None, t: torch.Tensor, vocab: tuple[int, str] | None, ignore_index: int
) -> list[_Done]:
    """The checks of one tensor of the batch, by its role (its key's name) and dtype."""
    if t.device.type == "meta":
        return []
    if t.layout != torch.strided:
        # A sparse tensor's stored values are all it holds: check those for NaN/Inf.
        values = t.coalesce().values() if t.layout == torch.sparse_coo else t.values()
        if not (values.is_floating_point() or values.is_complex()):
            return []
        sparse = f"{where} (sparse values)"
        return [_check_nonfinite(reader, sparse, values.reshape(-1), ignore_neginf=False, per_sample=False)]
    role = _role(key)
    found = []
    if t.is_floating_point() or t.is_complex():
        found.append(_check_nonfinite(reader, where, t, ignore_neginf=role == "mask", per_sample=True))
    if role == "mask" and not t.is_complex():
        found.append(_check_mask(reader, where, key or "", t))
    elif _is_integer(t):
        found += _integer_checks(reader, where, t, role, vocab, ignore_index)
    return found


def _integer_checks(
    reader: _Reader, where: str, t: torch.Tensor, role: str, vocab: tuple[int, str] | None, ignore_index: int
) -> list[_Done]:
    found = [_check_targets(reader, where, t, ignore_index)] if role == "labels" else []
    if t.numel() == 0:
        return found
    if role == "ids":
        found.append(_check_range(reader, where, t, vocab, ignore_index=None))
    elif role == "labels" or (role == "unnamed" and vocab is not None):
        found.append(_check_range(reader, where, t, vocab, ignore_index=ignore_index))
    return found


# --------------------------------------------------------------------------- traversal


def _leaves(batch: Any) -> Iterator[tuple[str, str | None, torch.Tensor]]:
    """(path, lower-cased name of the nearest enclosing key or field, tensor) for every tensor and
    numpy array (as a tensor sharing its memory), walked without recursion down to ``MAX_DEPTH``."""
    stack: list[tuple[tree.KeyPath, Any, frozenset[int]]] = [((), batch, frozenset())]
    stopped: list[str] = []
    while stack:
        path, obj, seen = stack.pop()
        items = tree.children(obj)
        if items is None:
            tensor = _as_tensor(obj)
            if tensor is not None:
                name = tree.nearest_name(path)
                yield tree.path_str("batch", path), name.lower() if name is not None else None, tensor
            continue
        if id(obj) in seen:
            continue
        if len(path) >= MAX_DEPTH:
            stopped.append(tree.path_str("batch", path))
            continue
        inner = seen | {id(obj)}
        stack.extend(((*path, key), value, inner) for key, value in reversed(items))
    if stopped:
        warnings.warn(
            f"check_batch: stopped at nesting depth {MAX_DEPTH} in {len(stopped)} place(s), first "
            f"{stopped[0][:200]}: values below were not checked",
            UserWarning,
            stacklevel=3,
        )


def _as_tensor(leaf: Any) -> torch.Tensor | None:
    if isinstance(leaf, torch.Tensor):
        return leaf
    if type(leaf).__module__ == "numpy" and type(leaf).__name__ == "ndarray":
        try:
            return torch.from_numpy(leaf)  # shares memory: no copy of a large array
        except (TypeError, RuntimeError, ValueError):  # object, string or unsupported dtypes
            return None
    return None


def _role(key: str | None) -> str:
    if key is None:
        return "unnamed"
    if key in ID_KEYS:
        return "ids"
    if key in LABEL_KEYS:
        return "labels"
    if key.endswith(("mask", "masks")):
        return "mask"
    return "other"


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _resolve_vocab(model: nn.Module | None, vocab_size: int | None) -> tuple[int, str] | None:
    if vocab_size is not None:
        return vocab_size, "vocab_size argument"
    if model is None:
        return None
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            emb = None
        size = getattr(emb, "num_embeddings", None)
        if isinstance(size, int) and not isinstance(size, bool):
            return size, "model.get_input_embeddings()"
    for name, module in model.named_modules():
        if _is_embedding(module):
            return module.num_embeddings, f"embedding {name!r}"
    return None


def _is_embedding(module: nn.Module) -> bool:
    """An input embedding: torch's, or one of its own kind that says its full vocabulary
    (``num_embeddings``) beside a 2-D table (Megatron's ``VocabParallelEmbedding``, a shard of it)."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return True
    size, weight = getattr(module, "num_embeddings", None), getattr(module, "weight", None)
    return type(size) is int and isinstance(weight, torch.Tensor) and weight.dim() == 2


def vocab_of(model: nn.Module) -> int | None:
    """The vocabulary size of ``model``'s input embedding, or None when it has none.

    Example:
        >>> vocab_of(nn.Embedding(100, 8))
        100
    """
    found = _resolve_vocab(model, None)
    return found[0] if found is not None else None


# --------------------------------------------------------------------------- one host read


class _Reader:
    """Collects device values so that all of them reach the host in a single read."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._size = 0

    def add(self, value: torch.Tensor) -> slice:
        flat = value.reshape(-1).to(torch.int64)
        start = self._size
        self._parts.append(flat)
        self._size += flat.numel()
        return slice(start, self._size)

    def add_float(self, value: torch.Tensor) -> slice:
        # Carried as float32 bit patterns in the int64 vector: one read, one dtype, and no
        # float64 (which some backends lack).
        return self.add(value.reshape(-1).to(torch.float32).view(torch.int32))

    def read(self) -> list[int]:
        if not self._parts:
            return []
        target = next((p.device for p in self._parts if p.device.type != "cpu"), torch.device("cpu"))
        return torch.cat([p.to(target) for p in self._parts]).tolist()


def _as_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def _count(flags: torch.Tensor) -> torch.Tensor:
    """Set flags, counted on the device: ``bool.sum()`` would first copy the flags to int64 (8x)."""
    return torch.count_nonzero(flags)


def _row_flags(bad: torch.Tensor) -> torch.Tensor | None:
    """Per-sample flags along dim 0, or None for a 0-d tensor."""
    if bad.ndim == 0:
        return None
    return bad if bad.ndim == 1 else bad.flatten(1).any(1)


def _first_indices(flags: torch.Tensor, offset: int = 0, pad: int | None = None) -> torch.Tensor:
    """``offset`` plus the indices of the first MAX_LISTED set flags, padded with ``pad`` (default
    len(flags)); no host sync, and temporaries of one chunk at a time."""
    n = flags.numel()
    pad = n if pad is None else pad
    picks = []
    step = max(CHUNK_ELEMENTS // 8, 1)  # the indices are int64
    for start in range(0, max(n, 1), step):
        part = flags[start : start + step]
        index = torch.arange(offset + start, offset + start + part.numel(), device=flags.device)
        index = torch.where(part, index, torch.full_like(index, pad))
        picks.append(index.topk(min(MAX_LISTED, part.numel()), largest=False).values)
    merged = torch.cat(picks)
    return merged.topk(min(MAX_LISTED, merged.numel()), largest=False).values


def _add_rows(reader: _Reader, flags: torch.Tensor | None) -> tuple[slice, slice, int] | None:
    if flags is None:
        return None
    return reader.add(_count(flags)), reader.add(_first_indices(flags)), flags.numel()


class _Samples:
    """Which samples (indices along dim 0) hold a problem, gathered a chunk at a time. A 1-D tensor's
    samples are its elements, each in one chunk: counted as they come, with no flag per element."""

    def __init__(self, t: torch.Tensor) -> None:
        self.ndim = t.ndim
        self.n = t.shape[0] if t.ndim else 0
        self.flags = torch.zeros(self.n, dtype=torch.bool, device=t.device) if t.ndim >= 2 else None
        self.count = torch.zeros((), dtype=torch.int64, device=t.device)
        self.picks: list[torch.Tensor] = []

    def add(self, first: int, part: torch.Tensor | None) -> None:
        if part is None:
            return
        if self.flags is not None:
            self.flags[first : first + part.numel()] |= part
        else:
            self.count += _count(part)
            self.picks.append(_first_indices(part, offset=first, pad=self.n))

    def slots(self, reader: _Reader) -> tuple[slice, slice, int] | None:
        if self.ndim == 0:
            return None
        if self.flags is not None:
            return _add_rows(reader, self.flags)
        merged = torch.cat(self.picks) if self.picks else torch.empty(0, dtype=torch.int64)
        first = merged.topk(min(MAX_LISTED, merged.numel()), largest=False).values
        return reader.add(self.count), reader.add(first), self.n


def _rows(values: list[int], slots: tuple[slice, slice, int] | None) -> tuple[int, list[int]]:
    if slots is None:
        return 0, []
    count, first, n = slots
    return values[count][0], [i for i in values[first] if i < n]


def _listed(count: int, rows: list[int]) -> str:
    more = f" and {count - len(rows)} more" if count > len(rows) else ""
    return f"{rows}{more}"


# --------------------------------------------------------------------------- checks


def _chunks(t: torch.Tensor, limit: int, start: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """(index along dim 0 of ``t``'s caller, view) pieces of at most ``limit`` elements where the
    shape allows: whole rows together, a row too big for one piece split along its own rows."""
    if t.ndim == 0 or t.numel() <= limit:
        yield start, t
        return
    per_row = t[0].numel() if t.shape[0] else 1
    step = limit // max(per_row, 1)
    if step >= 1:
        for i in range(0, t.shape[0], step):
            yield start + i, t[i : i + step]
        return
    for i in range(t.shape[0]):
        for _, piece in _chunks(t[i], limit):
            yield start + i, piece.unsqueeze(0)


def _check_nonfinite(reader: _Reader, where: str, t: torch.Tensor, *, ignore_neginf: bool, per_sample: bool) -> _Done:
    real = torch.view_as_real(t) if t.is_complex() else t
    totals = torch.zeros(4, dtype=torch.int64, device=t.device)
    samples = _Samples(t) if per_sample else None
    # Keep the last dim of a complex tensor's real view whole: it is one value.
    limit = max(CHUNK_ELEMENTS, 2)
    for first, piece in _chunks(real, limit):
        nan, pos, neg = torch.isnan(piece), torch.isposinf(piece), torch.isneginf(piece)
        bad = nan | pos if ignore_neginf else nan | pos | neg
        if t.is_complex():
            bad = bad.any(-1)
        totals += torch.stack([_count(nan), _count(pos), _count(neg), _count(bad)])
        if samples is not None:
            samples.add(first, _row_flags(bad))
    counts = reader.add(totals)
    rows = samples.slots(reader) if samples is not None else None
    shape, dtype = list(t.shape), str(t.dtype).removeprefix("torch.")

    def done(values: list[int]) -> list[Finding]:
        n_nan, n_pos, n_neg, n_bad = values[counts]
        if n_bad == 0:
            return []
        n_rows, first = _rows(values, rows)
        at = f" in samples {_listed(n_rows, first)}" if rows else ""
        return [
            Finding(
                cause="data.nonfinite",
                where=where,
                message=(
                    f"{n_bad} non-finite values ({n_nan} NaN, {n_pos} +Inf, {n_neg} -Inf) "
                    f"in a {dtype} tensor of shape {shape}{at}"
                ),
                fix=(
                    "Trace the sample back through the data pipeline: a division by a zero "
                    "std in normalization, log(0) in preprocessing, or a corrupt file; drop "
                    "or repair it there (torch.nan_to_num only for a known, benign source)."
                ),
                details={
                    "nan": n_nan,
                    "posinf": n_pos,
                    "neginf": n_neg,
                    "numel": t.numel(),
                    "shape": shape,
                    "dtype": dtype,
                    "samples": first,
                    "sample_count": n_rows,
                },
            )
        ]

    return done


def _check_range(
    reader: _Reader,
    where: str,
    t: torch.Tensor,
    vocab: tuple[int, str] | None,
    *,
    ignore_index: int | None,
) -> _Done:
    totals = [torch.zeros((), dtype=torch.int64, device=t.device)]
    lows: list[torch.Tensor] = []
    highs: list[torch.Tensor] = []
    samples = _Samples(t)
    for first, piece in _chunks(t, CHUNK_ELEMENTS):
        if piece.dtype not in (torch.int32, torch.int64):
            piece = piece.to(torch.int64)  # comparisons against a vocab size must not wrap
        bad = piece < 0
        if ignore_index is not None:
            bad &= piece != ignore_index
        if vocab is not None:
            bad |= piece >= vocab[0]
        totals.append(_count(bad))
        lows.append(piece.amin().to(torch.int64))
        highs.append(piece.amax().to(torch.int64))
        samples.add(first, _row_flags(bad))
    slots = reader.add(torch.stack([torch.stack(totals).sum(), torch.stack(lows).amin(), torch.stack(highs).amax()]))
    rows = samples.slots(reader)
    is_labels = ignore_index is not None

    def done(values: list[int]) -> list[Finding]:
        n_bad, low, high = values[slots]
        if n_bad == 0:
            return []
        n_rows, first = _rows(values, rows)
        valid = f"[0, {vocab[0]})" if vocab else "non-negative"
        allowed = f" (or ignore_index {ignore_index})" if is_labels else ""
        at = f"; samples {_listed(n_rows, first)}" if rows else ""
        what = "labels" if is_labels else "ids"
        if is_labels:
            fix = (
                f"Set padding labels to ignore_index ({ignore_index}), not -1 or an id past "
                "the vocabulary, and take labels from the tokenizer the model was built for."
            )
        else:
            fix = (
                "Make the tokenizer and the model agree: call "
                "model.resize_token_embeddings(len(tokenizer)) after adding tokens, pass the "
                "right vocab_size, and make sure the pad id is not -1."
            )
        return [
            Finding(
                cause="data.index_out_of_range",
                where=where,
                message=(f"{n_bad} {what} outside {valid}{allowed}: min {low}, max {high}{at}"),
                fix=fix,
                details={
                    "count": n_bad,
                    "min": low,
                    "max": high,
                    "vocab_size": vocab[0] if vocab else None,
                    "vocab_source": vocab[1] if vocab else None,
                    "ignore_index": ignore_index,
                    "samples": first,
                    "sample_count": n_rows,
                },
            )
        ]

    return done


def _check_targets(reader: _Reader, where: str, t: torch.Tensor, ignore_index: int) -> _Done:
    valid = reader.add(_count(t != ignore_index))

    def done(values: list[int]) -> list[Finding]:
        if values[valid][0] > 0:
            return []
        return [
            Finding(
                cause="data.no_valid_targets",
                where=where,
                message=(
                    f"all {t.numel()} labels equal ignore_index {ignore_index}; a mean loss "
                    "over zero targets is 0/0 = NaN"
                ),
                fix=(
                    f"Skip batches where (labels != {ignore_index}).sum() == 0, check that "
                    "truncation does not cut off every answer token, or use reduction='sum' "
                    "divided by max(count, 1)."
                ),
                details={"numel": t.numel(), "ignore_index": ignore_index},
            )
        ]

    return done


def _check_mask(reader: _Reader, where: str, key: str, t: torch.Tensor, *, inferred: bool = False) -> _Done:
    """``inferred``: ``t`` is read as a mask by its place in an unnamed batch; values other than 0/1
    mean it is not one (no finding), rather than an invalid mask."""
    padding = "padding" in key  # PyTorch's *_key_padding_mask: True/1 means "ignore"
    # A loss mask row of zeros only drops that sample; all zeros leaves no target at all.
    loss = any(word in key for word in ("loss", "label", "target"))
    is_float = t.is_floating_point()
    not01, not_additive, bounds = _mask_value_counts(reader, t, is_float)
    kept = t if t.dtype == torch.bool else t != 0  # True where the mask holds a 1
    binary_masked = kept if padding else ~kept
    full = t.ndim >= 2 and t.shape[0] > 0 and not loss
    reads = _MaskReads(
        where=where,
        t=t,
        inferred=inferred,
        padding=padding,
        is_float=is_float,
        not01=not01,
        not_additive=not_additive,
        bounds=bounds,
        binary_rows=_add_rows(reader, binary_masked.flatten(1).all(1)) if full else None,
        additive_rows=_add_rows(reader, (t != 0).flatten(1).all(1)) if full and is_float else None,
        nothing_kept=reader.add(binary_masked.all()) if loss else None,
    )
    return functools.partial(_mask_findings, reads)


class _MaskReads(NamedTuple):
    """What ``_check_mask`` queued for the batch's one read, and what it knew of the mask."""

    where: str
    t: torch.Tensor
    inferred: bool
    padding: bool
    is_float: bool
    not01: slice | None
    not_additive: slice | None
    bounds: slice | None
    binary_rows: Any
    additive_rows: Any
    nothing_kept: slice | None


def _mask_value_counts(
    reader: _Reader, t: torch.Tensor, is_float: bool
) -> tuple[slice | None, slice | None, slice | None]:
    """Queued: the values neither 0 nor 1, the values neither 0 nor an additive mask's (float), the bounds."""
    if t.dtype == torch.bool:
        return None, None, None
    not01 = reader.add(_count((t != 0) & (t != 1)))
    if is_float:
        not_additive = reader.add(_count(~((t == 0) | (t <= _ADDITIVE_MASKED))))
        return not01, not_additive, reader.add_float(torch.stack([t.amin(), t.amax()])) if t.numel() else None
    return not01, None, reader.add(torch.stack([t.amin(), t.amax()])) if t.numel() else None


def _mask_form(m: _MaskReads, n_not01: int, n_not_additive: int | None) -> tuple[str, Any] | None:
    # HF passes 4D float masks in additive form (0 keep, large negative masked); a 2D
    # float mask is a 0/1 mask cast to float.
    if m.is_float and m.t.ndim >= 3 and n_not_additive == 0:
        return "additive", m.additive_rows
    if n_not01 == 0:
        return "binary", m.binary_rows
    if n_not_additive == 0:
        return "additive", m.additive_rows
    return None


def _mask_findings(m: _MaskReads, values: list[int]) -> list[Finding]:
    t = m.t
    n_not01 = values[m.not01][0] if m.not01 is not None else 0
    n_not_additive = values[m.not_additive][0] if m.not_additive is not None else None
    found = _mask_form(m, n_not01, n_not_additive)
    if found is None:
        return [] if m.inferred else [_invalid_mask(m.where, t, n_not01, values, m.bounds, m.is_float)]
    form, rows = found
    if m.nothing_kept is not None and form == "binary" and values[m.nothing_kept][0]:
        return [_empty_loss_mask(m.where, t)]
    n_rows, first = _rows(values, rows)
    if n_rows == 0 or (m.inferred and n_rows == t.shape[0]):
        return []  # an inferred "mask" of zeros only is more likely token type ids than a batch of empty samples
    return [
        Finding(
            cause="data.fully_masked",
            where=m.where,
            message=(
                f"{n_rows} of {t.shape[0]} samples mask every position: samples "
                f"{_listed(n_rows, first)}; softmax over a fully masked row is 0/0 = NaN"
            ),
            fix=(
                "Drop empty samples (length 0 after truncation or filtering) in the "
                "collate function, or keep at least one attended token per row."
            ),
            details={
                "samples": first,
                "sample_count": n_rows,
                "batch_size": t.shape[0],
                "form": form,
                "padding_convention": m.padding,
            },
        )
    ]


def _empty_loss_mask(where: str, t: torch.Tensor) -> Finding:
    return Finding(
        cause="data.no_valid_targets",
        where=where,
        message=(f"the loss mask excludes all {t.numel()} positions; a mean loss over zero targets is 0/0 = NaN"),
        fix=(
            "Skip batches whose loss mask is all zero, check that truncation keeps the answer "
            "tokens, or divide a summed loss by max(mask.sum(), 1)."
        ),
        details={"numel": t.numel()},
    )


def _invalid_mask(
    where: str,
    t: torch.Tensor,
    count: int,
    values: list[int],
    bounds: slice | None,
    is_float: bool,
) -> Finding:
    low: float | int | None = None
    high: float | int | None = None
    if bounds is not None:
        low, high = (_as_float(v) for v in values[bounds]) if is_float else values[bounds]
    dtype = str(t.dtype).removeprefix("torch.")
    return Finding(
        cause="data.invalid_mask",
        where=where,
        message=(
            f"{count} of {t.numel()} mask values are neither 0 nor 1 "
            f"(min {low}, max {high}, {dtype}) and the mask is not additive (0 / -inf)"
        ),
        fix=(
            "Build masks as bool or 0/1 integers, e.g. (input_ids != pad_id).long(); pass an "
            "additive float mask (0 keep, -inf masked) only where the model expects one."
        ),
        details={"count": count, "min": low, "max": high, "dtype": dtype},
    )
