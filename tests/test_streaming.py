"""Streaming == parallel: one forward pass, random-size pieces, chunked prefill and the incremental decode
path all give the same logits, for every variant, at lengths that are not multiples of chunk or segment."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from tiny_lm import random_tokens, tiny_model
from titans import VARIANTS, TitansConfig, TitansLM
from titans.inference import decode_step, default_piece_len, iter_pieces, prefill, state_nbytes

F64 = torch.float64
ATOL = 1e-10

tokens = partial(random_tokens, vocab=61)


def random_cuts(length: int, seed: int) -> list[int]:
    """Piece sizes summing to `length`: many single tokens, some pieces longer than a chunk or segment."""
    rng = np.random.default_rng(seed)
    sizes = []
    while sum(sizes) < length:
        sizes.append(int(rng.choice([1, 1, 2, 3, 5, 9, 13])))
    sizes[-1] -= sum(sizes) - length
    return [s for s in sizes if s > 0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_pieces_and_decode_equal_one_pass(variant):
    model = tiny_model(variant)
    x = tokens(2, 37)  # 37: not a multiple of chunk (4), segment (8) or window (6)
    with torch.no_grad():
        full, full_state = model(x)
        # random-size pieces, single tokens included
        outs, state, start = [], None, 0
        for size in random_cuts(37, seed=3):
            logits, state = model(x[:, start : start + size], state)
            outs.append(logits)
            start += size
        torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=ATOL, rtol=0)
        assert state.position == full_state.position == 37
        # last_only: the head on the last position alone, same state
        last_only, last_state = model(x, last_only=True)
        assert last_only.shape == (2, 1, full.shape[-1]) and last_state.position == 37
        torch.testing.assert_close(last_only, full[:, -1:], atol=ATOL, rtol=0)
        # generate's incremental path, teacher-forced: prefill 11 tokens, then one token at a time
        last, state = prefill(model, x[:, :11], piece_len=5)
        torch.testing.assert_close(last, full[:, 10], atol=ATOL, rtol=0)
        for t in range(11, 37):
            last, state = decode_step(model, x[:, t : t + 1], state)
            torch.testing.assert_close(last, full[:, t], atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["mac", "lmm", "swa"])
@pytest.mark.parametrize("piece_len", [1, 3, 8, 64])
def test_prefill_piece_len_does_not_change_the_result(variant, piece_len):
    model = tiny_model(variant)
    x = tokens(1, 45)
    with torch.no_grad():
        full, _ = model(x)
    last, state = prefill(model, x, piece_len=piece_len)
    torch.testing.assert_close(last, full[:, -1], atol=ATOL, rtol=0)
    assert state.position == 45


def test_prefill_reads_a_stream_of_pieces():
    """A reader yielding lists, numpy arrays, 1-D and 2-D tensors and empty pieces == one tensor."""
    model = tiny_model("mag")
    x = tokens(1, 40)
    flat = x[0]
    reader = [
        flat[:3].tolist(),
        flat[3:3].numpy(),
        flat[3:17].numpy(),
        flat[17:18],
        flat[18:30][None],
        [],
        flat[30:].tolist(),
    ]
    with torch.no_grad():
        full, _ = model(x)
    last, state = prefill(model, iter(reader), piece_len=7)
    torch.testing.assert_close(last, full[:, -1], atol=ATOL, rtol=0)
    assert state.position == 40


def test_iter_pieces_recuts_exactly():
    pieces = [torch.arange(n) + 100 * i for i, n in enumerate([5, 0, 1, 12, 3])]
    out = list(iter_pieces(iter(pieces), 4))
    assert [p.shape[1] for p in out] == [4, 4, 4, 4, 4, 1]
    assert torch.equal(torch.cat(out, dim=1)[0], torch.cat(pieces))


def test_long_stream_prefill_matches_smaller_pieces_and_state_stays_bounded():
    """20K tokens through a tiny MAC model: big pieces == a reader of small uneven pieces, and the state
    after 20K tokens is exactly as large as after 2K (it does not grow with the context)."""
    model = tiny_model("mac", dim=16, heads=2, depth=1, segment_len=64, chunk_size=16)
    n = 20_000
    x = tokens(1, n, seed=7)
    last_big, state_big = prefill(model, x, piece_len=4096)
    rng = np.random.default_rng(0)
    cuts = np.cumsum(rng.integers(200, 700, size=80))
    cuts = [0, *[int(c) for c in cuts if c < n], n]
    reader = (x[:, a:b] for a, b in zip(cuts[:-1], cuts[1:]))
    last_small, state_small = prefill(model, reader, piece_len=512)
    torch.testing.assert_close(last_small, last_big, atol=1e-9, rtol=0)
    assert state_big.position == state_small.position == n
    _, state_2k = prefill(model, x[:, :2080], piece_len=512)  # 2080 = 20000 mod 16 and mod 64
    assert state_nbytes(state_big) == state_nbytes(state_2k)
    assert torch.isfinite(last_big).all()


def test_default_piece_len_respects_chunk_and_segment():
    model = tiny_model("mac", segment_len=12, chunk_size=4)
    p = default_piece_len(model)
    assert p % 12 == 0 and p % 4 == 0
    big_vocab = TitansLM(
        TitansConfig(variant="lmm", vocab_size=32000, dim=16, depth=1, heads=2, chunk_size=16)
    )
    assert default_piece_len(big_vocab) * 32000 <= 2**24 + 16 * 32000


def test_prefill_refuses_bad_input():
    model = tiny_model("lmm")
    with pytest.raises(ValueError, match="piece_len"):
        prefill(model, tokens(1, 5), piece_len=0)
    with pytest.raises(TypeError, match="integer token ids"):
        prefill(model, iter([torch.rand(4)]))
    with pytest.raises(ValueError, match="batch"):
        prefill(model, iter([tokens(1, 3), tokens(2, 3)]))
    with pytest.raises(TypeError, match="tokenize"):
        prefill(model, "some text")
    last, state = prefill(model, iter([]))
    assert last is None and state is None


def test_list_pieces_must_hold_integer_ids():
    """A list piece is read as the values it holds: floats and bools are refused as a float tensor is (not
    truncated to 1, 2 or read as 0 / 1), a list of strings is a TypeError naming the piece; int lists and
    an empty list still read."""
    model = tiny_model("lmm")
    for bad, dtype in (([[1.7, 2.2, 3.9]], "float"), ([[True, False]], "bool"), ((1.0, 2.0), "float")):
        with pytest.raises(TypeError, match=f"piece 0 must hold integer token ids, got dtype torch.{dtype}"):
            next(iter_pieces([bad], 8))
        with pytest.raises(TypeError, match="piece 1 must hold integer token ids"):
            prefill(model, [[[1, 2]], bad])
    with pytest.raises(TypeError, match=r"prefill: piece 0 is not a list of integer token ids \("):
        prefill(model, [["a", "b"]])
    with pytest.raises(TypeError, match="piece 2 is not a list of integer token ids"):
        prefill(model, [[1], [2], [[1, 2], [3]]])
    assert next(iter_pieces([[[1, 2, 3]], [4]], 8)).tolist() == [[1, 2, 3, 4]]
    assert next(iter_pieces([[], (5, 6)], 8)).tolist() == [[5, 6]]


def state_tensors(state) -> list[torch.Tensor]:
    """Every tensor of a model state, in a fixed order."""
    from titans.layers.state_tree import map_tensors

    found: list[torch.Tensor] = []
    map_tensors(state.layers, lambda t: found.append(t) or t)
    return found


@pytest.mark.parametrize("variant", VARIANTS)
def test_empty_piece_changes_nothing(variant):
    """A zero-length piece in the middle of a stream (MAC once raised on one): an empty output, a state
    equal to the one given, and the stream still equals one pass. With no state, an empty sequence gives
    an empty output and a state at position 0 that continues like a fresh one."""
    model = tiny_model(variant)
    x = tokens(2, 21)
    with torch.no_grad():
        full, _ = model(x)
        first, state = model(x[:, :11], None)
        empty, after = model(x[:, :0], state)
        assert empty.shape == (2, 0, full.shape[-1])
        assert after.position == state.position == 11
        before, now = state_tensors(state), state_tensors(after)
        assert len(before) == len(now) and all(torch.equal(a, b) for a, b in zip(before, now))
        rest, _ = model(x[:, 11:], after)
        torch.testing.assert_close(torch.cat([first, empty, rest], 1), full, atol=ATOL, rtol=0)
        # no state: an empty sequence, then the whole sequence from the state it returns
        empty, fresh = model(x[:, :0])
        assert empty.shape == (2, 0, full.shape[-1]) and fresh.position == 0
        again, _ = model(x, fresh)
        torch.testing.assert_close(again, full, atol=ATOL, rtol=0)


def _refilling_reader(data: np.ndarray, size: int, as_tensor: bool):
    """A reader that fills one buffer for every piece (the readinto pattern), as file readers do."""
    buf = np.empty(size, dtype=np.int64)
    view = torch.from_numpy(buf) if as_tensor else buf
    for start in range(0, len(data), size):
        n = min(size, len(data) - start)
        buf[:n] = data[start : start + n]
        yield view[:n]


@pytest.mark.parametrize("as_tensor", [False, True], ids=["numpy", "tensor"])
@pytest.mark.parametrize("size", [3, 16])  # pieces shorter than piece_len (buffered), and longer
def test_a_reader_may_refill_one_buffer_for_every_piece(as_tensor, size):
    """The pieces a reader gives are copied where they are kept: the buffered small pieces, and the pieces
    iter_pieces yields (which a caller may keep), are not overwritten by the reader's next piece."""
    model = tiny_model("mag")
    x = tokens(1, 40)
    data = x[0].numpy()
    kept = list(iter_pieces(_refilling_reader(data, size, as_tensor), 7))
    assert torch.equal(torch.cat(kept, dim=1), x)
    with torch.no_grad():
        full, _ = model(x)
    last, state = prefill(model, _refilling_reader(data, size, as_tensor), piece_len=7)
    torch.testing.assert_close(last, full[:, -1], atol=ATOL, rtol=0)
    assert state.position == 40


def test_a_numpy_array_is_the_whole_input_as_a_tensor_is():
    """(B, T) numpy == (B, T) tensor (B rows, not one stream of their concatenation); (T,) is batch 1, as a
    1-D tensor is. A list is pieces: a list of rows is one stream, the rows one after the other."""
    from titans.models.monitor import prefill_with_report

    model = tiny_model("mal")
    x = tokens(2, 19)
    want, want_state = prefill(model, x, piece_len=5)
    for arr in (x.numpy(), x.numpy().astype(np.int32), np.asfortranarray(x.numpy())):
        got, state = prefill(model, arr, piece_len=5)
        assert torch.equal(got, want) and state.position == 19
        got, state, report = prefill_with_report(model, arr, piece_len=5)
        assert torch.equal(got, want) and state.position == 19
    got, _ = prefill(model, x.numpy())  # the default piece length: for batch 2
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    one, _ = prefill(model, x[0].numpy(), piece_len=5)
    one_tensor, _ = prefill(model, x[0], piece_len=5)
    assert one.shape == (1, 61) and torch.equal(one, one_tensor)
    stream, state = prefill(model, x.tolist(), piece_len=5)
    flat, _ = prefill(model, x.reshape(1, -1), piece_len=5)
    assert state.position == 38 and torch.equal(stream, flat)
    with pytest.raises(ValueError, match=r"must be \(batch, len\) or \(len,\), got shape \(2, 19, 1\)"):
        prefill(model, x.numpy()[..., None])
