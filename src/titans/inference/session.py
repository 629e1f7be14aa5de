"""`MemorySession`: one reader's memory in operation: it learns from what it reads, can be frozen, rolled
back to one of its last snapshots, guarded against harmful writes, and serialised to bytes.

    session = MemorySession(model, snapshots=4, probe=probe_ids, guard_max_rise=0.05)
    result = session.read(tokens)          # the memory learns the text (a ReadResult: loss, report, ...)
    out = session.generate(prompt, 50)     # continues from the memory (reading the prompt into it)
    session.freeze(); session.unfreeze()   # frozen: reads and generation leave the memory bit-identical
    session.rollback(1)                    # the state before the last read or generation, bit for bit
    blob = session.to_bytes(); session = MemorySession.from_bytes(model, blob)

A session holds one stream (batch 1). Every read or generation changes the state: the state before it is
kept as a snapshot (the last `snapshots` of them; snapshot k = 1 is the state before the last change). While
not frozen, a change is also a *write* of the memory. A frozen session runs the model with its memory
read-only (`NeuralMemory.write = False`, on a twin of the model that shares its parameters: other sessions
on the same model are unaffected): the memory's weights, momentum and pending tokens come back
bit-identical, while the position and the attention context (KV cache, window) advance, so the model answers
from attention plus the frozen memory.

The guard (given a `probe` text): after each write, the loss on the probe is measured with the memory
frozen, from the new state (a frozen session writes nothing, so it has nothing to check); measuring it
changes nothing of the session. If it rose by more than `guard_max_rise` (a share: 0.05 = 5%) over the
loss before the write, or is not finite, the write is undone (the snapshot restored) and the session
frozen; a `SessionEvent` records it. Every freeze, unfreeze and rollback is recorded too (`events`).

Not thread-safe: one caller at a time per session (different sessions may run in parallel on one model).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from titans.layers.memory import MemoryStats, NeuralMemory
from titans.models.lm import TitansLM
from titans.models.monitor import MemoryMonitor, MemoryReport, memory_report
from titans.models.state import StateFileError, TitansState, map_state, state_from_bytes, state_to_bytes
from titans.models.streaming import default_piece_len, generate, iter_pieces
from titans.validation import check_int

SESSION_MAGIC = b"TITANS-SESSION\n"
SESSION_FORMAT = 1
DEFAULT_SNAPSHOTS = 4
DEFAULT_GUARD_MAX_RISE = 0.05


class SessionFormatError(StateFileError):
    """Session bytes that cannot be read: truncated, damaged, or not a Titans session."""


class OtherWeightsError(ValueError):
    """Session bytes written through other weights of the model's configuration (another checkpoint): its
    memory was written through their projections, so this model would read it as noise."""


@dataclass(frozen=True)
class SnapshotInfo:
    """A kept state: `rollback(k)` restores it (k = 1: the state before the last read or generation).
    position: tokens it had consumed; created: when it was taken (Unix time); reads: the reads it held."""

    k: int
    position: int
    created: float
    reads: int = 0


@dataclass
class SessionEvent:
    """Something that changed a session's course: kind "freeze", "unfreeze", "rollback" or "guard" (a
    write undone by the guard, which also froze the session). probe_before / probe_after: the guard's probe
    losses (kind "guard")."""

    kind: str
    reason: str
    position: int
    time: float
    probe_before: float | None = None
    probe_after: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (strict JSON: None for a probe loss that is not finite)."""
        out = asdict(self)
        out["probe_before"], out["probe_after"] = map(_finite_or_none, (self.probe_before, self.probe_after))
        return out


def _finite_or_none(v: float | None) -> float | None:
    return v if v is None or math.isfinite(v) else None


@dataclass
class ReadResult:
    """What a read did. tokens: read; position: the session's position after it; loss: mean next-token loss
    over the text's tokens after its first (None for a single token); report: the memory's numbers over the
    text (surprise, write rate, gates) and its state after it; kept: the memory kept what it read (False
    when frozen, which writes nothing, or when the guard undid the write); event: the guard's event when it
    undid the write; stats: the per-token numbers behind the report, one `MemoryStats` per memory layer
    (None for an empty read or a diverged one)."""

    tokens: int
    position: int
    loss: float | None
    report: MemoryReport
    kept: bool
    event: SessionEvent | None = None
    stats: dict[int, MemoryStats] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (strict JSON: None for a number that is not finite)."""
        return {
            "tokens": self.tokens,
            "position": self.position,
            "loss": _finite_or_none(self.loss),
            "kept": self.kept,
            "event": None if self.event is None else self.event.to_dict(),
            "report": self.report.to_dict(),
        }


class SessionParts(list):
    """`MemorySession.to_parts`: the parts of a session's bytes, and `sha256`, the SHA-256 (hex) of their
    joined bytes (`to_bytes`), computed in the pass that makes the bytes' own trailer."""

    def __init__(self, parts: Iterable[bytes | memoryview], sha256: str) -> None:
        super().__init__(parts)
        self.sha256 = sha256


# ------------------------------------------------------------------------------------------ frozen twin
_twins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_twins_lock = threading.Lock()


def frozen_twin(model: TitansLM) -> TitansLM:
    """The model with every memory read-only (`NeuralMemory.write = False`), sharing its parameters and
    buffers (no copy of the weights; training the model changes the twin too). Built once per model."""
    with _twins_lock:
        twin = _twins.get(model)
        if twin is None:
            memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
            # the read-only config mapping cannot be copied; shared, the twin's states carry the model's own
            memo[id(model.config_dict)] = model.config_dict
            memo[id(model.config)] = model.config
            twin = copy.deepcopy(model, memo)
            for module in twin.modules():
                if isinstance(module, NeuralMemory):
                    module.write = False
            _twins[model] = twin
        twin.train(model.training)
        return twin


# ------------------------------------------------------------------------------------------ kept states
@dataclass
class _Kept:
    """A state as a session keeps it, with the counters that go with it: its tensors, its state-file bytes
    (`state_to_bytes`), or both, the one made from the other when first needed. A state read from bytes
    is decoded only when it is used, and bytes already made are reused (a served session is decoded and
    encoded once per request, its snapshots not at all). Nothing read yet: state None, data b""."""

    state: TitansState | None
    data: bytes | memoryview | None  # a memoryview: a read-only view of a session's bytes
    position: int
    reads: int
    tokens_generated: int
    created: float

    def tensors(self, model: TitansLM, device: torch.device | str, what: str) -> TitansState | None:
        if self.state is None and self.data:
            self.state = state_from_bytes(self.data, device, model=model, name=f"session {what}")
        return self.state

    def encoded(self) -> bytes | memoryview:
        if self.data is None:
            self.data = b"" if self.state is None else state_to_bytes(self.state)
        return self.data

    def copy(self) -> _Kept:
        """An independent copy taken now: the bytes when known (immutable), else cloned tensors."""
        if self.data is not None:
            return replace(self, state=None, created=time.time())
        return replace(self, state=map_state(self.state, lambda t: t.clone()), created=time.time())


def _kept(state: TitansState | None, reads: int = 0, tokens_generated: int = 0) -> _Kept:
    position = 0 if state is None else state.position
    return _Kept(state, None if state is not None else b"", position, reads, tokens_generated, time.time())


# ------------------------------------------------------------------------------------------ the session
class MemorySession:
    """A memory in operation (see the module docstring).

    Args:
        model: the `TitansLM` (batch-1 streams; any variant, also the baselines without a memory).
        state: the state to start from (None: a fresh sequence).
        snapshots: how many states before the last changes are kept for `rollback` (>= 0).
        probe: token ids (>= 2) of a fixed probe text; turns the guard on.
        guard_max_rise: the guard undoes a write that raises the probe loss by more than this share.
        frozen: start frozen.
        piece_len: tokens per model call (default `default_piece_len`); results do not depend on it.
        weights: what identifies the model's weights (a checkpoint's `weights_id`), kept in `to_bytes`:
            `from_bytes` for other weights refuses the session (None: not recorded, not checked).

    `events` keeps the latest `max_events` (a class attribute; set it on an instance to change it).
    """

    max_events = 256

    def __init__(
        self,
        model: TitansLM,
        state: TitansState | None = None,
        *,
        snapshots: int = DEFAULT_SNAPSHOTS,
        probe: Tensor | Sequence[int] | None = None,
        guard_max_rise: float = DEFAULT_GUARD_MAX_RISE,
        frozen: bool = False,
        piece_len: int | None = None,
        weights: str | None = None,
    ) -> None:
        if not isinstance(model, TitansLM):
            raise TypeError(f"MemorySession: model must be a TitansLM, got {type(model).__name__}")
        check_int("MemorySession: snapshots", snapshots, minimum=0)
        if isinstance(guard_max_rise, bool) or not isinstance(guard_max_rise, (int, float)):
            raise ValueError(f"MemorySession: guard_max_rise must be a number >= 0, got {guard_max_rise!r}")
        if not 0 <= guard_max_rise < math.inf:
            raise ValueError(f"MemorySession: guard_max_rise must be a number >= 0, got {guard_max_rise!r}")
        if weights is not None and not isinstance(weights, str):
            raise TypeError(f"MemorySession: weights must be a string or None, got {type(weights).__name__}")
        self.model = model
        self.weights = weights
        self.max_snapshots = snapshots
        self.guard_max_rise = float(guard_max_rise)
        self.piece_len = piece_len if piece_len is not None else default_piece_len(model)
        check_int("MemorySession: piece_len", self.piece_len)
        self.probe = None if probe is None else self._tokens(probe, "probe")
        if self.probe is not None and self.probe.shape[1] < 2:
            raise ValueError(
                "MemorySession: the probe needs at least 2 tokens (its loss predicts token 2 on)"
            )
        if state is not None:
            model.check_state(state, 1)
        self._device = next(model.parameters()).device
        self._current = _kept(state)
        self._frozen = bool(frozen)
        self._snapshots: list[_Kept] = []  # oldest first
        self.events: list[SessionEvent] = []  # the latest `max_events`, oldest first
        self._probe_loss: float | None = None  # the probe loss of the current state, once measured
        self.last_report: MemoryReport | None = None
        self._last_stats: dict | None = None

    # ---------------------------------------------------------------------------------------- state
    @property
    def state(self) -> TitansState | None:
        """The current state (None: nothing read yet)."""
        return self._current.tensors(self.model, self._device, "state")

    @property
    def position(self) -> int:
        return self._current.position

    @property
    def reads(self) -> int:
        """Reads (calls of `read` with at least one token) the current state holds; a rollback restores it."""
        return self._current.reads

    @property
    def tokens_generated(self) -> int:
        """Generated tokens the current state holds (the rest of `position` was read or prompted)."""
        return self._current.tokens_generated

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def guarded(self) -> bool:
        return self.probe is not None

    @property
    def snapshots(self) -> list[SnapshotInfo]:
        """The kept states, newest first: `snapshots[i].k == i + 1`."""
        return [
            SnapshotInfo(k, s.position, s.created, s.reads)
            for k, s in enumerate(reversed(self._snapshots), start=1)
        ]

    def freeze(self, reason: str = "requested") -> None:
        """Reads and generation stop writing the memory (a no-op when already frozen)."""
        if not self._frozen:
            self._frozen = True
            self._record("freeze", reason)

    def unfreeze(self, reason: str = "requested") -> None:
        if self._frozen:
            self._frozen = False
            self._record("unfreeze", reason)

    def rollback(self, k: int = 1) -> SnapshotInfo:
        """Restore the state of snapshot k (1: before the last read or generation) bit for bit, with its
        counters; it and the newer snapshots are dropped (rollback(1) twice undoes two changes), the older
        ones kept, the frozen flag left as it is. Returns the restored snapshot's info."""
        check_int("MemorySession.rollback: k", k)
        n = len(self._snapshots)
        if k > n:
            raise ValueError(
                f"MemorySession.rollback: no snapshot {k}: the session keeps {n} snapshots "
                "(k counts back from 1, the state before the last change)"
            )
        info = self.snapshots[k - 1]
        kept = self._snapshots[-k]
        kept.tensors(self.model, self._device, f"snapshot {k}")  # a damaged one fails before anything changes
        self._current = kept
        del self._snapshots[-k:]
        self._probe_loss = None
        self._record("rollback", f"restored snapshot {k} (position {info.position})")
        return info

    def info(self) -> dict[str, Any]:
        """The session at a glance, JSON-ready: position, reads, tokens_generated, frozen, guarded,
        guard_max_rise, probe_loss (as last measured; None before), max_snapshots, snapshots, events and the
        memory report."""
        return {
            "position": self.position,
            "reads": self.reads,
            "tokens_generated": self.tokens_generated,
            "frozen": self._frozen,
            "guarded": self.guarded,
            "guard_max_rise": self.guard_max_rise,
            "probe_loss": _finite_or_none(self._probe_loss),
            "max_snapshots": self.max_snapshots,
            "snapshots": [asdict(s) for s in self.snapshots],
            "events": [e.to_dict() for e in self.events],
            "report": self.report().to_dict(),
        }

    def report(self) -> MemoryReport:
        """The memory's numbers: the last read's token statistics (None before one) and the current state's
        norms."""
        return memory_report(self.model, self._last_stats, self._state_or_empty())

    # ---------------------------------------------------------------------------------------- reading
    @torch.no_grad()
    def read(self, tokens: Tensor | Sequence[int]) -> ReadResult:
        """The memory reads `tokens` ((T,) or (1, T) ids): it learns them unless frozen. See `ReadResult`."""
        tokens = self._tokens(tokens, "read")
        if tokens.shape[1] == 0:
            return ReadResult(0, self.position, None, self.report(), kept=False)

        def read(model, state):
            new_state, loss, stats = self._run(model, tokens, state)
            return new_state, (loss, stats), 0

        event, payload = self._change(read, reads=1)
        loss, stats = payload if payload is not None else (None, None)
        kept = event is None and not self._frozen
        return self._result(tokens, loss, stats, kept=kept, event=event)

    @torch.no_grad()
    def generate(self, prompt: Tensor | Sequence[int], max_new_tokens: int, **sampling: Any) -> Tensor:
        """Continue `prompt` from the session's memory (`titans.models.streaming.generate`; `sampling`:
        temperature, top_k, top_p, greedy, stop_tokens, generator). Returns (1, T + n) ids. The prompt and
        the generated tokens are read into the state (a change, kept as a snapshot); unfrozen, they are
        written into the memory too (a write, guarded)."""
        prompt = self._tokens(prompt, "generate")
        for key in ("state", "return_state"):
            if key in sampling:
                raise TypeError(f"MemorySession.generate: {key} is the session's own")

        def continuation(model, state):
            out, new_state = generate(
                model, prompt, max_new_tokens, state=state, return_state=True, **sampling
            )
            return new_state, out, out.shape[1] - prompt.shape[1]

        _, out = self._change(continuation, reads=0)
        if out is None:  # the guard undid a write that diverged: no continuation to return
            raise FloatingPointError(f"MemorySession.generate: {self.events[-1].reason}")
        return out

    def probe_loss(self) -> float | None:
        """The mean next-token loss on the probe with the memory frozen, from the current state (None without
        a probe). Cached until the state changes."""
        if self.probe is None:
            return None
        if self._probe_loss is None:
            self._probe_loss = self._measure_probe(self.state)
        return self._probe_loss

    # ---------------------------------------------------------------------------------------- bytes
    def to_bytes(self, snapshots: bool = True) -> bytes:
        """The session as bytes: its state, settings, events and (with `snapshots`) its snapshots, each
        state in the state-file format (`state_to_bytes`), the whole under a SHA-256. Refuses a state with
        NaN or inf (ValueError)."""
        return b"".join(self.to_parts(snapshots))

    def to_parts(self, snapshots: bool = True) -> SessionParts:
        """`to_bytes` before it is joined: [header, state, ..., state, SHA-256], joined by ``b"".join``
        (a `SessionParts`: a list that also knows the SHA-256 of the joined bytes). A state read by
        `from_bytes` and not changed since is a read-only view of the bytes it was read from (not a copy):
        a caller that stores the parts separately (a server) copies none of them."""
        blobs: list[bytes | memoryview] = []

        def put(kept: _Kept) -> dict[str, Any]:
            data = kept.encoded()
            if data:
                blobs.append(data)
            return {
                "state": len(blobs) - 1 if data else None,
                "position": kept.position,
                "reads": kept.reads,
                "tokens_generated": kept.tokens_generated,
                "created": kept.created,
            }

        current = put(self._current)
        header = {
            "format": SESSION_FORMAT,
            "weights": self.weights,
            **current,
            "frozen": self._frozen,
            "max_snapshots": self.max_snapshots,
            "guard_max_rise": self.guard_max_rise,
            "piece_len": self.piece_len,
            "probe": None if self.probe is None else self.probe[0].tolist(),
            "probe_loss": _finite_or_none(self._probe_loss),  # a cache: one not finite is measured again
            "events": [asdict(e) for e in self.events],
            "snapshots": [put(s) for s in (self._snapshots if snapshots else [])],
            "blobs": [len(b) for b in blobs],
        }
        head = json.dumps(header).encode()
        head = b"".join([SESSION_MAGIC, len(head).to_bytes(8, "little"), head])
        digest = hashlib.sha256(head)
        for blob in blobs:  # hashed piece by piece: the states are not copied here
            digest.update(blob)
        trailer = digest.digest()
        digest.update(trailer)  # the same pass gives the SHA-256 of the whole
        return SessionParts([head, *blobs, trailer], digest.hexdigest())

    @classmethod
    def from_bytes(
        cls,
        model: TitansLM,
        data: bytes,
        map_location: str | torch.device | None = None,
        *,
        verified: bool = False,
        check_snapshots: bool = False,
        weights: str | None = None,
    ) -> MemorySession:
        """The session `to_bytes` wrote, for `model` (its tensors on `map_location`, default the model's
        device). Damaged or truncated bytes raise SessionFormatError; a session of a model with another
        config raises ValueError. verified: the caller has checked these bytes against a checksum of its
        own (a store's), so their SHA-256 is not computed again. check_snapshots: decode the snapshots now
        too (bytes from elsewhere, an upload): a damaged one raises StateFileError here, not when rolled
        back to, and each takes its position from its state, as the current state always does. weights:
        the model's (`MemorySession`): a session recorded with other weights raises OtherWeightsError; one
        recorded without takes these."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"MemorySession.from_bytes: expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if not data.startswith(SESSION_MAGIC):
            raise SessionFormatError("session bytes: not a Titans session (wrong magic)")
        body, digest = memoryview(data)[:-32], data[-32:]  # a view: each state is copied out once
        if len(data) < len(SESSION_MAGIC) + 40 or (not verified and hashlib.sha256(body).digest() != digest):
            raise SessionFormatError("session bytes: corrupted or truncated (checksum mismatch)")
        start = len(SESSION_MAGIC)
        size = int.from_bytes(body[start : start + 8], "little")
        if start + 8 + size > len(body):
            raise SessionFormatError("session bytes: damaged header (its size runs past the end)")
        header = _session_header(bytes(body[start + 8 : start + 8 + size]), model.config.vocab_size)
        blobs, pos = [], start + 8 + size
        for n in header["blobs"]:  # views of `data` (immutable bytes): a state is copied when decoded
            blobs.append(body[pos : pos + n])
            pos += n
        if pos != len(body):
            raise SessionFormatError("session bytes: blob sizes do not add up")

        def get(entry: dict[str, Any]) -> _Kept:
            index = entry["state"]
            return _Kept(
                None,
                b"" if index is None else blobs[index],
                entry.get("position", 0),
                entry.get("reads", 0),
                entry.get("tokens_generated", 0),
                float(entry.get("created", 0.0)),
            )

        wrote = header.get("weights")
        if weights is not None and wrote is not None and wrote != weights:
            raise OtherWeightsError(
                f"session bytes: written by other weights of this configuration (model.safetensors sha256 "
                f"{wrote[:12]}..., this model's {weights[:12]}...)"
            )
        current = get(header)
        snapshots = [get(s) for s in header["snapshots"]]
        session = cls(
            model,
            snapshots=header["max_snapshots"],
            probe=header["probe"],
            guard_max_rise=header["guard_max_rise"],
            frozen=header["frozen"],
            piece_len=header["piece_len"],
            weights=wrote if wrote is not None else weights,
        )
        if map_location is not None:
            session._device = torch.device(map_location)
        state = current.tensors(model, session._device, "state")  # decoded now: another model's is refused
        if state is not None:
            current.position = state.position
            model.check_state(state, 1)
        session._current = current
        for i, kept in enumerate(snapshots if check_snapshots else []):
            snapshot = kept.tensors(model, session._device, f"snapshot {len(snapshots) - i}")
            if snapshot is not None:
                model.check_state(snapshot, 1)
                kept.position, kept.state = snapshot.position, None  # checked; decoded again if used
        for kept in [current, *snapshots]:  # the positions now those of the decoded states
            if kept.tokens_generated > kept.position:
                raise _damaged("tokens_generated", "at most the position of its state")
        session._snapshots = snapshots  # decoded when rolled back to
        session.events = [SessionEvent(**e) for e in header["events"]]
        session._probe_loss = None if header["probe_loss"] is None else float(header["probe_loss"])
        return session

    # ---------------------------------------------------------------------------------------- internals
    def _tokens(self, tokens: Tensor | Sequence[int], what: str) -> Tensor:
        """(T,) / (1, T) ids or a list of ints -> (1, T) int64 on the model's device, range-checked."""
        if isinstance(tokens, Tensor):
            t = tokens
        elif isinstance(tokens, Iterable) and not isinstance(tokens, (str, bytes)):
            items = list(tokens)
            if any(isinstance(i, bool) or not isinstance(i, int) for i in items):
                raise TypeError(f"MemorySession.{what}: token ids must be ints")
            t = torch.tensor(items, dtype=torch.int64)
        else:
            raise TypeError(
                f"MemorySession.{what}: expected token ids (a tensor or a list of ints), "
                f"got {type(tokens).__name__}"
            )
        if t.dim() == 1:
            t = t.unsqueeze(0)
        if t.dim() != 2 or t.shape[0] != 1:
            raise ValueError(
                f"MemorySession.{what}: a session reads one stream: ids (T,) or (1, T), got {tuple(t.shape)}"
            )
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"MemorySession.{what}: token ids must be integers, got dtype {t.dtype}")
        vocab = self.model.config.vocab_size
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
            lo, hi = int(t.min()), int(t.max())
            raise ValueError(f"MemorySession.{what}: token ids must lie in [0, {vocab}), got [{lo}, {hi}]")
        return t.to(next(self.model.parameters()).device, torch.int64)

    @torch.no_grad()
    def _run(self, model: TitansLM, tokens: Tensor, state: TitansState | None):
        """Feed tokens (1, T) piece by piece from `state`: (new state, mean next-token loss, layer stats)."""
        monitor = MemoryMonitor(self.model)
        total, count, last = 0.0, 0, None
        for piece in iter_pieces(tokens, self.piece_len):
            out = model.forward_with_stats(piece, state)
            state = out.state
            monitor.update(out.stats)
            logits = out.logits[0].float()
            if last is not None:  # the previous piece's last logits predict this piece's first token
                logits = torch.cat([last[None], logits])
                targets = piece[0]
            else:
                targets = piece[0, 1:]
            n = targets.numel()
            if n:
                total += float(F.cross_entropy(logits[:n], targets, reduction="sum"))
                count += n
            last = out.logits[0, -1].float()
        return state, (total / count if count else None), monitor.layer_stats()

    def _measure_probe(self, state: TitansState | None) -> float:
        """The probe loss from `state`, the memory frozen (NaN where the state holds non-finite values)."""
        try:
            _, loss, _ = self._run(frozen_twin(self.model), self.probe, state)
        except ValueError as e:  # a state with NaN weights feeds NaN to the next layer's memory
            if "non-finite" not in str(e):
                raise
            return float("nan")
        return float("nan") if loss is None else loss

    def _change(
        self, fn: Callable[[TitansLM, TitansState | None], tuple[TitansState | None, Any, int]], reads: int
    ) -> tuple[SessionEvent | None, Any]:
        """Run fn(model, state) -> (new state, payload, tokens generated) as a change of the state: the state
        before it kept as a snapshot; the memory read-only when frozen, else written and guarded. Returns
        (the guard's event or None, payload)."""
        before = self._current
        guard = self.guarded and not self._frozen
        probe_before = self.probe_loss() if guard else None
        model = frozen_twin(self.model) if self._frozen else self.model
        state = before.tensors(self.model, self._device, "state")
        snapshot = before.copy()
        diverged = None
        try:
            new_state, payload, generated = fn(model, state)
        except ValueError as e:  # the memory refuses to go on from a non-finite value: the write diverged
            if not guard or "non-finite" not in str(e):
                raise
            new_state, payload, generated, diverged = state, None, 0, str(e)
        self._current = _kept(new_state, before.reads + reads, before.tokens_generated + generated)
        self._probe_loss = None
        after = None
        if guard:
            after = self._measure_probe(new_state) if diverged is None else float("nan")
            limit = probe_before * (1 + self.guard_max_rise) if math.isfinite(probe_before) else math.inf
        if not guard or (math.isfinite(after) and after <= limit):
            # the oldest snapshot goes only for a write that stays (an undone write leaves them as they are)
            self._snapshots.append(snapshot)
            del self._snapshots[: max(0, len(self._snapshots) - self.max_snapshots)]
            self._probe_loss = after
            return None, payload
        # undo: the state before the write (kept even with snapshots=0), and freeze
        self._current = before
        self._probe_loss = probe_before
        self._frozen = True
        if diverged is not None:
            why = "the write diverged (the memory met a non-finite value)"
        elif math.isfinite(after) and probe_before:
            rise = (after - probe_before) / abs(probe_before)
            why = f"the probe loss rose by {rise:.1%} (limit {self.guard_max_rise:.1%})"
        else:
            why = f"the probe loss became {after}"
        event = self._record(
            "guard",
            f"{why}: write undone, session frozen",
            probe_before=probe_before,
            probe_after=after,
        )
        return event, payload

    def _record(self, kind: str, reason: str, **extra: float | None) -> SessionEvent:
        event = SessionEvent(kind, reason, self.position, time.time(), **extra)
        self.events.append(event)
        # the events travel in the session's bytes on every change: a long-lived session keeps its latest
        del self.events[: -self.max_events]
        return event

    def _state_or_empty(self) -> TitansState:
        state = self.state
        return state if state is not None else TitansState([], 0, self.model.config_dict)

    def _result(self, tokens, loss, stats, kept, event=None) -> ReadResult:
        self._last_stats = stats
        report = memory_report(self.model, stats, self._state_or_empty())
        self.last_report = report
        return ReadResult(tokens.shape[1], self.position, loss, report, kept, event, stats)


# ------------------------------------------------------------------------------------------ the header
_COUNT_MAX = (1 << 63) - 1  # counters, sizes and ids as an int64 holds them
_KEPT_FIELDS = ("position", "reads", "tokens_generated")  # counts; with "state" and "created", per state
_EVENT_FIELDS = {f.name for f in dataclasses.fields(SessionEvent)}


def _damaged(field: str, rule: str) -> SessionFormatError:
    """The error of a header field that breaks its rule (the field named, its value never quoted)."""
    return SessionFormatError(f"session bytes: damaged header ({field} must be {rule})")


def _is_count(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= _COUNT_MAX


def _is_number(value: Any, finite: bool = True) -> bool:
    """A JSON number (not a boolean), finite when asked; an integer too large for a float is none."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        value = float(value)
    except OverflowError:
        return False
    return math.isfinite(value) or not finite


def _session_header(raw: bytes, vocab_size: int) -> dict[str, Any]:
    """The JSON header of session bytes, every field checked for its type and range (SessionFormatError
    naming the first one that is not as `to_parts` writes it): what `from_bytes` builds the session from
    can then only fail on the states' own bytes."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested too deeply
        raise SessionFormatError("session bytes: damaged header (not JSON)") from None
    if not isinstance(header, dict):
        raise SessionFormatError("session bytes: damaged header (not a JSON object)")
    fmt = header.get("format")
    if not _is_count(fmt):
        raise _damaged("format", "an integer")
    if fmt != SESSION_FORMAT:
        raise SessionFormatError(
            f"session bytes: format {fmt} is not supported (this version reads format {SESSION_FORMAT})"
        )
    for name in ("blobs", "snapshots", "events"):
        if not isinstance(header.get(name), list):
            raise _damaged(name, "a list")
    if not isinstance(header.get("weights"), (str, type(None))):
        raise _damaged("weights", "a string or null")
    if not all(_is_count(n) for n in header["blobs"]):
        raise _damaged("blobs", "a list of sizes (integers >= 0)")
    blobs = len(header["blobs"])
    kept = [("the current state", header)]
    for i, entry in enumerate(header["snapshots"]):
        if not isinstance(entry, dict):
            raise _damaged(f"snapshots[{i}]", "an object")
        kept.append((f"snapshots[{i}]", entry))
    for where, entry in kept:
        if "state" not in entry:
            raise _damaged(f"{where}: state", "present (a blob index or null)")
        index = entry["state"]
        if index is not None and not (_is_count(index) and index < blobs):
            raise _damaged(f"{where}: state", f"null or the index of one of the {blobs} blobs")
        for name in _KEPT_FIELDS:
            if name in entry and not _is_count(entry[name]):
                raise _damaged(f"{where}: {name}", "an integer >= 0")
        if index is None and entry.get("position", 0) != 0:  # nothing read yet
            raise _damaged(f"{where}: position", "0 where there is no state")
        if "created" in entry and not (_is_number(entry["created"]) and entry["created"] >= 0):
            raise _damaged(f"{where}: created", "a time (a finite number >= 0)")
        if entry.get("tokens_generated", 0) > entry.get("position", 0):  # generated tokens were read too
            raise _damaged(f"{where}: tokens_generated", "at most its position")
    used = sorted(entry["state"] for _, entry in kept if entry["state"] is not None)
    if used != list(range(blobs)):  # `to_parts` writes one blob per state: any other is not a state's
        raise _damaged("blobs", "one per state (no blob shared by two states or of none)")
    for name in ("max_snapshots", "piece_len", "probe", "guard_max_rise", "frozen", "probe_loss"):
        if name not in header:
            raise _damaged(name, "present")
    if not _is_count(header["max_snapshots"]):
        raise _damaged("max_snapshots", "an integer >= 0")
    if not _is_count(header["piece_len"], minimum=1):
        raise _damaged("piece_len", "an integer >= 1")
    probe = header["probe"]
    if probe is not None and not (
        isinstance(probe, list) and len(probe) >= 2 and all(_is_count(t) and t < vocab_size for t in probe)
    ):
        raise _damaged("probe", f"null or a list of at least 2 token ids in [0, {vocab_size})")
    if not (_is_number(header["guard_max_rise"]) and header["guard_max_rise"] >= 0):
        raise _damaged("guard_max_rise", "a finite number >= 0")
    if not isinstance(header["frozen"], bool):
        raise _damaged("frozen", "true or false")
    if header["probe_loss"] is not None and not _is_number(header["probe_loss"]):
        raise _damaged("probe_loss", "a finite number or null")
    for i, event in enumerate(header["events"]):
        if not (
            isinstance(event, dict) and {"kind", "reason", "position", "time"} <= set(event) <= _EVENT_FIELDS
        ):
            raise _damaged(
                f"events[{i}]", "an object of kind, reason, position, time, probe_before, probe_after"
            )
        if not (isinstance(event["kind"], str) and isinstance(event["reason"], str)):
            raise _damaged(f"events[{i}]: kind and reason", "texts")
        if not _is_count(event["position"]):
            raise _damaged(f"events[{i}]: position", "an integer >= 0")
        if not _is_number(event["time"]):
            raise _damaged(f"events[{i}]: time", "a finite number")
        for name in ("probe_before", "probe_after"):  # a guard's losses: NaN or infinity when it diverged
            value = event.get(name)
            if value is not None and not _is_number(value, finite=False):
                raise _damaged(f"events[{i}]: {name}", "a number or null")
    return header


__all__ = [
    "DEFAULT_GUARD_MAX_RISE",
    "DEFAULT_SNAPSHOTS",
    "MemorySession",
    "OtherWeightsError",
    "ReadResult",
    "SessionEvent",
    "SessionFormatError",
    "SessionParts",
    "SnapshotInfo",
    "frozen_twin",
]
