"""`MemorySession`: one reader's memory in operation: it learns from what it reads, can be frozen, rolled
back to one of its last snapshots, guarded against harmful writes, and serialised to bytes.

    session = MemorySession(model, snapshots=4, probe=probe_ids, guard_max_rise=0.05)
    result = session.read(tokens)          # the memory learns the text (a ReadResult: loss, report, ...)
    out = session.generate(prompt, 50)     # continues from the memory (reading the prompt into it)
    session.freeze(); session.unfreeze()   # frozen: reads and generation leave the state bit-identical
    session.rollback(1)                    # the state before the last write, bit for bit
    blob = session.to_bytes(); session = MemorySession.from_bytes(model, blob)

A session holds one stream (batch 1). Every call that changes the state (a read or a generation while not
frozen) is a *write*: the state before it is kept as a snapshot (the last `snapshots` of them). A frozen
session runs the model with its memory read-only (`NeuralMemory.write = False`, on a twin of the model that
shares its parameters: other sessions on the same model are unaffected) and then drops the new state, so
nothing of what it reads stays: attention context included.

The guard (given a `probe` text): after each write, the loss on the probe is measured with the memory
frozen, from the new state. If it rose by more than `guard_max_rise` (a share: 0.05 = 5%) over the loss
before the write, or is not finite, the write is undone (the snapshot restored) and the session frozen; a
`SessionEvent` records it. Every freeze, unfreeze and rollback is recorded too (`events`).

Not thread-safe: one caller at a time per session (different sessions may run in parallel on one model).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from titans.layers.memory import NeuralMemory
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


@dataclass(frozen=True)
class SnapshotInfo:
    """A kept state: `rollback(k)` restores it (k = 1: the state before the last write). position: tokens
    it had consumed; created: when it was taken (Unix time)."""

    k: int
    position: int
    created: float


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
    text (surprise, write rate, gates) and its state after it; kept: the new state was kept (False when
    frozen or rolled back by the guard); event: the guard's event when it undid the write."""

    tokens: int
    position: int
    loss: float | None
    report: MemoryReport
    kept: bool
    event: SessionEvent | None = None

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
            proxy = getattr(model, "_config_dict", None)
            if proxy is not None:  # the read-only config mapping cannot be copied; it is shared as well
                memo[id(proxy)] = proxy
            twin = copy.deepcopy(model, memo)
            for module in twin.modules():
                if isinstance(module, NeuralMemory):
                    module.write = False
            _twins[model] = twin
        twin.train(model.training)
        return twin


# ------------------------------------------------------------------------------------------ the session
class MemorySession:
    """A memory in operation (see the module docstring).

    Args:
        model: the `TitansLM` (batch-1 streams; any variant, also the baselines without a memory).
        state: the state to start from (None: a fresh sequence).
        snapshots: how many states before the last writes are kept for `rollback` (>= 0).
        probe: token ids (>= 2) of a fixed probe text; turns the guard on.
        guard_max_rise: the guard undoes a write that raises the probe loss by more than this share.
        frozen: start frozen.
        piece_len: tokens per model call (default `default_piece_len`); results do not depend on it.
    """

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
    ) -> None:
        if not isinstance(model, TitansLM):
            raise TypeError(f"MemorySession: model must be a TitansLM, got {type(model).__name__}")
        check_int("MemorySession: snapshots", snapshots, minimum=0)
        if isinstance(guard_max_rise, bool) or not isinstance(guard_max_rise, (int, float)):
            raise ValueError(f"MemorySession: guard_max_rise must be a number >= 0, got {guard_max_rise!r}")
        if not 0 <= guard_max_rise < math.inf:
            raise ValueError(f"MemorySession: guard_max_rise must be a number >= 0, got {guard_max_rise!r}")
        self.model = model
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
        self._state = state
        self._frozen = bool(frozen)
        self._snapshots: list[tuple[TitansState | None, float]] = []  # oldest first
        self.events: list[SessionEvent] = []
        self._probe_loss: float | None = None  # the probe loss of the current state, once measured
        self.last_report: MemoryReport | None = None
        self._last_stats: dict | None = None

    # ---------------------------------------------------------------------------------------- state
    @property
    def state(self) -> TitansState | None:
        """The current state (None: nothing read yet)."""
        return self._state

    @property
    def position(self) -> int:
        return 0 if self._state is None else self._state.position

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
            SnapshotInfo(k, 0 if s is None else s.position, created)
            for k, (s, created) in enumerate(reversed(self._snapshots), start=1)
        ]

    def freeze(self, reason: str = "requested") -> None:
        """Reads and generation stop changing the state (a no-op when already frozen)."""
        if not self._frozen:
            self._frozen = True
            self._record("freeze", reason)

    def unfreeze(self, reason: str = "requested") -> None:
        if self._frozen:
            self._frozen = False
            self._record("unfreeze", reason)

    def rollback(self, k: int = 1) -> SnapshotInfo:
        """Restore the state of snapshot k (1: before the last write), bit for bit; it and the newer
        snapshots are dropped (rollback(1) twice undoes two writes). Returns the restored snapshot's info."""
        check_int("MemorySession.rollback: k", k)
        if k > len(self._snapshots):
            raise ValueError(
                f"MemorySession.rollback: k={k}, but the session keeps {len(self._snapshots)} snapshots"
            )
        info = self.snapshots[k - 1]
        self._state = self._snapshots[-k][0]
        del self._snapshots[-k:]
        self._probe_loss = None
        self._record("rollback", f"restored snapshot {k} (position {info.position})")
        return info

    def info(self) -> dict[str, Any]:
        """The session at a glance, JSON-ready: position, frozen, guarded, guard_max_rise, probe_loss (as
        last measured; None before), max_snapshots, snapshots, events and the memory report."""
        return {
            "position": self.position,
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
        if self._frozen:
            _, loss, stats = self._run(frozen_twin(self.model), tokens, self._state)
            return self._result(tokens, loss, stats, self._state, kept=False)

        def write(state):
            new_state, loss, stats = self._run(self.model, tokens, state)
            return new_state, (loss, stats)

        event, payload = self._write(write)
        loss, stats = payload if payload is not None else (None, None)
        return self._result(tokens, loss, stats, self._state, kept=event is None, event=event)

    @torch.no_grad()
    def generate(self, prompt: Tensor | Sequence[int], max_new_tokens: int, **sampling: Any) -> Tensor:
        """Continue `prompt` from the session's memory (`titans.models.streaming.generate`; `sampling`:
        temperature, top_k, top_p, greedy, stop_tokens, generator). Returns (1, T + n) ids. Unfrozen, the
        prompt and the generated tokens are read into the state (a write, guarded); frozen, nothing is
        kept."""
        prompt = self._tokens(prompt, "generate")
        for key in ("state", "return_state"):
            if key in sampling:
                raise TypeError(f"MemorySession.generate: {key} is the session's own")
        if self._frozen:
            return generate(frozen_twin(self.model), prompt, max_new_tokens, state=self._state, **sampling)

        def write(state):
            out, new_state = generate(
                self.model, prompt, max_new_tokens, state=state, return_state=True, **sampling
            )
            return new_state, out

        _, out = self._write(write)
        if out is None:  # the guard undid a write that diverged: no continuation to return
            raise FloatingPointError(f"MemorySession.generate: {self.events[-1].reason}")
        return out

    def probe_loss(self) -> float | None:
        """The mean next-token loss on the probe with the memory frozen, from the current state (None without
        a probe). Cached until the state changes."""
        if self.probe is None:
            return None
        if self._probe_loss is None:
            self._probe_loss = self._measure_probe(self._state)
        return self._probe_loss

    # ---------------------------------------------------------------------------------------- bytes
    def to_bytes(self, snapshots: bool = True) -> bytes:
        """The session as bytes: its state, settings, events and (with `snapshots`) its snapshots, each
        state in the state-file format (`state_to_bytes`), the whole under a SHA-256. Refuses a state with
        NaN or inf (ValueError)."""
        blobs: list[bytes] = []

        def put(state: TitansState | None) -> int | None:
            if state is None:
                return None
            blobs.append(state_to_bytes(state))
            return len(blobs) - 1

        header = {
            "format": SESSION_FORMAT,
            "state": put(self._state),
            "frozen": self._frozen,
            "max_snapshots": self.max_snapshots,
            "guard_max_rise": self.guard_max_rise,
            "piece_len": self.piece_len,
            "probe": None if self.probe is None else self.probe[0].tolist(),
            "probe_loss": self._probe_loss,
            "events": [asdict(e) for e in self.events],
            "snapshots": [
                {"state": put(s), "created": created} for s, created in (self._snapshots if snapshots else [])
            ],
            "blobs": [len(b) for b in blobs],
        }
        head = json.dumps(header).encode()
        body = SESSION_MAGIC + len(head).to_bytes(8, "little") + head + b"".join(blobs)
        return body + hashlib.sha256(body).digest()

    @classmethod
    def from_bytes(
        cls, model: TitansLM, data: bytes, map_location: str | torch.device | None = None
    ) -> MemorySession:
        """The session `to_bytes` wrote, for `model` (its tensors on `map_location`, default the model's
        device). Damaged or truncated bytes raise SessionFormatError; a session of a model with another
        config raises ValueError."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"MemorySession.from_bytes: expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if not data.startswith(SESSION_MAGIC):
            raise SessionFormatError("session bytes: not a Titans session (wrong magic)")
        body, digest = data[:-32], data[-32:]
        if len(data) < len(SESSION_MAGIC) + 40 or hashlib.sha256(body).digest() != digest:
            raise SessionFormatError("session bytes: corrupted or truncated (checksum mismatch)")
        start = len(SESSION_MAGIC)
        size = int.from_bytes(body[start : start + 8], "little")
        try:
            header = json.loads(body[start + 8 : start + 8 + size])
            if header.get("format") != SESSION_FORMAT:
                raise SessionFormatError(f"session bytes: format {header.get('format')!r} is not supported")
            offsets, pos = [], start + 8 + size
            for n in header["blobs"]:
                offsets.append((pos, pos + n))
                pos += n
            if pos != len(body):
                raise SessionFormatError("session bytes: blob sizes do not add up")
        except (ValueError, KeyError, TypeError) as e:
            if isinstance(e, SessionFormatError):
                raise
            raise SessionFormatError(f"session bytes: damaged header ({e})") from e
        device = map_location if map_location is not None else next(model.parameters()).device

        def get(index: int | None, what: str) -> TitansState | None:
            if index is None:
                return None
            a, b = offsets[index]
            return state_from_bytes(body[a:b], device, model=model, name=f"session {what}")

        session = cls(
            model,
            get(header["state"], "state"),
            snapshots=header["max_snapshots"],
            probe=header["probe"],
            guard_max_rise=header["guard_max_rise"],
            frozen=header["frozen"],
            piece_len=header["piece_len"],
        )
        session._snapshots = [
            (get(s["state"], f"snapshot {i}"), s["created"]) for i, s in enumerate(header["snapshots"])
        ]
        session.events = [SessionEvent(**e) for e in header["events"]]
        session._probe_loss = header["probe_loss"]
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

    def _write(self, fn):
        """Run fn(state) -> (new state, payload) as a write: snapshot, apply, guard. Returns (event or None,
        payload)."""
        before = self._state
        probe_before = self.probe_loss() if self.guarded else None
        snapshot = None if before is None else map_state(before, lambda t: t.clone())
        diverged = None
        try:
            new_state, payload = fn(before)
        except ValueError as e:  # the memory refuses to go on from a non-finite value: the write diverged
            if not self.guarded or "non-finite" not in str(e):
                raise
            new_state, payload, diverged = before, None, str(e)
        self._snapshots.append((snapshot, time.time()))
        del self._snapshots[: max(0, len(self._snapshots) - self.max_snapshots)]
        self._state = new_state
        self._probe_loss = None
        if not self.guarded:
            return None, payload
        after = self._measure_probe(new_state) if diverged is None else float("nan")
        limit = probe_before * (1 + self.guard_max_rise) if math.isfinite(probe_before) else math.inf
        if math.isfinite(after) and after <= limit:
            self._probe_loss = after
            return None, payload
        # undo: the state before the write (kept even with snapshots=0), and freeze
        if self.max_snapshots:
            self._snapshots.pop()
        self._state = snapshot
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
        return event

    def _state_or_empty(self) -> TitansState:
        return self._state if self._state is not None else TitansState([], 0, self.model.config_dict)

    def _result(self, tokens, loss, stats, state, kept, event=None) -> ReadResult:
        self._last_stats = stats
        report = memory_report(self.model, stats, state if state is not None else self._state_or_empty())
        self.last_report = report
        return ReadResult(tokens.shape[1], self.position, loss, report, kept, event)


__all__ = [
    "DEFAULT_GUARD_MAX_RISE",
    "DEFAULT_SNAPSHOTS",
    "MemorySession",
    "ReadResult",
    "SessionEvent",
    "SessionFormatError",
    "SnapshotInfo",
    "frozen_twin",
]
