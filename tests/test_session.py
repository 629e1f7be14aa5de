"""`MemorySession`: rollback restores bit-identical states, a frozen session reads without writing its
memory (the memory bit-identical, attention and position moving on), the guard undoes a harmful write (and
only that), and a session survives its bytes; the state's bytes format."""

from __future__ import annotations

import json

import pytest
import torch

from session_support import rebuilt
from titans.inference.session import MemorySession, SessionFormatError, frozen_twin
from titans.models import TitansConfig, TitansLM
from titans.models.monitor import find_memory_state
from titans.models.state import (
    StateFileError,
    TitansState,
    load_state,
    save_state,
    state_from_bytes,
    state_tensors,
    state_to_bytes,
)
from titans.models.streaming import generate

VOCAB = 40


def tiny(variant: str = "mac", **kw) -> TitansLM:
    cfg = dict(
        variant=variant,
        vocab_size=VOCAB,
        dim=32,
        depth=2,
        heads=2,
        segment_len=8,
        window=8,
        chunk_size=4,
        persistent_tokens=2,
    )
    torch.manual_seed(0)
    return TitansLM(TitansConfig(**{**cfg, **kw})).eval()


def text(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def tensors(state) -> dict[str, torch.Tensor]:
    """Independent copies of a state's tensors (a later in-place change would show)."""
    return {k: v.clone() for k, v in state_tensors(state).items()}


def memory_tensors(state: TitansState) -> list[torch.Tensor]:
    """Copies of every memory's weights, momentum and pending tokens (keys, values, gates)."""
    out = []
    for layer in state.layers:
        m = find_memory_state(layer)
        out += [t.clone() for t in (*m.weights, *m.momentum, m.pending_k, m.pending_v, m.pending_gates)]
    return out


def assert_same_memory(state: TitansState, expected: list[torch.Tensor]) -> None:
    got = memory_tensors(state)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e)


def assert_identical(state, expected: dict[str, torch.Tensor], position: int) -> None:
    got = state_tensors(state)
    assert state.position == position
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_rollback_restores_bit_identical_states():
    model = tiny()
    session = MemorySession(model, snapshots=3, piece_len=8)
    seen = []
    for i, n in enumerate([11, 6, 13, 5]):
        result = session.read(text(n, i))
        assert result.kept and result.tokens == n and result.position == session.position
        seen.append((tensors(session.state), session.position))
    assert [s.k for s in session.snapshots] == [1, 2, 3]  # the oldest (before read 1) was dropped
    assert [s.position for s in session.snapshots] == [30, 17, 11]
    info = session.rollback(1)
    assert info.position == 30
    assert_identical(session.state, *seen[2])
    session.rollback(2)  # two more writes back: the state after read 1
    assert_identical(session.state, *seen[0])
    assert session.snapshots == []
    with pytest.raises(ValueError, match="no snapshot 1: the session keeps 0 snapshots"):
        session.rollback(1)
    # reading again from the restored state gives the same state as the first time
    session.read(text(6, 1))
    assert_identical(session.state, *seen[1])
    assert [e.kind for e in session.events] == ["rollback", "rollback"]
    with pytest.raises(ValueError, match="rollback: k"):
        session.rollback(0)


def test_probe_loss_after_a_rollback_is_the_restored_states():
    """The session caches its probe loss (the guard's baseline for the next write): a rollback must drop
    the undone write's value, or the guard judges the next write against a state that is gone."""
    session = MemorySession(tiny("lmm"), snapshots=2, probe=text(24, 100), piece_len=8)
    before = session.probe_loss()
    session.read(text(16, 1))
    assert session.probe_loss() != before
    session.rollback(1)
    assert session.probe_loss() == before


def test_frozen_session_reads_without_writing_its_memory():
    """Frozen: the memory (weights, momentum, pending tokens) stays bit-identical while the position and the
    attention context move on, so a later answer draws on what was read frozen, through attention only."""
    model = tiny("mag")
    session = MemorySession(model, piece_len=5)
    session.read(text(14, 0))
    start, memory = session.state, memory_tensors(session.state)
    session.freeze()
    result = session.read(text(9, 1))
    assert not result.kept and result.report.write_rate == 0.0 and result.loss is not None
    assert session.position == 23
    assert_same_memory(session.state, memory)
    assert not torch.equal(
        state_tensors(session.state)["layers.0.attention.k"], state_tensors(start)["layers.0.attention.k"]
    )
    # the frozen read is in the attention context: generating now equals the read-only twin generating from
    # the text read and the prompt together
    out = session.generate(text(3, 2), 6, greedy=True)
    want = generate(
        frozen_twin(model), torch.cat([text(9, 1), text(3, 2)])[None], 6, greedy=True, state=start
    )
    assert out.shape == (1, 9) and torch.equal(out, want[:, 9:])
    assert session.position == 23 + 9 and session.tokens_generated == 6 and session.reads == 2
    assert_same_memory(session.state, memory)
    # frozen calls change the state, so they are kept as snapshots too: a rollback undoes them
    assert [s.position for s in session.snapshots] == [23, 14, 0]
    session.rollback(2)
    assert_identical(session.state, tensors(start), 14)
    # the frozen twin shares the model's parameters, and the model itself still writes
    twin = frozen_twin(model)
    assert twin.embed.weight is model.embed.weight and twin is frozen_twin(model)
    assert all(b.memory.write for b in model.blocks) and not any(b.memory.write for b in twin.blocks)
    session.unfreeze()
    result = session.read(text(9, 1))
    assert result.kept and result.report.write_rate == 1.0 and session.position == 23
    assert [e.kind for e in session.events] == ["freeze", "rollback", "unfreeze"]
    assert session.generate(text(3, 2), 4, greedy=True).shape == (1, 7)
    assert session.position == 23 + 3 + 4


def _set_write_strength(model: TitansLM, max_lr: float, clip: float | None) -> None:
    for block in model.blocks:
        block.memory.max_lr = max_lr
        block.memory.surprise_clip = clip


def guarded_session() -> tuple[TitansLM, MemorySession]:
    """A memory-only model whose memory output moves its predictions (a large tied embedding, a large
    memory output projection), guarded by a 24-token probe, after one gentle write."""
    model = tiny("lmm")
    model.embed.weight.data.mul_(50)
    for block in model.blocks:
        block.memory.to_out.weight.data.mul_(30)
    session = MemorySession(model, snapshots=2, probe=text(24, 100), piece_len=8)
    _set_write_strength(model, 1e-4, None)  # a gentle write: the probe loss hardly moves
    baseline = session.probe_loss()
    result = session.read(text(16, 1))
    assert result.kept and result.event is None and not session.frozen
    assert abs(session.probe_loss() - baseline) < 0.01 * baseline
    return model, session


@pytest.mark.parametrize("max_lr,clip", [(1.0, 1.0), (200.0, None)])
def test_guard_undoes_a_harmful_write_and_keeps_a_harmless_one(max_lr, clip):
    """A strong write that raises the probe loss by ~13% (finite), and one that diverges."""
    model, session = guarded_session()
    kept = tensors(session.state)
    _set_write_strength(model, max_lr, clip)
    result = session.read(text(16, 2))
    assert not result.kept and session.frozen
    event = result.event
    assert event is not None and event.kind == "guard" and "write undone" in event.reason
    assert event.probe_before == pytest.approx(session.probe_loss())
    assert not event.probe_after <= event.probe_before * 1.05  # a rise past the limit (or not finite)
    if clip is not None:
        assert "rose by" in event.reason and event.probe_after < 2 * event.probe_before
    assert_identical(session.state, kept, 16)
    assert len(session.snapshots) == 1  # the undone write's snapshot went with it
    assert [e.kind for e in session.events] == ["guard"]
    # strict JSON for a server, even with a non-finite probe loss
    info = json.loads(json.dumps(session.info(), allow_nan=False))
    assert info["frozen"] and info["events"][0]["kind"] == "guard" and info["position"] == 16
    json.dumps(result.to_dict(), allow_nan=False)
    # frozen now: a read writes nothing (the memory is the one before the harmful write) and the guard,
    # with nothing to check, leaves it; its probe measurement changed nothing either
    memory = memory_tensors(session.state)
    assert not session.read(text(5, 3)).kept and session.position == 21
    assert_same_memory(session.state, memory)
    probed = tensors(session.state)
    session.probe_loss()
    assert_identical(session.state, probed, 21)
    _set_write_strength(model, 1e-4, None)
    session.unfreeze()
    assert session.read(text(5, 3)).kept and session.position == 26


def test_an_undone_write_keeps_every_snapshot_of_a_full_session():
    """With as many snapshots as the session keeps, the guard's undo dropped the oldest one all the same
    (it was trimmed when the write's snapshot was added): rollback(2) then found no snapshot 2."""
    model, session = guarded_session()
    assert session.read(text(16, 4)).kept
    full = [(s.k, s.position) for s in session.snapshots]
    assert len(full) == 2
    _set_write_strength(model, 1.0, 1.0)
    assert not session.read(text(16, 2)).kept and session.frozen
    assert [(s.k, s.position) for s in session.snapshots] == full
    session.rollback(2)
    assert session.position == 0


@pytest.mark.parametrize("compiled", [False, "eager"])
def test_guard_undoes_a_write_that_diverges_while_sampling(compiled):
    """A write that diverges while the session generates, sampling: the static steps (compiled) refuse the
    non-finite logits with the eager steps' ValueError ("non-finite"), not multinomial's RuntimeError, so
    the guard undoes the write and freezes the session either way."""
    model = tiny("lmm")
    session = MemorySession(model, probe=text(8, 100))
    _set_write_strength(model, 1e30, None)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(FloatingPointError, match="the write diverged"):
        session.generate(text(2, 2), 8, compiled=compiled, temperature=1.0, top_k=10, generator=gen)
    assert session.frozen and [e.kind for e in session.events] == ["guard"] and session.position == 0


def test_session_bytes_round_trip_and_damage():
    model = tiny()
    session = MemorySession(model, snapshots=2, probe=text(10, 9), guard_max_rise=10.0, piece_len=8)
    for i in range(3):
        session.read(text(7 + i, i))
    session.freeze("maintenance")
    blob = session.to_bytes()
    copy = MemorySession.from_bytes(model, blob)
    assert copy.frozen and copy.max_snapshots == 2 and copy.guard_max_rise == 10.0
    assert copy.snapshots == session.snapshots and copy.events == session.events
    assert torch.equal(copy.probe, session.probe)
    assert_identical(copy.state, tensors(session.state), session.position)
    copy.rollback(2)
    session.rollback(2)
    assert_identical(copy.state, tensors(session.state), 7)
    for s in (copy, session):
        s.unfreeze()
        s.read(text(5, 7))
    assert_identical(copy.state, tensors(session.state), 12)
    # no snapshots, and a fresh session (no state at all)
    light = MemorySession.from_bytes(model, session.to_bytes(snapshots=False))
    assert light.snapshots == [] and light.position == 12
    assert MemorySession.from_bytes(model, MemorySession(model).to_bytes()).state is None
    # damage anywhere is refused, by name
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 0x40
    with pytest.raises(SessionFormatError, match="checksum"):
        MemorySession.from_bytes(model, bytes(damaged))
    with pytest.raises(SessionFormatError):
        MemorySession.from_bytes(model, blob[:-100])
    with pytest.raises(SessionFormatError, match="magic"):
        MemorySession.from_bytes(model, b"garbage")
    with pytest.raises(ValueError, match="another config"):
        MemorySession.from_bytes(tiny(dim=48), blob)


def test_session_bytes_from_elsewhere_are_checked_state_by_state():
    """Bytes under a matching checksum (crafted, or damaged before they were sealed): every blob must be
    one state's, and no state holds more generated tokens than its position; with check_snapshots, the
    snapshots are decoded at once and take their positions from their states."""
    model = tiny()
    session = MemorySession(model, snapshots=3)
    for i in range(3):
        session.read(text(6 + i, i))
    blob = session.to_bytes()
    same = lambda h: h  # noqa: E731
    with pytest.raises(SessionFormatError, match=r"blobs must be one per state"):
        MemorySession.from_bytes(model, rebuilt(blob, same, lambda b: [*b, b[-1]]))
    with pytest.raises(SessionFormatError, match=r"tokens_generated must be at most its position"):
        MemorySession.from_bytes(model, rebuilt(blob, lambda h: {**h, "tokens_generated": 10**9}))

    def flip(states):  # snapshot 1's state, the last blob
        last = bytearray(states[-1])
        last[len(last) // 2] ^= 0xFF
        return [*states[:-1], bytes(last)]

    damaged = rebuilt(blob, same, flip)
    MemorySession.from_bytes(model, damaged)  # lazily: found only when rolled back to
    with pytest.raises(StateFileError):
        MemorySession.from_bytes(model, damaged, check_snapshots=True)

    def lie(h):
        return {
            **h,
            "snapshots": [e if e["state"] is None else {**e, "position": 10**6} for e in h["snapshots"]],
        }

    checked = MemorySession.from_bytes(model, rebuilt(blob, lie), check_snapshots=True)
    assert checked.snapshots == session.snapshots
    assert MemorySession.from_bytes(model, blob, check_snapshots=True).to_bytes() == blob


def test_state_bytes_are_the_state_file(tmp_path):
    model = tiny()
    _, state = model(text(13, 3)[None])
    data = state_to_bytes(state)
    back = state_from_bytes(data, model=model)
    assert_identical(back, tensors(state), 13)
    # one format: a state file's bytes load as bytes, and bytes written to a file load as a file
    file_bytes = save_state(state, tmp_path / "s.safetensors").read_bytes()
    assert_identical(state_from_bytes(file_bytes), tensors(state), 13)
    (tmp_path / "b.safetensors").write_bytes(data)
    assert_identical(load_state(tmp_path / "b.safetensors"), tensors(state), 13)
    damaged = bytearray(data)
    damaged[-5] ^= 1
    with pytest.raises(StateFileError, match="corrupted"):
        state_from_bytes(bytes(damaged))
    with pytest.raises(StateFileError, match="truncated"):
        state_from_bytes(data[:50])


def test_bad_session_input_is_refused_by_name():
    model = tiny()
    session = MemorySession(model)
    with pytest.raises(ValueError, match=r"\[0, 40\)"):
        session.read([1, 2, 40])
    with pytest.raises(ValueError, match="one stream"):
        session.read(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="integers"):
        session.read(torch.zeros(3))
    with pytest.raises(ValueError, match="probe"):
        MemorySession(model, probe=[1])
    with pytest.raises(ValueError, match="snapshots"):
        MemorySession(model, snapshots=-1)
    assert session.read([]).tokens == 0 and session.state is None


def test_events_keep_the_latest_max_events():
    """Events travel in the session's bytes on every change: a long-lived session keeps only the latest."""
    session = MemorySession(tiny("lmm"))
    session.max_events = 5
    for i in range(6):
        session.freeze(reason=f"f{i}")
        session.unfreeze(reason=f"u{i}")
    assert [e.reason for e in session.events] == ["u3", "f4", "u4", "f5", "u5"]
    restored = MemorySession.from_bytes(tiny("lmm"), session.to_bytes())
    assert [e.reason for e in restored.events] == ["u3", "f4", "u4", "f5", "u5"]
