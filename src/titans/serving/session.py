"""What a server adds to `titans.inference.session.MemorySession`: the engine (the model and the
tokenizer, text <-> ids) and the JSON answers of the routes.

    engine = Engine(model, tokenizer, max_snapshots=8, probe="a fixed probe text")
    session = engine.new_session()                           # or engine.load(data)
    read_json(session, engine.encode(text))                  # the memory reads the text -> a JSON dict
    generate_json(engine, session, ids, 64, seed=1)          # reads the prompt, then continues it
    stats_json(session)                                      # counters, events, ||W||, a digest
    data = session.to_bytes()                                # what the store keeps (to_parts: cut)

Everything else (freezing, snapshots and rollback, the guard, the bytes) is the session's own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from titans.data.tokenizers import Tokenizer
from titans.inference.generation import continuation_text
from titans.inference.session import DEFAULT_GUARD_MAX_RISE, SESSION_MAGIC, MemorySession
from titans.layers.memory import MemoryStats
from titans.models.decode_graph import MODES, StaticDecoder
from titans.models.lm import TitansLM
from titans.models.monitor import find_memory_state, total_weight_norm
from titans.models.state import TitansState, state_digest

DEFAULT_MAX_SNAPSHOTS = 8


class Engine:
    """What every session of a server shares: the model (in eval mode), the tokenizer, and the settings new
    sessions get (a session keeps the settings it was created with).

    max_snapshots: snapshots kept per session. probe: a fixed text that turns on every new session's guard
    (see `MemorySession`), with guard_max_rise. decode_graph: generations decode through fixed state
    buffers (`titans.models.decode_graph`; a mode: "compile", "cuda_graph" or "eager"), None: the eager
    step; a model it cannot decode (full attention) or a CUDA graph off CUDA is refused here. weights: the
    checkpoint's `weights_id`, recorded in every session: a stored or imported session of other weights
    (another checkpoint of this configuration) is refused (`OtherWeightsError`).
    """

    def __init__(
        self,
        model: TitansLM,
        tokenizer: Tokenizer,
        *,
        max_snapshots: int = DEFAULT_MAX_SNAPSHOTS,
        probe: str | None = None,
        guard_max_rise: float = DEFAULT_GUARD_MAX_RISE,
        decode_graph: str | None = None,
        weights: str | None = None,
    ) -> None:
        if max_snapshots < 0:
            raise ValueError(f"max_snapshots must be >= 0, got {max_snapshots}")
        self.model = model.eval()
        if decode_graph is not None:
            if decode_graph not in MODES:
                raise ValueError(f"decode_graph must be None or one of {MODES}, got {decode_graph!r}")
            token = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
            with torch.no_grad():  # builds buffers, compiles nothing: the model's refusals come now
                StaticDecoder(model, model(token)[1], decode_graph)
        self.decode_graph = decode_graph
        self.weights = weights
        self.tokenizer = tokenizer
        self.max_snapshots = max_snapshots
        self.guard_max_rise = guard_max_rise
        self.vocab_size = int(model.config.vocab_size)
        self.device = next(model.parameters()).device
        self.probe = None
        if probe is not None:
            self.probe = self.encode(probe)
            self.check_tokens(self.probe)
        self.new_session()  # settings a session refuses are refused now, not at the first request

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

    def import_problem(self, session: MemorySession) -> str | None:
        """Why this server will not take `session` (imported bytes) as one of its own, or None: settings
        that cost more than its own sessions' may (more snapshots kept, shorter pieces per model call, a
        guard probe other than the server's, which every read runs in full) or more events than a session
        keeps. An import brings its settings with it, so without this a client could set the server's
        limits aside for its sessions."""
        mine = self.new_session()
        if session.max_snapshots > self.max_snapshots or len(session._snapshots) > self.max_snapshots:
            return (
                f"the session keeps up to {max(session.max_snapshots, len(session._snapshots))} snapshots; "
                f"this server keeps at most {self.max_snapshots} (--snapshots)"
            )
        if session.piece_len != mine.piece_len:
            return (
                f"the session reads in pieces of {session.piece_len} tokens; this server's sessions read in "
                f"pieces of {mine.piece_len}"
            )
        if session.probe is not None and (
            self.probe is None or session.probe.flatten().tolist() != list(self.probe)
        ):
            return "the session is guarded with a probe text other than this server's (--guard-probe)"
        if self.probe is not None and session.probe is None:
            return "the session is not guarded, and this server guards every session (--guard-probe)"
        if self.probe is not None and session.guard_max_rise > self.guard_max_rise:
            return (
                f"the session's guard allows the probe loss to rise by {session.guard_max_rise:g}; this "
                f"server's by at most {self.guard_max_rise:g} (--guard-max-rise)"
            )
        if len(session.events) > mine.max_events:
            return (
                f"the session holds {len(session.events)} events; a session keeps at most {mine.max_events}"
            )
        return None

    def new_session(self) -> MemorySession:
        return MemorySession(
            self.model,
            snapshots=self.max_snapshots,
            probe=self.probe,
            guard_max_rise=self.guard_max_rise,
            weights=self.weights,
        )

    def load(self, data: bytes, *, verified: bool = False, check_snapshots: bool = False) -> MemorySession:
        """The session of `data` (`MemorySession.to_bytes`). Damaged bytes raise SessionFormatError, a
        session of another model ValueError. verified: `data` matched a store's checksum already.
        check_snapshots: decode the snapshots too (an import), not only when rolled back to."""
        return MemorySession.from_bytes(
            self.model, data, verified=verified, check_snapshots=check_snapshots, weights=self.weights
        )


# ------------------------------------------------------------------------------------------ parts
def session_parts(data: bytes, *, views: bool = False) -> list[bytes] | list[memoryview]:
    """`MemorySession.to_bytes` cut where its states start and end: [header, state, ..., state, trailer],
    joined again by ``b"".join`` (`MemorySession.to_parts` cuts the same). A change of a session adds one
    state and drops the oldest snapshot, so its parts are those of the previous bytes plus a new header
    and state: a store that keeps each part once writes only those. Bytes that are not a session (or
    damaged) are one part: the session's own checks refuse them when they are loaded. views: the parts as
    read-only views of `data` (bytes), not copies."""
    start = len(SESSION_MAGIC)
    try:
        if not data.startswith(SESSION_MAGIC) or len(data) < start + 8 + 32:
            raise ValueError("not a session")
        size = int.from_bytes(data[start : start + 8], "little")
        sizes = json.loads(data[start + 8 : start + 8 + size])["blobs"]
        cut = [start + 8 + size]
        for n in sizes:
            if not isinstance(n, int) or n < 0:
                raise ValueError("a blob size is not a count")
            cut.append(cut[-1] + n)
        if cut[-1] != len(data) - 32:
            raise ValueError("blob sizes do not add up")
    except (ValueError, KeyError, TypeError):
        return [memoryview(data) if views else data]
    whole = memoryview(data) if views else data
    parts = [whole[: cut[0]]]
    parts += [whole[a:b] for a, b in zip(cut, cut[1:], strict=False)]
    parts.append(whole[cut[-1] :])
    return parts


def known_digests(
    parts: Sequence[bytes | memoryview], data: bytes, digests: Sequence[str]
) -> list[str | None]:
    """Per part of `parts` (`MemorySession.to_parts` of a session loaded from `data`), the SHA-256 (hex)
    it is known to have: a part that is a view of `data`'s own part k (a state the session did not change)
    has `digests[k]` (a store's record: its bytes and the digests of its parts, in order, as the store
    checked them); None for the rest (new bytes, to be hashed). Matched by address, not by content."""
    old = session_parts(data, views=True)
    if len(old) != len(digests):  # a record of one blob (written before parts), or damaged
        return [None] * len(parts)
    known = {(_address(view), len(view)): digest for view, digest in zip(old, digests, strict=True)}
    return [known.get((_address(p), len(p))) if isinstance(p, memoryview) else None for p in parts]


def _address(view: memoryview) -> int:
    """Where the bytes of `view` start in memory."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


# ------------------------------------------------------------------------------------------ JSON
def read_stats(stats: Iterable[MemoryStats], tokens: int) -> dict[str, Any]:
    """The surprise and gate statistics of one read: every memory layer's MemoryStats pooled (all memory
    layers, heads and tokens)."""
    stats = list(stats)
    if not stats:
        return {"tokens": tokens}
    surprise = torch.cat([s.surprise.detach().float().reshape(-1) for s in stats])
    p50, p95 = np.percentile(surprise.double().numpy(), [50, 95])  # linear interpolation, as the monitor
    theta = torch.cat([s.theta.detach().float().reshape(-1) for s in stats])
    eta = torch.cat([s.eta.detach().float().reshape(-1) for s in stats])
    alpha = torch.cat([s.alpha.detach().float().reshape(-1) for s in stats])
    return {
        "tokens": tokens,
        "surprise": {
            "mean": float(surprise.mean()),
            "p50": float(p50),
            "p95": float(p95),
            "max": float(surprise.max()),
        },
        "theta_mean": float(theta.mean()),
        "eta_mean": float(eta.mean()),
        "alpha_mean": float(alpha.mean()),
    }


def memory_norms(state: TitansState | None) -> list[float]:
    """||W|| (all weight tensors of the memory together; `titans.models.monitor.total_weight_norm`) of every
    memory layer of `state` (one row: a session's)."""
    if state is None:
        return []
    memories = (find_memory_state(layer) for layer in state.layers)
    return [total_weight_norm(memory) for memory in memories if memory is not None]


def _course(session: MemorySession, event) -> dict[str, Any]:
    return {
        "position": session.position,
        "reads": session.reads,
        "frozen": session.frozen,
        "event": None if event is None else event.to_dict(),
    }


def read_json(session: MemorySession, ids: list[int], *, once: bool = False) -> dict[str, Any]:
    """The session reads `ids`: what the read route answers (the pooled surprise and gates, the loss, whether
    the memory kept it, the guard's event).

    once: the session is used for this read only (a server's: stored as bytes, then dropped). The read runs
    in `torch.inference_mode`: the same numbers, bit for bit, with less bookkeeping per torch op (about a
    tenth of a small model's forward on CPU); its new state is made of inference tensors, which no later
    autograd or in-place update may touch."""
    with torch.inference_mode(once):
        result = session.read(ids)
        return {
            **read_stats((result.stats or {}).values(), result.tokens),
            **_course(session, result.event),
            "kept": result.kept,
            "loss": result.to_dict()["loss"],
        }


def generate_json(
    engine: Engine,
    session: MemorySession,
    ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    seed: int | None = None,
    stop_at_eos: bool = True,
    on_token: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The session continues the prompt `ids` (`MemorySession.generate`): what the generate route answers,
    the generated text without the prompt (nor a final end-of-text token). on_token: called with each
    generated id as it is produced (streamed answers)."""
    generator = torch.Generator(device=engine.device)
    generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    eos = engine.tokenizer.eos_id if stop_at_eos else None
    events = len(session.events)
    out = session.generate(
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        greedy=greedy,
        generator=generator,
        stop_tokens=eos,
        on_token=None if on_token is None else (lambda column: on_token(int(column[0]))),
        compiled=engine.decode_graph or False,
    )
    new = out[0, len(ids) :].tolist()
    new_text = new[:-1] if eos is not None and new and new[-1] == eos else new
    text = continuation_text(engine.tokenizer, ids, new_text)  # as it continues the prompt
    guard = next((e for e in session.events[events:] if e.kind == "guard"), None)
    return {"text": text, "prompt_tokens": len(ids), "new_tokens": len(new), **_course(session, guard)}


def stats_json(session: MemorySession) -> dict[str, Any]:
    """Counters, the guard's settings and events, ||W|| per memory layer and `state_digest` (equal digests,
    bit-identical states)."""
    state = session.state
    return {
        "position": session.position,
        "reads": session.reads,
        "tokens_read": session.position - session.tokens_generated,
        "tokens_generated": session.tokens_generated,
        "frozen": session.frozen,
        "snapshots": len(session.snapshots),
        "rollbacks": sum(e.kind == "rollback" for e in session.events),
        "guarded": session.guarded,
        "guard_max_rise": session.guard_max_rise if session.guarded else None,
        "events": [e.to_dict() for e in session.events],
        "memory_norm": memory_norms(state),
        "state_sha256": state_digest(state),
    }


def snapshots_json(session: MemorySession) -> list[dict[str, Any]]:
    """The kept snapshots, newest first: k (what rollback takes, from 1), position, reads, created."""
    return [asdict(s) for s in session.snapshots]


__all__ = [
    "DEFAULT_MAX_SNAPSHOTS",
    "Engine",
    "generate_json",
    "known_digests",
    "memory_norms",
    "read_json",
    "read_stats",
    "session_parts",
    "snapshots_json",
    "stats_json",
]
