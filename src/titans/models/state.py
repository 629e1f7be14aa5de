"""`TitansState`, the streaming state of a `TitansLM`, as a first-class value: map over its tensors, grow
or reorder its batch, save and load it.

File format (safetensors): every tensor of the nested per-layer states under a stable dotted name
(``layers.3.memory.weights.1``), plus a JSON header in the safetensors metadata:

    titans.state_format   format version ("1")
    titans.config         the config dict of the model the state belongs to (a model with another config
                          refuses it: `TitansLM.check_state`)
    titans.position       tokens consumed
    titans.layers         one tree per layer: {"type": "MACState", "fields": {...}} where a tensor is
                          {"tensor": name}, a tuple {"tuple": [...]}, and ints / None are themselves
    titans.sha256         digest of every tensor's name, dtype, shape and bytes (catches flipped bits)
    titans.weights        optional: what identifies the weights that wrote the state (`titans read` and
                          `titans generate` record the checkpoint's model.safetensors SHA-256, and warn
                          when a state is continued with other weights of the same config)

A tensor reachable twice (MAC's segment weights are often the memory's current weights) is stored once
and comes back as one tensor. Only registered state classes are rebuilt (`register_state_type`, applied
where each state class is defined; no pickle, no imports named by the file).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import numbers
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from titans._fs import atomic_target, ordinary_mode, safetensors_bytes, save_safetensors
from titans.layers.state_tree import STATE_TYPES, map_tensors, register_state_type
from titans.models.variants import upgrade_layer_states

FORMAT_VERSION = 1
_KEYS = ("titans.state_format", "titans.config", "titans.position", "titans.layers", "titans.sha256")


@dataclass
class TitansState:
    """Per-block streaming states (see each block), the number of tokens consumed, and the config of the
    model they belong to (a state is refused by a model with another config).

    `state.save(path)` / `TitansState.load(path)` persist it (safetensors + a metadata header, see this
    module's docstring).
    """

    layers: list = field(default_factory=list)
    position: int = 0
    config: Mapping | None = None

    def map(self, fn: Callable[[Tensor], Tensor]) -> TitansState:
        """A new state with `fn` applied to every tensor; the position and the config are kept."""
        return TitansState(map_tensors(list(self.layers), fn), self.position, self.config)

    def detach(self) -> TitansState:
        """A copy cut from the autograd graph (e.g. for truncated backprop across calls)."""
        return self.map(Tensor.detach)

    def save(self, path: str | Path) -> Path:
        return save_state(self, path)

    def __reduce__(self):
        """Pickled (`copy.deepcopy`, `pickle`, `torch.save`) with its config as a plain dict, which comes
        back read-only as the model gave it (a `MappingProxyType` does not pickle)."""
        config = None if self.config is None else dict(self.config)
        return _rebuild_state, (self.layers, self.position, config)

    @classmethod
    def load(cls, path: str | Path, map_location: str | torch.device = "cpu") -> TitansState:
        return load_state(path, map_location=map_location)


def _rebuild_state(layers: list, position: int, config: dict | None) -> TitansState:
    """The `TitansState` `TitansState.__reduce__` pickled, its config read-only again."""
    return TitansState(layers, position, None if config is None else MappingProxyType(config))


# Config fields that change neither a state's layout nor what a model computes from it: a state is
# continued by a model whose config differs from its own only in these (`config_differences`).
# name: a label; init_std: the initial weights only; memory_backend: which kernels run the same memory
# (to float rounding, as "auto" picks per device); memory_checkpoint_every: what training keeps for the
# backward pass; memory_monitor_max_norm: monitoring only.
STATE_NEUTRAL_FIELDS = frozenset(
    {"name", "init_std", "memory_backend", "memory_checkpoint_every", "memory_monitor_max_norm"}
)


def config_differences(a: Mapping, b: Mapping) -> list[str]:
    """The config fields, sorted, in which `a` and `b` (config dicts) differ, leaving out
    `STATE_NEUTRAL_FIELDS`: states of configs with no difference are interchangeable."""
    return sorted(k for k in set(a) | set(b) if k not in STATE_NEUTRAL_FIELDS and a.get(k) != b.get(k))


# ------------------------------------------------------------------------------------------ mapping
class StateFileError(ValueError):
    """A state file that cannot be read: missing, truncated, damaged, or not a Titans state."""


def map_state(state: TitansState, fn: Callable[[Tensor], Tensor]) -> TitansState:
    """A new state with `fn` applied to every tensor, e.g. `map_state(s, lambda t: t.to("cuda"))`.

    Ints (positions) and the config are kept; a tensor that appears twice is mapped once.
    """
    if not isinstance(state, TitansState):
        raise TypeError(f"map_state: expected a TitansState, got {type(state).__name__}")
    return state.map(fn)


def state_tensors(state: TitansState) -> dict[str, Tensor]:
    """Every distinct tensor of the state under its stable name (the names a state file uses)."""
    tensors: dict[str, Tensor] = {}
    _encode_layers(state, tensors)
    return tensors


def state_nbytes(state: TitansState) -> int:
    """Bytes of the state's tensors, each distinct tensor once: the memory a state keeps alive between
    calls. (The memory's weights and momentum share one allocation; a MAC state whose current segment
    began inside its last call keeps that segment's starting weights in one with the momentum of that
    moment, at most one more momentum per memory layer than counted here.)"""
    return sum(t.numel() * t.element_size() for t in state_tensors(state).values())


def state_batch_size(state: TitansState) -> int:
    """The batch size of a state (dim 0 of every tensor in it)."""
    sizes = {t.shape[0] for t in state_tensors(state).values() if t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"state_batch_size: the state's tensors disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()


def expand_state(state: TitansState, batch_size: int) -> TitansState:
    """A batch-1 state repeated to `batch_size` independent rows (many samples from one read document)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"expand_state: batch_size must be an int >= 1, got {batch_size!r}")
    batch_size = int(batch_size)
    current = state_batch_size(state)
    if current == batch_size:
        return state
    if current != 1:
        raise ValueError(f"expand_state: only a batch-1 state can be expanded, this one has batch {current}")
    return map_state(state, lambda t: t.expand(batch_size, *t.shape[1:]).contiguous())


def select_rows(state: TitansState, index: Tensor | Sequence[int]) -> TitansState:
    """The rows `index` of every tensor: reorders or subsets the batch (beam search). index: a 1-D integer
    tensor, or a list / tuple / numpy array of row numbers (checked against the batch here; a tensor's
    values are checked by `index_select`, with no host sync)."""
    if not isinstance(index, Tensor):
        rows = index.tolist() if isinstance(index, np.ndarray) else index
        if not isinstance(rows, (list, tuple)) or any(
            isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in rows
        ):
            raise TypeError(
                f"select_rows: index must be a 1-D integer tensor or a list of row numbers, got {index!r}"
            )
        batch = state_batch_size(state)
        bad = [int(i) for i in rows if not 0 <= i < batch]
        if bad:
            raise ValueError(f"select_rows: rows {bad} out of range for a state of batch size {batch}")
        index = torch.tensor([int(i) for i in rows], dtype=torch.int64)
    if index.dim() != 1 or index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise TypeError(
            "select_rows: index must be a 1-D integer tensor of row numbers, got a tensor of shape "
            f"{tuple(index.shape)} and dtype {index.dtype}"
        )
    index = index.long()
    return map_state(state, lambda t: t.index_select(0, index.to(t.device)))


def cat_rows(states: list[TitansState]) -> TitansState:
    """The rows of several states of one model, in order, as one state (the inverse of `select_rows` over a
    split batch). They must be at the same position (a state's position is one int for all its rows)."""
    if not states:
        raise ValueError("cat_rows: no states to join")
    bad = [type(s).__name__ for s in states if not isinstance(s, TitansState)]
    if bad:
        raise TypeError(f"cat_rows: expected TitansStates, got {', '.join(bad)}")
    positions = {s.position for s in states}
    if len(positions) != 1:
        raise ValueError(f"cat_rows: the states are at different positions {sorted(positions)}")
    known = [(i, s.config) for i, s in enumerate(states) if s.config is not None]
    for i, config in known[1:]:
        diff = config_differences(known[0][1], config)
        if diff:
            first = known[0][0]
            detail = ", ".join(
                f"{k}: state {first} {known[0][1].get(k)!r} vs state {i} {config.get(k)!r}" for k in diff
            )
            raise ValueError(f"cat_rows: the states belong to models with other configs ({detail})")
    if len(states) == 1:
        return states[0]
    named = [state_tensors(s) for s in states]
    if any(n.keys() != named[0].keys() for n in named):
        raise ValueError("cat_rows: the states do not have the same structure (states of different models?)")
    for name, t in named[0].items():
        for i, n in enumerate(named[1:], 1):
            u = n[name]
            if u.shape[1:] != t.shape[1:] or u.dim() != t.dim() or u.dtype != t.dtype or u.device != t.device:
                raise ValueError(
                    f"cat_rows: tensor {name} is {_describe(t)} in state 0 but {_describe(u)} in state {i}: "
                    "only the batch (dim 0) may differ"
                )
    by_id = {id(t): name for name, t in named[0].items()}

    def join(t: Tensor) -> Tensor:
        return t if t.dim() == 0 else torch.cat([n[by_id[id(t)]] for n in named])

    joined = map_state(states[0], join)
    if joined.config is None and known:  # labelled with the config the states were checked against
        joined.config = known[0][1]
    return joined


def _describe(t: Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


# ------------------------------------------------------------------------------------------ encoding
def _encode(obj: Any, name: str, tensors: dict[str, Tensor], names: dict[int, str]) -> Any:
    if obj is None or (isinstance(obj, int) and not isinstance(obj, bool)):
        return obj
    if isinstance(obj, Tensor):
        if id(obj) not in names:
            names[id(obj)] = name
            tensors[name] = obj
        return {"tensor": names[id(obj)]}
    if isinstance(obj, tuple):
        return {"tuple": [_encode(v, f"{name}.{i}", tensors, names) for i, v in enumerate(obj)]}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        kind = type(obj).__name__
        if STATE_TYPES.get(kind) is not type(obj):
            raise TypeError(f"save_state: state type {kind} is not registered (see register_state_type)")
        fields = {
            f.name: _encode(getattr(obj, f.name), f"{name}.{f.name}", tensors, names)
            for f in dataclasses.fields(obj)
        }
        return {"type": kind, "fields": fields}
    raise TypeError(f"save_state: cannot store a {type(obj).__name__} (at {name}) in a state file")


def _encode_layers(state: TitansState, tensors: dict[str, Tensor]) -> list:
    names: dict[int, str] = {}
    return [_encode(s, f"layers.{i}", tensors, names) for i, s in enumerate(state.layers)]


def _decode(spec: Any, tensors: dict[str, Tensor], where: str) -> Any:
    if spec is None or (isinstance(spec, int) and not isinstance(spec, bool)):
        return spec
    if isinstance(spec, dict) and set(spec) == {"tensor"}:
        name = spec["tensor"]
        if name not in tensors:
            raise StateFileError(f"{where}: tensor {name!r} is missing from the file")
        return tensors[name]
    if isinstance(spec, dict) and set(spec) == {"tuple"}:
        return tuple(_decode(v, tensors, where) for v in spec["tuple"])
    if isinstance(spec, dict) and set(spec) == {"type", "fields"}:
        cls = STATE_TYPES.get(spec["type"])
        if cls is None:
            known = sorted(STATE_TYPES)
            raise StateFileError(f"{where}: unknown state type {spec['type']!r}; known: {known}")
        expected = {f.name for f in dataclasses.fields(cls)}
        if set(spec["fields"]) != expected:
            raise StateFileError(
                f"{where}: {spec['type']} has fields {sorted(spec['fields'])}, expected {sorted(expected)}"
            )
        return cls(**{k: _decode(v, tensors, where) for k, v in spec["fields"].items()})
    raise StateFileError(f"{where}: malformed state header entry {str(spec)[:80]!r}")


def tensors_digest(tensors: dict[str, Tensor]) -> str:
    """sha256 of every tensor's name, dtype, shape and bytes, in name order (any device or layout)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def state_digest(state: TitansState | None) -> str:
    """sha256 of the state's position and of every tensor's name, dtype, shape and bytes (None: a fresh
    sequence): equal digests, bit-identical states. The state's bytes are not canonical (safetensors orders
    its metadata freely); this is."""
    tensors = {} if state is None else state_tensors(state)
    position = 0 if state is None else state.position
    return hashlib.sha256(f"position={position}|{tensors_digest(tensors)}".encode()).hexdigest()


# ------------------------------------------------------------------------------------------ files
def save_state(state: TitansState, path: str | Path, *, weights: str | None = None) -> Path:
    """Write `state` to `path` (safetensors + JSON header, see the module docstring), atomically;
    `weights`, if given, is recorded as what identifies the model's weights (``titans.weights``).

    Tensors are saved as they are (dtype kept), on CPU. Returns the path. Refuses a state holding NaN or
    inf (ValueError naming the tensor): the memory of a model that diverged is nothing to keep. A write
    that fails (a full disk) raises OSError naming the path, and leaves an existing file at `path` as it was.
    """
    given, path = path, atomic_target(path)  # a symlink's target; not a device or a folder
    tensors, metadata = _file_contents(state, f"save_state: refusing to write {str(given)!r}")
    if weights is not None:
        metadata["titans.weights"] = str(weights)
    try:  # a failure here names `path`, not a hidden temporary file
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise _write_failure(e, path) from e
    os.close(fd)
    try:
        save_safetensors(tensors, tmp, metadata)
        ordinary_mode(tmp)  # mkstemp's file is private (0600)
        os.replace(tmp, path)  # a reader never sees a half-written file
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, Exception):
            raise _write_failure(e, path) from e
        raise
    return Path(given)


def _file_contents(state: TitansState, refusal: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors (independent contiguous CPU copies) and the metadata of a state file; `refusal` starts
    the error for a state holding NaN or inf."""
    if not isinstance(state, TitansState):
        raise TypeError(f"save_state: expected a TitansState, got {type(state).__name__}")
    raw: dict[str, Tensor] = {}
    layers = _encode_layers(state, raw)
    # independent contiguous CPU copies: safetensors refuses views and tensors sharing storage
    tensors = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in raw.items()}
    for name, t in tensors.items():
        if not t.is_floating_point():
            continue
        # pending gates hold log(eta) = -inf where momentum is off (eta = 0 exactly): only NaN and +inf there
        wrong = t.isnan() | (t == float("inf")) if name.endswith("pending_gates") else ~torch.isfinite(t)
        if bool(wrong.any()):
            bad = int(wrong.sum())
            raise ValueError(
                f"{refusal}: the state's tensor {name} holds {bad} NaN or inf values (of {t.numel()}); the "
                "model diverged on the text it read"
            )
    metadata = {
        "format": "pt",
        "titans.state_format": str(FORMAT_VERSION),
        "titans.config": json.dumps(dict(state.config) if state.config is not None else None),
        "titans.position": str(int(state.position)),
        "titans.layers": json.dumps(layers),
        "titans.sha256": tensors_digest(tensors),
    }
    return tensors, metadata


def _write_failure(e: Exception, path: Path) -> OSError:
    """A write error in words: safetensors reports the OS error (a full disk) inside its own message."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None and ("os error 28" in str(e) or "No space left" in str(e)):
        code = errno.ENOSPC
    cause = "the disk is full" if code == errno.ENOSPC else f"the write failed ({type(e).__name__}: {e})"
    message = f"could not write the state to {str(path)!r}: {cause}"
    return OSError(code, message) if code is not None else OSError(message)


def read_state_header(path: str | Path) -> dict[str, Any]:
    """The parsed header of a state file (format, config, position, layers) without loading tensors."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_state: no state file at {str(path)!r}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
    except Exception as e:  # safetensors raises its own error type for truncated / malformed files
        raise StateFileError(
            f"{str(path)!r} is not a readable safetensors file (truncated or damaged?): {e}"
        ) from e
    header = _parse_metadata(meta, repr(str(path)))
    header["tensor_names"] = names
    return header


def _parse_metadata(meta: dict[str, str], where: str) -> dict[str, Any]:
    """The Titans header in a state's safetensors metadata; `where` names the file (or blob) in errors."""
    missing = [k for k in _KEYS if k not in meta]
    if missing:
        raise StateFileError(f"{where} is not a Titans state file: header lacks {missing}")
    if meta["titans.state_format"] != str(FORMAT_VERSION):
        raise StateFileError(
            f"{where}: state format {meta['titans.state_format']!r} is not supported "
            f"(this version reads format {FORMAT_VERSION})"
        )
    try:
        header = {
            "config": json.loads(meta["titans.config"]),
            "position": int(meta["titans.position"]),
            "layers": json.loads(meta["titans.layers"]),
            "sha256": meta["titans.sha256"],
            "weights": meta.get("titans.weights"),
        }
    except (ValueError, TypeError) as e:
        raise StateFileError(f"{where}: damaged state header ({e})") from e
    if not isinstance(header["layers"], list):
        raise StateFileError(f"{where}: damaged state header (titans.layers is not a list)")
    return header


def load_state(path: str | Path, map_location: str | torch.device = "cpu", model=None) -> TitansState:
    """Rebuild the exact `TitansState` saved at `path`, its tensors on `map_location`.

    Refuses a truncated or damaged file (StateFileError naming it). With `model`, also refuses a state
    that belongs to a model with another config (ValueError naming the file and the differing fields).
    """
    from safetensors import safe_open

    path = Path(path)
    header = read_state_header(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in header["tensor_names"]}
    except Exception as e:
        raise StateFileError(f"{str(path)!r}: could not read its tensors (truncated or damaged?): {e}") from e
    return _build_state(header, tensors, repr(str(path)), map_location, model)


def _build_state(
    header: dict[str, Any], tensors: dict[str, Tensor], where: str, map_location, model
) -> TitansState:
    """The state a parsed header and its tensors describe, checked (`load_state`)."""
    layers = [_decode(spec, tensors, f"{where} layer {i}") for i, spec in enumerate(header["layers"])]
    layers = upgrade_layer_states(layers, header["config"])
    used: dict[str, Tensor] = {}
    _encode_layers(TitansState(layers), used)
    extra = sorted(set(tensors) - set(used))
    if extra:
        raise StateFileError(f"{where} holds tensors no layer uses: {extra[:5]}")
    if tensors_digest(tensors) != header["sha256"]:
        raise StateFileError(f"{where} is corrupted: its tensors do not match the header checksum")
    config = header["config"]
    # read-only, as the states a model returns carry it
    state = TitansState(layers, header["position"], None if config is None else MappingProxyType(config))
    if str(map_location) != "cpu":
        state = map_state(state, lambda t: t.to(map_location))
    if model is not None:
        try:
            model.check_state(state)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
    return state


# ------------------------------------------------------------------------------------------ bytes
def state_to_bytes(state: TitansState) -> bytes:
    """`state` as the bytes of a state file (`save_state`'s format), for a database or a network: the same
    checks (a NaN or inf is refused), no file."""
    tensors, metadata = _file_contents(state, "state_to_bytes")
    return safetensors_bytes(tensors, metadata)


def state_from_bytes(
    data: bytes, map_location: str | torch.device = "cpu", model=None, name: str = "state bytes"
) -> TitansState:
    """The state `state_to_bytes` (or a state file's bytes) holds, checked as `load_state` checks a file:
    damaged or truncated bytes raise StateFileError naming `name`; with `model`, a state of another config
    raises ValueError."""
    from safetensors.torch import load

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"state_from_bytes: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    try:
        size = int.from_bytes(data[:8], "little")
        if len(data) < 8 or size > len(data) - 8:
            raise ValueError(f"header of {size} bytes in {len(data)} bytes")
        meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
        tensors = load(data)
    except Exception as e:  # safetensors raises its own error type for truncated / malformed data
        raise StateFileError(
            f"{name} is not a readable safetensors state (truncated or damaged?): {e}"
        ) from e
    return _build_state(_parse_metadata(meta, name), tensors, name, map_location, model)


__all__ = [
    "FORMAT_VERSION",
    "STATE_TYPES",
    "StateFileError",
    "TitansState",
    "cat_rows",
    "STATE_NEUTRAL_FIELDS",
    "config_differences",
    "expand_state",
    "load_state",
    "map_state",
    "read_state_header",
    "register_state_type",
    "save_state",
    "select_rows",
    "state_batch_size",
    "state_digest",
    "state_from_bytes",
    "state_nbytes",
    "state_tensors",
    "state_to_bytes",
]
