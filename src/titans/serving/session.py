"""One served memory: a model state that reads text, generates from it, can be frozen, and rolled back.

This is the only module of `titans.serving` that touches the model. The server uses a session through
this small interface and nothing else, so another session class with the same methods can replace it:

    session = MemorySession.new(engine)                      # or MemorySession.from_bytes(data, engine)
    stats = session.read(token_ids)                          # the memory learns them -> stats dict
    text = session.generate("Q: ...", max_new_tokens=64)     # reads the prompt, then continues it
    session.freeze(); session.unfreeze(); session.frozen
    session.snapshots()                                      # [{"index": 0, ...}, ...] newest first
    session.rollback(k)                                      # back to snapshot k (0: before the last change)
    session.stats()                                          # counters, the last read's stats, a digest
    data = session.to_bytes()

Every read or generate first keeps the state it started from as snapshot 0 (the last `max_snapshots`
are kept). A frozen session still reads (its attention sees the text, its position advances, and the
surprise is measured), but its memory is not written: the model's frozen twin (`write=False`, the same
parameters) computes it, so the memory's weights and momentum come back bit-identical.

Bytes (`to_bytes`): ``MAGIC``, a little-endian u64 header length, the JSON header (counters, the frozen
flag, the size and counters of every blob), then the blobs: the current state and each snapshot, every
one in the state-file format of `titans.models.state` (with its own checksum). An empty session (no
token read yet) has an empty current blob.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from titans.data.tokenizers import Tokenizer
from titans.layers.memory import NeuralMemory
from titans.models.lm import TitansLM
from titans.models.state import (
    StateFileError,
    TitansState,
    state_from_bytes,
    state_tensors,
    state_to_bytes,
)
from titans.models.streaming import default_piece_len, generate, iter_pieces

MAGIC = b"TTNSESS1"
SESSION_FORMAT = 1
DEFAULT_MAX_SNAPSHOTS = 8


class SessionDataError(ValueError):
    """Session bytes that cannot be read back: truncated, damaged, or from another model."""


class Engine:
    """What every session of a server shares: the model, its frozen twin, the tokenizer.

    model: a `TitansLM` in eval mode. The frozen twin shares its parameters (no copy of the weights) and
    differs only in its memories' `write` flag, so one server can run frozen and live sessions in parallel
    without flipping a flag on a shared module.
    """

    def __init__(
        self, model: TitansLM, tokenizer: Tokenizer, *, max_snapshots: int = DEFAULT_MAX_SNAPSHOTS
    ) -> None:
        if max_snapshots < 0:
            raise ValueError(f"max_snapshots must be >= 0, got {max_snapshots}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_snapshots = max_snapshots
        self.frozen_model = _frozen_twin(self.model)
        self.piece_len = default_piece_len(self.model)
        self.vocab_size = int(model.config.vocab_size)
        self.device = next(model.parameters()).device

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def check_tokens(self, ids: list[int]) -> None:
        """Refuse ids the model cannot embed, naming the first one (a tokenizer larger than the model)."""
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"token id {t} (token {i} of the text) is outside the model's vocabulary "
                    f"[0, {self.vocab_size}): the text holds symbols this model cannot read"
                )


def _frozen_twin(model: TitansLM) -> TitansLM:
    """A copy of `model` sharing its parameters and buffers, with every memory read-only."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    config_dict = model.config_dict  # one read-only mapping, shared: states pass both models' checks
    memo[id(config_dict)] = config_dict
    memo[id(model.config)] = model.config
    twin = copy.deepcopy(model, memo)
    for module in twin.modules():
        if isinstance(module, NeuralMemory):
            module.write = False
    return twin.eval()


@dataclass
class _Snapshot:
    data: bytes  # the state's bytes (empty: no state yet), decoded only on rollback
    position: int
    reads: int
    tokens_read: int
    tokens_generated: int
    taken: float


def _quantile(ordered: Tensor, q: float) -> float:
    """The q-quantile of sorted values (linear interpolation, as numpy's default)."""
    pos = q * (ordered.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, ordered.numel() - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def read_stats(stats: list, tokens: int) -> dict[str, Any]:
    """The surprise and gate statistics of one read: every memory call's MemoryStats pooled (all memory
    layers, heads and tokens)."""
    if not stats:
        return {"tokens": tokens}
    surprise = torch.cat([s.surprise.detach().float().reshape(-1) for s in stats]).sort().values
    theta = torch.cat([s.theta.detach().float().reshape(-1) for s in stats])
    eta = torch.cat([s.eta.detach().float().reshape(-1) for s in stats])
    alpha = torch.cat([s.alpha.detach().float().reshape(-1) for s in stats])
    return {
        "tokens": tokens,
        "surprise": {
            "mean": float(surprise.mean()),
            "p50": _quantile(surprise, 0.5),
            "p95": _quantile(surprise, 0.95),
            "max": float(surprise.max()),
        },
        "theta_mean": float(theta.mean()),
        "eta_mean": float(eta.mean()),
        "alpha_mean": float(alpha.mean()),
    }


def state_digest(state: TitansState | None) -> str:
    """sha256 of the state's position and every tensor's name, dtype, shape and bytes: equal digests,
    bit-identical states (the state's encoded bytes are not canonical: safetensors orders its metadata
    freely)."""
    h = hashlib.sha256(f"position={state.position if state is not None else 0}|".encode())
    if state is not None:
        for name, t in sorted(state_tensors(state).items()):
            t = t.detach().cpu().contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def memory_norms(state: TitansState | None) -> list[float]:
    """||W|| (all weight tensors of the memory together, batch row 0) of every memory layer of `state`."""
    if state is None:
        return []
    norms = []
    for layer in state.layers:
        memory = getattr(layer, "memory", None)
        if memory is not None:
            total = sum(float(w[0].double().pow(2).sum()) for w in memory.weights)
            norms.append(total**0.5)
    return norms


class MemorySession:
    """One session's state, its snapshots and its counters (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._state: TitansState | None = None
        self._state_bytes: bytes | None = b""  # cached encoding of _state (None: not encoded yet)
        self._frozen = False
        self._snapshots: list[_Snapshot] = []  # newest first
        self.reads = 0
        self.tokens_read = 0
        self.tokens_generated = 0
        self.rollbacks = 0
        self.created = time.time()
        self.last_read: dict[str, Any] | None = None

    @classmethod
    def new(cls, engine: Engine) -> MemorySession:
        return cls(engine)

    # ------------------------------------------------------------------ the interface
    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def position(self) -> int:
        return self._state.position if self._state is not None else 0

    def freeze(self) -> None:
        self._frozen = True

    def unfreeze(self) -> None:
        self._frozen = False

    @torch.no_grad()
    def read(self, tokens: list[int] | Tensor) -> dict[str, Any]:
        """The memory reads `tokens` (ids, 1-D); returns the read's statistics (see `read_stats`)."""
        ids = tokens.reshape(-1).tolist() if isinstance(tokens, Tensor) else list(tokens)
        if not ids:
            raise ValueError("read: the text holds no tokens")
        self.engine.check_tokens(ids)
        self._push_snapshot()
        stats = self._read_ids(ids)
        self.reads += 1
        self.tokens_read += len(ids)
        self.last_read = {**read_stats(stats, len(ids)), "frozen": self._frozen}
        return {**self.last_read, "position": self.position}

    @torch.no_grad()
    def generate(
        self,
        prompt: str | list[int],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        greedy: bool = False,
        seed: int | None = None,
        stop_at_eos: bool = True,
    ) -> str:
        """Read `prompt` into the memory, then continue it by up to `max_new_tokens` tokens; the memory
        reads the generated tokens too (the state kept is the one after the whole exchange). Returns the
        generated text (without the prompt)."""
        ids = self.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("generate: the prompt holds no tokens (the next token is predicted from it)")
        self.engine.check_tokens(ids)
        model = self.engine.frozen_model if self._frozen else self.engine.model
        device = self.engine.device
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        eos = self.engine.tokenizer.eos_id if stop_at_eos else None
        self._push_snapshot()
        # all but the last prompt token through the read path (with its statistics): streaming equals one
        # pass, so this is the same as generating from the whole prompt
        if len(ids) > 1:
            self.last_read = {**read_stats(self._read_ids(ids[:-1]), len(ids) - 1), "frozen": self._frozen}
        out, state = generate(
            model,
            torch.tensor([ids[-1:]], dtype=torch.int64, device=device),
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            greedy=greedy,
            generator=generator,
            stop_tokens=eos,
            state=self._state,
            return_state=True,
        )
        self._set_state(state)
        new = out[0, 1:].tolist()
        self.tokens_read += len(ids)
        self.tokens_generated += len(new)
        if eos is not None and new and new[-1] == eos:
            new = new[:-1]
        return self.engine.tokenizer.decode(new)

    def snapshots(self) -> list[dict[str, Any]]:
        """The kept snapshots, newest first: index (what `rollback` takes), position, reads, time taken."""
        return [
            {"index": i, "position": s.position, "reads": s.reads, "taken": s.taken}
            for i, s in enumerate(self._snapshots)
        ]

    def rollback(self, k: int) -> None:
        """Restore snapshot k (0: the state before the last read or generate): its state, bit for bit, and
        its counters. Snapshots newer than k are dropped; older ones are kept. The frozen flag stays."""
        n = len(self._snapshots)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
            raise IndexError(
                f"rollback: no snapshot {k!r}; this session has {n} snapshot(s) (indices 0..{n - 1})"
                if n
                else f"rollback: no snapshot {k!r}; this session has no snapshots yet"
            )
        snap = self._snapshots[k]
        self._state = self._decode(snap.data, f"snapshot {k}")
        self._state_bytes = snap.data
        self.reads, self.tokens_read, self.tokens_generated = (
            snap.reads,
            snap.tokens_read,
            snap.tokens_generated,
        )
        self._snapshots = self._snapshots[k + 1 :]
        self.rollbacks += 1

    def stats(self) -> dict[str, Any]:
        """Counters, the last read's statistics, ||W|| per memory layer and `state_digest` (equal digests,
        bit-identical states)."""
        return {
            "position": self.position,
            "reads": self.reads,
            "tokens_read": self.tokens_read,
            "tokens_generated": self.tokens_generated,
            "frozen": self._frozen,
            "snapshots": len(self._snapshots),
            "rollbacks": self.rollbacks,
            "created": self.created,
            "last_read": self.last_read,
            "memory_norm": memory_norms(self._state),
            "state_sha256": state_digest(self._state),
        }

    def state_bytes(self) -> bytes:
        """The current state in the state-file format (empty before the first token)."""
        if self._state_bytes is None:
            self._state_bytes = state_to_bytes(self._state) if self._state is not None else b""
        return self._state_bytes

    @property
    def state(self) -> TitansState | None:
        return self._state

    # ------------------------------------------------------------------ bytes
    def to_bytes(self) -> bytes:
        blobs = [self.state_bytes(), *(s.data for s in self._snapshots)]
        header = {
            "format": SESSION_FORMAT,
            "frozen": self._frozen,
            "reads": self.reads,
            "tokens_read": self.tokens_read,
            "tokens_generated": self.tokens_generated,
            "rollbacks": self.rollbacks,
            "created": self.created,
            "last_read": self.last_read,
            "sizes": [len(b) for b in blobs],
            "snapshots": [
                {
                    "position": s.position,
                    "reads": s.reads,
                    "tokens_read": s.tokens_read,
                    "tokens_generated": s.tokens_generated,
                    "taken": s.taken,
                }
                for s in self._snapshots
            ],
        }
        head = json.dumps(header, separators=(",", ":")).encode()
        return b"".join([MAGIC, struct.pack("<Q", len(head)), head, *blobs])

    @classmethod
    def from_bytes(cls, data: bytes, engine: Engine) -> MemorySession:
        """The session `to_bytes` wrote. Damaged bytes or a state of another model: SessionDataError."""
        data = bytes(data)
        if data[: len(MAGIC)] != MAGIC:
            raise SessionDataError("not session bytes (the header mark is missing)")
        try:
            start = len(MAGIC) + 8
            (size,) = struct.unpack("<Q", data[len(MAGIC) : start])
            header = json.loads(data[start : start + size])
            sizes = [int(n) for n in header["sizes"]]
            snaps = header["snapshots"]
        except (struct.error, ValueError, KeyError, TypeError) as e:
            raise SessionDataError(f"damaged session header ({e})") from e
        if header.get("format") != SESSION_FORMAT:
            raise SessionDataError(f"session format {header.get('format')!r} is not supported")
        if len(sizes) != len(snaps) + 1 or start + size + sum(sizes) != len(data):
            raise SessionDataError("session bytes are truncated or hold extra bytes")
        blobs, offset = [], start + size
        for n in sizes:
            blobs.append(data[offset : offset + n])
            offset += n
        session = cls(engine)
        try:
            session._frozen = bool(header["frozen"])
            session.reads = int(header["reads"])
            session.tokens_read = int(header["tokens_read"])
            session.tokens_generated = int(header["tokens_generated"])
            session.rollbacks = int(header.get("rollbacks", 0))
            session.created = float(header["created"])
            session.last_read = header.get("last_read")
            session._snapshots = [
                _Snapshot(
                    blob,
                    int(s["position"]),
                    int(s["reads"]),
                    int(s["tokens_read"]),
                    int(s["tokens_generated"]),
                    float(s["taken"]),
                )
                for blob, s in zip(blobs[1:], snaps)
            ]
        except (KeyError, ValueError, TypeError) as e:
            raise SessionDataError(f"damaged session header ({e})") from e
        session._state = session._decode(blobs[0], "current state")
        session._state_bytes = blobs[0]
        return session

    # ------------------------------------------------------------------ internals
    def _decode(self, blob: bytes, what: str) -> TitansState | None:
        if not blob:
            return None
        try:
            return state_from_bytes(blob, model=self.engine.model, name=f"the session's {what} bytes")
        except (StateFileError, ValueError, TypeError) as e:
            raise SessionDataError(str(e)) from e

    def _set_state(self, state: TitansState | None) -> None:
        self._state = state
        self._state_bytes = None

    def _push_snapshot(self) -> None:
        if self.engine.max_snapshots == 0:
            return
        snap = _Snapshot(
            self.state_bytes(),
            self.position,
            self.reads,
            self.tokens_read,
            self.tokens_generated,
            time.time(),
        )
        self._snapshots = [snap, *self._snapshots][: self.engine.max_snapshots]

    def _read_ids(self, ids: list[int]) -> list:
        """Feed ids through the model (its frozen twin when frozen) piece by piece; every call's stats."""
        model = self.engine.frozen_model if self._frozen else self.engine.model
        tokens = torch.tensor([ids], dtype=torch.int64, device=self.engine.device)
        state, stats = self._state, []
        for piece in iter_pieces(tokens, self.engine.piece_len):
            out = model.forward_with_stats(piece, state, last_only=True)
            state = out.state
            stats += out.stats
        self._set_state(state)
        return stats


__all__ = [
    "DEFAULT_MAX_SNAPSHOTS",
    "Engine",
    "MemorySession",
    "SessionDataError",
    "memory_norms",
    "read_stats",
    "state_digest",
]
