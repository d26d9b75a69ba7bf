"""Repro bundles: one captured step on disk, and its replay.

A bundle is a directory ``run_dir/bundles/step-{step:08d}-rank-{rank}/`` with two or three files:

- ``meta.json``: the format marker and version, step, rank, torch version, creation time,
  the caller's fields (``diagnosis``, ``loss_tail``, ...) and a description of the batch's
  structure. Each tensor leaf names its key in the tensors file, e.g. ``"batch['input_ids']"``.
- ``tensors.safetensors``: the batch tensors (unless the batch was over the size limit, in
  which case only shapes and dtypes are kept) and the RNG states under ``rng/{device}``.
  ``meta.json``'s ``checksums`` holds its SHA-256, so a flipped byte is found on load.
- ``weights.safetensors`` (optional): the model's parameters and buffers under their
  ``state_dict`` names, a plain safetensors state dict. ``meta.json``'s ``weights`` says whether
  they are there, how large they are, and why not; it is read only by ``Bundle.load_weights()``.

Loading never unpickles and never imports code named by the bundle. Containers come back
as plain ``dict``/``list``/``tuple``: a dataclass or mapping class is recorded by name only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanguard import tree
from nanguard._io import atomic_dir, clean_stale_temps, file_mode, fsync_file
from nanguard.errors import BundleError
from nanguard.findings import Diagnosis, jsonable
from nanguard.rng import fork_rng_state, set_rng_state

__all__ = [
    "FORMAT",
    "MAX_WEIGHTS_BYTES",
    "VERSION",
    "Bundle",
    "bundle_dir",
    "clean_stale_bundles",
    "default_step",
    "load_bundle",
    "replay",
    "save_bundle",
]

FORMAT = "nanguard-bundle"
VERSION = 1
META_FILE = "meta.json"
TENSORS_FILE = "tensors.safetensors"
WEIGHTS_FILE = "weights.safetensors"
MAX_WEIGHTS_BYTES = 2**30
"""The weights limit of ``Guard(bundle_weights=True)``: a larger model's bundles leave them out."""
_RESERVED = frozenset(
    {
        "format",
        "version",
        "step",
        "rank",
        "torch",
        "created",
        "batch",
        "batch_stored",
        "batch_bytes",
        "batch_reason",
        "rng",
        "checksums",
        "weights",
    }
)
# Dtypes safetensors cannot hold go to disk as their raw bytes (uint8) and are viewed back.
_NATIVE_DTYPES = frozenset(
    getattr(safetensors.torch, "_TYPES", {}).values()
    or (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
)


@dataclass
class Bundle:
    """A loaded bundle. ``batch`` holds CPU tensors, or ``meta``-device tensors (shapes and
    dtypes only) when ``batch_stored`` is false. ``meta`` is the whole ``meta.json``."""

    path: Path
    batch: Any
    rng_state: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    diagnosis: Diagnosis | None = None
    batch_stored: bool = True

    @property
    def step(self) -> int:
        return self.meta["step"]

    @property
    def weights_stored(self) -> bool:
        """Whether the bundle carries the model's weights (``Guard(bundle_weights=True)``)."""
        return bool(self.meta.get("weights", {}).get("stored"))

    @property
    def weights_note(self) -> str:
        """Why the weights are not there, or what they are (one rank's shards of a sharded model)."""
        weights = self.meta.get("weights", {})
        return str(weights.get("reason") or weights.get("note") or "")

    def load_weights(self) -> dict[str, torch.Tensor]:
        """The stored parameters and buffers, keyed by ``state_dict`` name, on the CPU.

        Never unpickles. Raises ``BundleError`` naming ``weights.safetensors`` when it is missing,
        corrupt, truncated or changed since it was written, or when the bundle has no weights.

        Example:
            >>> bundle = load_bundle("runs/a/bundles/step-00000812-rank-0")
            >>> if bundle.weights_stored:
            ...     model.load_state_dict(bundle.load_weights())
        """
        return _load_weights(self.path, self.meta)

    @property
    def rank(self) -> int:
        return self.meta["rank"]


def bundle_dir(run_dir: str | os.PathLike[str], step: int, rank: int) -> Path:
    """Where ``save_bundle`` puts the bundle of ``step`` on ``rank``."""
    return Path(run_dir) / "bundles" / f"step-{step:08d}-rank-{rank}"


def clean_stale_bundles(run_dir: str | os.PathLike[str], rank: int) -> list[Path]:
    """Remove the half-written bundle directories a killed run of ``rank`` left; return them.

    Only ``rank``'s own temporaries are touched, so ranks sharing ``run_dir`` can start in any order.

    Example:
        >>> clean_stale_bundles("runs/a", rank=0)
        [PosixPath('runs/a/bundles/.step-00000812-rank-0.3f2a9c1d0b7e.tmp')]
    """
    return clean_stale_temps(Path(run_dir) / "bundles", re.compile(rf"step-\d+-rank-{int(rank)}"))


# --------------------------------------------------------------------------- saving


def save_bundle(
    run_dir: str | os.PathLike[str],
    *,
    step: int,
    rank: int,
    batch: Any,
    rng_state: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any] | None = None,
    max_batch_bytes: int = 64 * 2**20,
    weights: Mapping[str, torch.Tensor] | None = None,
    max_weights_bytes: int = MAX_WEIGHTS_BYTES,
    weights_note: str | None = None,
) -> Path:
    """Write one step's batch, RNG states and ``meta`` atomically; return the bundle dir.

    ``rng_state`` must be the state from *before* the step ran (``rng.get_rng_state()``),
    so a replay draws the same dropout masks. A batch over ``max_batch_bytes`` keeps only
    its shapes and dtypes. ``weights`` (a ``state_dict``, plain tensors) go to
    ``weights.safetensors`` when they fit in ``max_weights_bytes``; otherwise ``meta.json``
    says they were left out and why. ``weights_note`` says what they are when that needs
    saying (one rank's shards). An existing bundle for the same step and rank is replaced.

    Example:
        >>> state = get_rng_state()
        >>> loss = guarded_step(batch)
        >>> save_bundle("runs/a", step=812, rank=0, batch=batch, rng_state=state,
        ...             meta={"diagnosis": diag.to_dict(), "loss_tail": [2.1, 2.0, "nan"]})
        PosixPath('runs/a/bundles/step-00000812-rank-0')
    """
    extra = _extra_meta(step, rank, meta)
    leaves: list[tuple[str, torch.Tensor]] = []
    structure = _describe(batch, "batch", leaves, set())
    batch_bytes = sum(t.numel() * t.element_size() for _, t in leaves)
    stored = batch_bytes <= max_batch_bytes

    tensors: dict[str, torch.Tensor] = {}
    if stored:
        for key, tensor in leaves:
            tensors[key] = _storable(tensor)
    for name, state in rng_state.items():
        tensors[f"rng/{name}"] = _cpu_copy(state)
    weights_record, weight_tensors = _weights_record(weights, max_weights_bytes, weights_note)

    record: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "rank": rank,
        "torch": torch.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "batch_stored": stored,
        "batch_bytes": batch_bytes,
    }
    if not stored:
        record["batch_reason"] = (
            f"batch is {batch_bytes} bytes, over max_batch_bytes={max_batch_bytes}: shapes and dtypes only"
        )
    record["batch"] = structure
    record["rng"] = list(rng_state)
    record["weights"] = weights_record
    record.update(extra)
    json.dumps(jsonable(record), allow_nan=False)  # a meta that cannot be written fails before any file is

    final = bundle_dir(run_dir, step, rank)
    with atomic_dir(final) as tmp:
        save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": "pt"})
        os.chmod(tmp / TENSORS_FILE, file_mode())  # safetensors writes 0600
        record["checksums"] = {TENSORS_FILE: _sha256(tmp / TENSORS_FILE)}
        if weight_tensors is not None:
            save_file(weight_tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            os.chmod(tmp / WEIGHTS_FILE, file_mode())
            record["checksums"][WEIGHTS_FILE] = _sha256(tmp / WEIGHTS_FILE)
            fsync_file(tmp / WEIGHTS_FILE)
        text = json.dumps(jsonable(record), indent=2, allow_nan=False) + "\n"
        (tmp / META_FILE).write_text(text, encoding="utf-8")
        fsync_file(tmp / TENSORS_FILE)
        fsync_file(tmp / META_FILE)
    return final


def _extra_meta(step: int, rank: int, meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """``meta`` as meta.json holds it (a ``Diagnosis`` as its dict), once ``step``, ``rank`` and its keys pass."""
    for name, value in (("step", step), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    extra = dict(meta or {})
    clash = sorted(_RESERVED & extra.keys())
    if clash:
        raise ValueError(f"meta keys {clash} are reserved by the bundle format")
    return {k: v.to_dict() if isinstance(v, Diagnosis) else v for k, v in extra.items()}


def _weights_record(
    weights: Mapping[str, torch.Tensor] | None, max_bytes: int, note: str | None
) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """The ``weights`` entry of meta.json and the tensors to write (None when left out)."""
    if weights is None:
        return {"stored": False, "reason": "not recorded: Guard(bundle_weights=True) records them"}, None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_weights_bytes must be an int >= 0, got {max_bytes!r}")
    for key, value in weights.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ValueError(f"weights must map str names to tensors, got {key!r}: {type(value).__name__}")
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    record: dict[str, Any] = {"stored": nbytes <= max_bytes, "bytes": nbytes, "tensors": len(weights)}
    if note:
        record["note"] = note
    if not record["stored"]:
        record["reason"] = f"the model's state is {nbytes} bytes, over the limit of {max_bytes}: left out"
        return record, None
    raw = {key: [str(t.dtype), list(t.shape)] for key, t in weights.items() if t.dtype not in _NATIVE_DTYPES}
    if raw:
        record["raw"] = raw  # stored as their bytes (uint8), viewed back on load
    return record, {key: _storable(t) for key, t in weights.items()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(2**20):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def _describe(obj: Any, path: str, leaves: list[tuple[str, torch.Tensor]], used: set[str]) -> dict[str, Any]:
    """A JSON node for ``obj``; tensor leaves are appended to ``leaves`` under unique keys."""
    if isinstance(obj, torch.Tensor):
        return _tensor_node(obj, path, leaves, used)
    if _is_ndarray(obj):
        try:
            tensor = torch.as_tensor(obj)
        except (TypeError, RuntimeError):
            return {"type": "repr", "class": _class_name(obj), "value": repr(obj)}
        return {**_tensor_node(tensor, path, leaves, used), "numpy": True}
    items = tree.children(obj)
    if items is not None:
        nodes = [(key, _describe(value, tree.path_str(path, (key,)), leaves, used)) for key, value in items]
        return _container_node(obj, nodes)
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"type": "float", "value": str(obj)}
    if _is_json_scalar(obj):
        return {"type": "value", "value": obj}
    if hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:  # numpy scalars
        return _describe(obj.item(), path, leaves, used)
    return {"type": "repr", "class": _class_name(obj), "value": repr(obj)}


def _container_node(obj: Any, nodes: list[tuple[Any, dict[str, Any]]]) -> dict[str, Any]:
    """The node of a container whose children's nodes are ``nodes``: a list or tuple when its keys are
    positions, else a dict; ``class`` names its type when it is not the plain one."""
    if isinstance(obj, (list, tuple)) or all(isinstance(key, tree.SequenceKey) for key, _ in nodes):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        node: dict[str, Any] = {"type": kind, "items": [n for _, n in nodes]}
        plain: tuple[type, ...] = (list, tuple)
    else:
        node = {"type": "dict", "items": [[jsonable(_json_key(key)), n] for key, n in nodes]}
        plain = (dict,)
    if type(obj) not in plain:
        node["class"] = _class_name(obj)
    return node


def _json_key(key: Any) -> Any:
    """A mapping key as JSON can hold it, or a field's name."""
    if isinstance(key, tree.MappingKey):
        return key.key if _is_json_scalar(key.key) else str(key.key)
    return getattr(key, "name", str(key))


def _tensor_node(
    tensor: torch.Tensor, path: str, leaves: list[tuple[str, torch.Tensor]], used: set[str]
) -> dict[str, Any]:
    key = path
    suffix = 1
    while key in used:
        suffix += 1
        key = f"{path}#{suffix}"
    used.add(key)
    leaves.append((key, tensor))
    node: dict[str, Any] = {
        "type": "tensor",
        "key": key,
        "dtype": str(tensor.dtype),
        "shape": list(tensor.shape),
        "device": str(tensor.device),
    }
    if tensor.requires_grad:
        node["requires_grad"] = True
    if tensor.dtype not in _NATIVE_DTYPES:
        node["stored_as"] = "uint8"
    return node


def _storable(tensor: torch.Tensor) -> torch.Tensor:
    out = _cpu_copy(tensor)
    if out.dtype not in _NATIVE_DTYPES:
        out = out.reshape(-1).view(torch.uint8)
    return out


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy with storage of its own: safetensors refuses shared storage."""
    tensor = tensor.detach()
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    out.copy_(tensor)
    return out


def _is_json_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value))


def _is_ndarray(obj: Any) -> bool:
    return type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray"


def _class_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


# --------------------------------------------------------------------------- loading


class _Malformed(Exception):
    """A node of the batch description in meta.json is not what the writer produces."""


def load_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Read a bundle directory (or its ``meta.json``). Never unpickles, never imports.

    Raises ``BundleError`` naming the file when the bundle is missing, corrupt, truncated,
    foreign, or refers to tensors its tensors file lacks.

    Example:
        >>> bundle = load_bundle("runs/a/bundles/step-00000812-rank-0")
        >>> bundle.step, bundle.diagnosis.cause, bundle.batch["input_ids"].shape
        (812, 'data.index_out_of_range', torch.Size([8, 128]))
    """
    root = Path(path)
    if root.is_file() and root.name in (META_FILE, TENSORS_FILE):
        root = root.parent
    if not root.exists():
        raise BundleError(root, "no such bundle directory")
    if not root.is_dir():
        raise BundleError(root, "not a bundle directory (expected meta.json and tensors file)")

    meta_path = root / META_FILE
    meta = _read_meta(meta_path)
    stored = meta["batch_stored"]
    tensors_path = root / TENSORS_FILE
    if not tensors_path.is_file():
        raise BundleError(tensors_path, "missing: the bundle has no tensors file")
    if meta.get("weights", {}).get("stored") and not (root / WEIGHTS_FILE).is_file():
        raise BundleError(root / WEIGHTS_FILE, "missing: meta.json says the bundle carries the weights")
    verified = _verify(tensors_path, meta.get("checksums", {}).get(TENSORS_FILE))
    try:
        opened = safe_open(str(tensors_path), framework="pt")
    except Exception as err:
        raise BundleError(tensors_path, f"corrupt or truncated safetensors file: {err}") from None
    with opened as handle:
        try:
            # A tensors file that passed its checksum is as written: a disagreement is meta.json's fault.
            reader = _TensorReader(handle, tensors_path, meta_path if verified else tensors_path)
            batch = _build(meta["batch"], reader, stored)
            rng_state = {name: reader.get(f"rng/{name}", "torch.uint8") for name in meta["rng"]}
        except BundleError:
            raise
        except _Malformed as err:
            raise BundleError(meta_path, f"malformed batch description: {err}") from None
        except Exception as err:  # the reader names the tensors file itself: anything else is meta.json's
            raise BundleError(meta_path, f"malformed batch description: {type(err).__name__}: {err}") from None

    return Bundle(
        path=root,
        batch=batch,
        rng_state=rng_state,
        meta=meta,
        diagnosis=_read_diagnosis(meta, meta_path),
        batch_stored=stored,
    )


_META_FIELDS: tuple[tuple[str, Any, Callable[[Any], bool], str], ...] = (
    ("step", None, lambda v: isinstance(v, int), "'step' missing or not int"),
    ("rank", None, lambda v: isinstance(v, int), "'rank' missing or not int"),
    ("batch_stored", None, lambda v: isinstance(v, bool), "'batch_stored' missing or not bool"),
    ("batch", None, lambda v: isinstance(v, dict), "'batch' description missing"),
    (
        "rng",
        None,
        lambda v: isinstance(v, list) and all(isinstance(name, str) for name in v),
        "'rng' must be a list of device names",
    ),
    (
        "weights",
        {},
        lambda v: isinstance(v, dict) and isinstance(v.get("stored", False), bool),
        "'weights' must be an object with a bool 'stored'",
    ),
    (
        "checksums",
        {},
        lambda v: isinstance(v, dict) and all(isinstance(s, str) for s in v.values()),
        "'checksums' must map file names to 'sha256:<hex>'",
    ),
)
"""The fields of meta.json a reader relies on: (name, its value when absent, the check, what is wrong otherwise)."""


def _read_meta(meta_path: Path) -> dict[str, Any]:
    meta = _read_json(meta_path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise BundleError(meta_path, f'not a nanguard bundle: no "format": {FORMAT!r} marker')
    version = meta.get("version")
    if version != VERSION or isinstance(version, bool):
        raise BundleError(meta_path, f"bundle format version {version!r} is not supported (reads {VERSION})")
    for name, absent, valid, problem in _META_FIELDS:
        if not valid(meta.get(name, absent)):
            raise BundleError(meta_path, f"malformed: {problem}")
    return meta


def _read_json(meta_path: Path) -> Any:
    if not meta_path.is_file():
        raise BundleError(meta_path, "missing: this directory is not a nanguard bundle")
    try:
        raw = meta_path.read_bytes()
    except OSError as err:
        raise BundleError(meta_path, f"cannot be read: {err.strerror}") from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise BundleError(meta_path, f"not valid JSON, corrupt or truncated: {err}") from None


def _verify(path: Path, expected: str | None) -> bool:
    """True when ``path`` matches its checksum; False when there is none (bundles written before
    checksums existed are read unchecked)."""
    if expected is None:
        return False
    try:
        actual = _sha256(path)
    except OSError as err:
        raise BundleError(path, f"cannot be read: {err.strerror}") from None
    if actual != expected:
        raise BundleError(path, "checksum mismatch: the file changed after it was written (corrupted on disk?)")
    return True


def _load_weights(root: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    path = root / WEIGHTS_FILE
    record = meta.get("weights", {})
    if not record.get("stored"):
        reason = record.get("reason") or "written before bundles could carry them"
        raise BundleError(root, f"the bundle carries no weights ({reason})")
    if not path.is_file():
        raise BundleError(path, "missing: meta.json says the bundle carries the weights")
    _verify(path, meta.get("checksums", {}).get(WEIGHTS_FILE))
    raw = record.get("raw", {})
    if not isinstance(raw, dict):
        raise BundleError(root / META_FILE, "malformed: 'weights.raw' must map names to [dtype, shape]")
    try:
        opened = safe_open(str(path), framework="pt")
    except Exception as err:
        raise BundleError(path, f"corrupt or truncated safetensors file: {err}") from None
    state: dict[str, torch.Tensor] = {}
    with opened as handle:
        for key in handle.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
            try:
                tensor = handle.get_tensor(key)
            except Exception as err:
                raise BundleError(path, f"corrupt or truncated safetensors file: {err}") from None
            state[key] = _view_raw(tensor, raw[key], key, root / META_FILE) if key in raw else tensor
    missing = sorted(raw.keys() - state.keys())
    if missing or len(state) != record.get("tensors", len(state)):
        raise BundleError(path, f"holds {len(state)} tensors, meta.json says {record.get('tensors')}")
    return state


def _view_raw(tensor: torch.Tensor, spec: Any, key: str, meta_path: Path) -> torch.Tensor:
    """A tensor saved as its bytes, viewed back as the dtype and shape meta.json records."""
    ok = isinstance(spec, list) and len(spec) == 2 and isinstance(spec[1], list)
    dtype = getattr(torch, str(spec[0]).removeprefix("torch."), None) if ok else None
    if not isinstance(dtype, torch.dtype) or not all(isinstance(n, int) and n >= 0 for n in spec[1]):
        raise BundleError(meta_path, f"malformed: 'weights.raw' entry of {key!r} is {spec!r:.80}")
    nbytes = math.prod(spec[1]) * torch.empty((), dtype=dtype).element_size()
    if tensor.dtype != torch.uint8 or list(tensor.shape) != [nbytes]:
        raise BundleError(meta_path, f"weight {key!r} is {tensor.dtype} {list(tensor.shape)}, not {nbytes} raw bytes")
    return tensor.view(dtype).reshape(spec[1])


def _read_diagnosis(meta: dict[str, Any], meta_path: Path) -> Diagnosis | None:
    data = meta.get("diagnosis")
    if data is None:
        return None
    try:
        if not isinstance(data, dict):
            raise TypeError(f"expected an object, got {type(data).__name__}")
        return Diagnosis.from_dict(data)
    except (TypeError, ValueError) as err:
        # A newer nanguard may know causes this one does not: keep the batch replayable.
        warnings.warn(
            f"{meta_path}: 'diagnosis' could not be read ({err}); it stays in bundle.meta",
            UserWarning,
            stacklevel=3,
        )
        return None


class _TensorReader:
    def __init__(self, handle: Any, path: Path, blame: Path) -> None:
        self._handle = handle
        self._path = path
        self._blame = blame  # the file named when meta.json and the tensors disagree
        self._keys = set(handle.keys())

    def get(self, key: str, dtype: str, shape: list[int] | None = None) -> torch.Tensor:
        if key not in self._keys:
            raise BundleError(self._blame, f"tensor {key!r} named in meta.json is missing from {TENSORS_FILE}")
        try:
            tensor = self._handle.get_tensor(key)
        except Exception as err:
            raise BundleError(self._path, f"corrupt or truncated safetensors file: {err}") from None
        if str(tensor.dtype) != dtype or (shape is not None and list(tensor.shape) != shape):
            raise BundleError(
                self._blame,
                f"tensor {key!r} is {tensor.dtype} {list(tensor.shape)}, meta.json says {dtype} {shape}",
            )
        return tensor


def _build(node: Any, reader: _TensorReader, stored: bool) -> Any:
    if not isinstance(node, dict) or not isinstance(node.get("type"), str):
        raise _Malformed(f"node {node!r:.80} has no 'type'")
    builder = _BUILDERS.get(node["type"])
    if builder is None:
        raise _Malformed(f"unknown node type {node['type']!r}")
    return builder(node, reader, stored)


def _build_dict(node: dict[str, Any], reader: _TensorReader, stored: bool) -> dict[Any, Any]:
    items = node.get("items")
    if not isinstance(items, list) or not all(
        isinstance(p, list) and len(p) == 2 and _is_json_scalar(p[0]) for p in items
    ):
        raise _Malformed("a dict node needs 'items' as [key, node] pairs")
    return {key: _build(value, reader, stored) for key, value in items}


def _build_sequence(node: dict[str, Any], reader: _TensorReader, stored: bool) -> list[Any] | tuple[Any, ...]:
    kind, items = node["type"], node.get("items")
    if not isinstance(items, list):
        raise _Malformed(f"a {kind} node needs 'items'")
    values = [_build(value, reader, stored) for value in items]
    return tuple(values) if kind == "tuple" else values


def _build_value(node: dict[str, Any], reader: _TensorReader, stored: bool) -> Any:
    value = node.get("value")
    if not _is_json_scalar(value):
        raise _Malformed(f"value {value!r:.80} is not a JSON scalar")
    return value


def _build_float(node: dict[str, Any], reader: _TensorReader, stored: bool) -> float:
    try:
        return float(node["value"])
    except (KeyError, TypeError, ValueError):
        raise _Malformed(f"bad float node {node!r:.80}") from None


def _build_repr(node: dict[str, Any], reader: _TensorReader, stored: bool) -> str:
    return str(node.get("value"))


def _build_tensor(node: dict[str, Any], reader: _TensorReader, stored: bool) -> Any:
    key, dtype_name, shape = node.get("key"), node.get("dtype"), node.get("shape")
    if not isinstance(key, str) or not isinstance(shape, list):
        raise _Malformed(f"tensor node {node!r:.80} needs 'key' and 'shape'")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise _Malformed(f"tensor {key!r} has a bad shape {shape!r:.80}")
    dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise _Malformed(f"tensor {key!r} has an unknown dtype {dtype_name!r}")
    if not stored:
        return torch.empty(shape, dtype=dtype, device="meta")
    if node.get("stored_as") == "uint8":
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        raw = reader.get(key, "torch.uint8", [nbytes])
        tensor = raw.view(dtype).reshape(shape)
    else:
        tensor = reader.get(key, str(dtype), shape)
    if node.get("requires_grad") and (tensor.is_floating_point() or tensor.is_complex()):
        tensor.requires_grad_(True)
    return tensor.numpy() if node.get("numpy") else tensor


_BUILDERS: dict[str, Callable[[dict[str, Any], _TensorReader, bool], Any]] = {
    "tensor": _build_tensor,
    "dict": _build_dict,
    "list": _build_sequence,
    "tuple": _build_sequence,
    "value": _build_value,
    "float": _build_float,
    "repr": _build_repr,
}
"""Each node type of the batch description (``_describe`` writes them) and what builds its value back."""


# --------------------------------------------------------------------------- replay


def default_step(model: torch.nn.Module) -> Callable[[Any], torch.Tensor]:
    """A closure ``step(batch)``: zero grads, run ``model`` on the batch, backward the loss.

    A dict batch is passed as keyword arguments, a list or tuple as positional ones, anything
    else as the one argument. The loss is the output if it is a 0-dim tensor, else its
    ``loss`` key or attribute, else the last 0-dim tensor of a tuple output, else the mean
    of the first floating-point tensor in the output.

    Example:
        >>> step = default_step(model)
        >>> loss = step({"input_ids": ids, "labels": ids})
    """

    def step(batch: Any) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        if isinstance(batch, Mapping):
            output = model(**batch)
        elif isinstance(batch, (list, tuple)):
            output = model(*batch)
        else:
            output = model(batch)
        loss = _find_loss(output)
        if loss.requires_grad:
            loss.backward()
        return loss

    return step


def _find_loss(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor) and output.ndim == 0:
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if isinstance(getattr(output, "loss", None), torch.Tensor):
        return output.loss
    values: list[Any]
    if isinstance(output, Mapping):
        values = list(output.values())
    elif isinstance(output, (list, tuple)):
        values = list(output)
        scalars = [v for v in values if isinstance(v, torch.Tensor) and v.ndim == 0]
        if scalars:
            return scalars[-1]
    else:
        values = [output]
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.mean()
    raise TypeError(
        f"cannot find a loss in the model's output ({type(output).__name__}): pass a step function that returns it"
    )


def replay(
    bundle: Bundle,
    model: torch.nn.Module | None,
    fn: Callable[[Any], Any] | None = None,
    *,
    locate_fn: Callable[..., Diagnosis | None] | None = None,
) -> Diagnosis | None:
    """Re-run the bundle's step under ``locate`` with the RNG states it was captured with.

    ``fn(batch)`` defaults to ``default_step(model)``. The batch is copied to the device of
    the model's first parameter. The caller's RNG states are put back afterwards.

    Example:
        >>> diag = replay(load_bundle(path), model)
        >>> print(diag)
    """
    if not isinstance(bundle, Bundle):
        raise ValueError(f"bundle must be a Bundle from load_bundle(path), got {type(bundle).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if fn is not None and not callable(fn):
        raise ValueError(f"fn must be callable or None, got {type(fn).__name__}")
    if not bundle.batch_stored:
        raise BundleError(bundle.path, "batch not stored: shapes only (it was over max_batch_bytes)")
    if locate_fn is None:
        from nanguard.tracer import locate

        locate_fn = locate
    if fn is None:
        if model is None:
            raise ValueError("replay needs a model or a step function fn")
        fn = default_step(model)
    batch = _copy_to(bundle.batch, _model_device(model))
    with fork_rng_state():
        try:
            set_rng_state(bundle.rng_state)
        except ValueError as err:
            raise BundleError(bundle.path / TENSORS_FILE, str(err)) from None
        return locate_fn(fn, batch, model=model)


def _model_device(model: torch.nn.Module | None) -> torch.device | None:
    if model is None:
        return None
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return None


def _copy_to(obj: Any, device: torch.device | None) -> Any:
    """A fresh copy of the batch, so a step that edits it in place cannot change the bundle."""
    return tree.map_leaves(lambda leaf: _copy_leaf(leaf, device), obj)


def _copy_leaf(obj: Any, device: torch.device | None) -> Any:
    if isinstance(obj, torch.Tensor):
        copy = obj.detach().to(device or obj.device, copy=True)
        return copy.requires_grad_(obj.requires_grad)
    if _is_ndarray(obj):
        return obj.copy()
    return obj
