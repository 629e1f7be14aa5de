"""The state as a value: save -> load -> continue == continue; map/expand/select; refusals of foreign
states and damaged files."""

from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_lm import random_tokens
from tiny_lm import tiny_config as shared_config
from tiny_lm import tiny_model as shared_model
from titans import VARIANTS, TitansState
from titans.inference import (
    StateFileError,
    expand_state,
    load_state,
    map_state,
    prefill,
    read_state_header,
    save_state,
    select_rows,
    state_batch_size,
)
from titans.models.state import state_tensors

F64 = torch.float64
VOCAB = 53

tiny_config = partial(shared_config, vocab_size=VOCAB)
tiny_model = partial(shared_model, vocab_size=VOCAB)
tokens = partial(random_tokens, vocab=VOCAB)


def assert_same_structure(a, b):
    """Same nested types, ints and tensors (dtype, shape, values)."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_structure(x, y)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same_structure(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("prefix", [3, 19])  # 3: still the initial (expanded) memory weights; 19: mid chunk
def test_save_load_continue_equals_continue(variant, prefix, tmp_path):
    model = tiny_model(variant)
    x = tokens(2, prefix + 13)
    _, state = prefill(model, x[:, :prefix], piece_len=5)
    path = save_state(state, tmp_path / "s.safetensors")
    loaded = TitansState.load(path)
    assert_same_structure(loaded, state)
    assert loaded.config == model.config.to_dict() and loaded.position == prefix
    with torch.no_grad():
        want, want_state = model(x[:, prefix:], state)
        got, got_state = model(x[:, prefix:], loaded)
    assert torch.equal(got, want)
    assert_same_structure(got_state, want_state)
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temp file left behind


def test_shared_tensors_are_stored_once_and_come_back_shared(tmp_path):
    model = tiny_model("mac")
    _, state = prefill(model, tokens(1, 16))  # at a segment boundary: segment weights == memory weights
    layer = state.layers[0]
    assert layer.segment_weights[0] is layer.memory.weights[0]
    loaded = load_state(save_state(state, tmp_path / "s.safetensors"))
    assert loaded.layers[0].segment_weights[0] is loaded.layers[0].memory.weights[0]
    names = set(state_tensors(state))
    assert not any(n.startswith("layers.0.segment_weights") for n in names)


def test_dtype_is_kept(tmp_path):
    model = tiny_model("mag")
    _, state = prefill(model, tokens(1, 10))
    half = map_state(state, lambda t: t.to(torch.bfloat16))
    loaded = load_state(save_state(half, tmp_path / "s.safetensors"))
    assert_same_structure(loaded, half)


def test_map_state_detach_and_positions():
    model = tiny_model("mal")
    model.train()
    _, state = model(tokens(1, 9))  # with autograd
    assert any(t.requires_grad for t in state_tensors(state).values())
    detached = state.detach()
    assert not any(t.requires_grad for t in state_tensors(detached).values())
    assert detached.position == 9 and detached.config == state.config
    f32 = map_state(state, lambda t: t.float())
    assert {t.dtype for t in state_tensors(f32).values()} == {torch.float32}
    assert [s.memory.position for s in f32.layers] == [s.memory.position for s in state.layers]


def test_expand_and_select_rows():
    model = tiny_model("mac")
    doc, query = tokens(1, 21), tokens(1, 6, seed=2)
    _, state = prefill(model, doc)
    wide = expand_state(state, 3)
    assert state_batch_size(wide) == 3
    with torch.no_grad():
        one, _ = model(query, state)
        three, s3 = model(query.expand(3, -1), wide)
    for row in range(3):
        torch.testing.assert_close(three[row], one[0], atol=1e-12, rtol=0)
    picked = select_rows(s3, torch.tensor([2]))
    assert state_batch_size(picked) == 1
    with pytest.raises(ValueError, match="batch-1"):
        expand_state(wide, 5)


# ------------------------------------------------------------------------------------------ refusals
def test_state_from_another_config_is_refused(tmp_path):
    a = tiny_model("mac")
    _, state = prefill(a, tokens(1, 10))
    path = save_state(state, tmp_path / "a.safetensors")
    other = tiny_model("mac", chunk_size=2)
    with pytest.raises(ValueError, match=r"a\.safetensors.*chunk_size"):
        load_state(path, model=other)
    with pytest.raises(ValueError, match="another config"):
        other(tokens(1, 3), load_state(path))
    with pytest.raises(ValueError, match="variant"):
        load_state(path, model=tiny_model("mag"))
    load_state(path, model=tiny_model("mac", seed=5))  # same config, other weights: accepted


@pytest.mark.parametrize("variant", ["mac", "lmm"])
def test_state_of_another_dtype_is_refused_by_name(variant, tmp_path):
    """A float64 state into a float32 (or bf16) model of the same config: refused when loaded, naming both
    dtypes (MAC read the weights before any check and failed inside the op); cast, it runs."""
    _, state = prefill(tiny_model(variant), tokens(1, 10))
    path = save_state(state, tmp_path / "s.safetensors")
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(variant, dtype=dtype)
        with pytest.raises(ValueError, match=rf"s\.safetensors.*torch\.float64, this model's {dtype}"):
            load_state(path, model=model)
        with pytest.raises(ValueError, match="memory weights are torch.float64"):
            model(tokens(1, 3), load_state(path))
    model = tiny_model(variant, dtype=torch.float32)
    cast = map_state(load_state(path), lambda t: t.float() if t.is_floating_point() else t)
    logits, _ = model(tokens(1, 3), cast)
    assert torch.isfinite(logits).all()


@pytest.fixture
def saved(tmp_path):
    model = tiny_model("mag")
    _, state = prefill(model, tokens(1, 11))
    return save_state(state, tmp_path / "state.safetensors")


def test_truncated_file_is_refused(saved):
    data = saved.read_bytes()
    for cut in (4, len(data) // 2, len(data) - 1):
        saved.write_bytes(data[:cut])
        with pytest.raises(StateFileError, match="state.safetensors"):
            load_state(saved)


def test_bad_header_is_refused(saved):
    data = bytearray(saved.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    data[8 : 8 + n] = b"{" + b"x" * (n - 1)  # same length, not JSON
    saved.write_bytes(bytes(data))
    with pytest.raises(StateFileError, match="state.safetensors"):
        load_state(saved)


def test_damaged_titans_header_is_refused(saved, tmp_path):
    tensors = load_file(saved)
    meta = read_state_header(saved)
    from safetensors import safe_open

    with safe_open(str(saved), framework="pt") as f:
        raw_meta = f.metadata()
    broken = dict(raw_meta, **{"titans.layers": raw_meta["titans.layers"][:-3]})
    save_file(tensors, tmp_path / "bad.safetensors", metadata=broken)
    with pytest.raises(StateFileError, match="damaged state header"):
        load_state(tmp_path / "bad.safetensors")
    newer = dict(raw_meta, **{"titans.state_format": "99"})
    save_file(tensors, tmp_path / "new.safetensors", metadata=newer)
    with pytest.raises(StateFileError, match="format"):
        load_state(tmp_path / "new.safetensors")
    save_file(tensors, tmp_path / "plain.safetensors")
    with pytest.raises(StateFileError, match="not a Titans state file"):
        load_state(tmp_path / "plain.safetensors")
    assert meta["position"] == 11


def test_missing_tensor_is_refused(saved, tmp_path):
    from safetensors import safe_open

    with safe_open(str(saved), framework="pt") as f:
        raw_meta = f.metadata()
    tensors = load_file(saved)
    victim = sorted(tensors)[0]
    del tensors[victim]
    save_file(tensors, tmp_path / "missing.safetensors", metadata=raw_meta)
    with pytest.raises(StateFileError, match=f"missing.safetensors.*{victim}.*missing"):
        load_state(tmp_path / "missing.safetensors")


def test_flipped_bits_are_refused(saved):
    data = bytearray(saved.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's bytes
    saved.write_bytes(bytes(data))
    with pytest.raises(StateFileError, match="corrupted"):
        load_state(saved)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.safetensors"):
        load_state(tmp_path / "nothing.safetensors")


def test_header_is_json_readable(saved):
    meta = read_state_header(saved)
    assert meta["config"]["variant"] == "mag"
    assert [layer["type"] for layer in meta["layers"]] == ["MAGState", "MAGState"]
    json.dumps(meta["layers"])


def test_safetensors_files_are_byte_reproducible_across_processes(tmp_path):
    """safetensors orders the header's metadata by a per-process hash: the same tensors saved by two
    processes differ in bytes unless the header is canonicalised (`save_safetensors`)."""
    code = (
        "import sys, torch\n"
        "from titans._fs import save_safetensors\n"
        "meta = {f'key{i}': str(i) for i in range(8)}\n"
        "save_safetensors({'b': torch.arange(5.0), 'a': torch.ones(3, 2)}, sys.argv[1], meta)\n"
    )
    paths = [tmp_path / f"{i}.safetensors" for i in range(2)]
    for path in paths:
        subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=120)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    from safetensors import safe_open

    with safe_open(str(paths[0]), "pt") as f:
        assert f.metadata() == {f"key{i}": str(i) for i in range(8)}
        assert torch.equal(f.get_tensor("b"), torch.arange(5.0))


# ------------------------------------------------------------------------------------------ state values
@pytest.mark.parametrize("variant", VARIANTS)
def test_state_deepcopies_pickles_and_torch_saves(variant, tmp_path):
    """Each copy is the state (its tensors bit for bit, its position and a read-only config), apart from
    it, and continues the sequence as it does."""
    import copy
    import pickle
    from types import MappingProxyType

    from titans.models.state import state_digest

    model = tiny_model(variant)
    _, state = prefill(model, tokens(2, 13))
    torch.save(state, tmp_path / "s.pt")
    copies = [
        copy.deepcopy(state),
        pickle.loads(pickle.dumps(state)),
        torch.load(tmp_path / "s.pt", weights_only=False),
    ]
    query = tokens(2, 5, seed=3)
    with torch.no_grad():
        want, _ = model(query, state)
    for c in copies:
        assert type(c) is TitansState and state_digest(c) == state_digest(state)
        assert c.position == state.position and c.config == state.config
        assert isinstance(c.config, MappingProxyType)
        assert not set(map(id, state_tensors(c).values())) & set(map(id, state_tensors(state).values()))
        with torch.no_grad():
            got, _ = model(query, c)
        assert torch.equal(got, want)
    bare = TitansState(state.layers, 4, None)
    assert copy.deepcopy(bare).config is None


NEUTRAL = [
    {"memory_monitor_max_norm": 5.0},
    {"memory_backend": "torch"},
    {"memory_checkpoint_every": 2},
    {"init_std": 0.01},
    {"name": "other"},
]


@pytest.mark.parametrize("change", NEUTRAL, ids=lambda c: next(iter(c)))
def test_a_state_is_taken_by_a_model_whose_config_differs_only_in_what_it_does_not_touch(change, tmp_path):
    """These fields change neither the state's layout nor the outputs (monitoring, kernels, training's
    recomputation, the initial weights): such a model continues the state as the state's own model does."""
    a = tiny_model("mag")
    b = tiny_model("mag", **change)
    b.load_state_dict(a.state_dict())
    _, state = prefill(a, tokens(1, 10))
    path = save_state(state, tmp_path / "s.safetensors")
    query = tokens(1, 6, seed=4)
    with torch.no_grad():
        want, _ = a(query, state)
        got, _ = b(query, load_state(path, model=b))
    assert torch.equal(got, want)
    b.check_state(state)
    with pytest.raises(ValueError, match=r"another config \(memory_alpha_init: state 0.01 vs model 0.2\)"):
        tiny_model("mag", memory_alpha_init=0.2, **change).check_state(state)


def test_cat_rows_refuses_states_of_other_configs_by_field():
    from titans.models.state import cat_rows

    _, a = prefill(tiny_model("mag"), tokens(1, 10))
    _, b = prefill(tiny_model("mag", memory_alpha_init=0.2), tokens(1, 10, seed=2))
    with pytest.raises(
        ValueError, match=r"cat_rows: .*other configs \(memory_alpha_init: state 0 0.01 vs state 1 0.2\)"
    ):
        cat_rows([a, b])
    # another chunk: other shapes too, named by the config field (not a bare torch error)
    _, c = prefill(tiny_model("mag", chunk_size=2), tokens(1, 10, seed=3))
    with pytest.raises(ValueError, match=r"cat_rows: .*chunk_size: state 0 4 vs state 1 2"):
        cat_rows([a, c])
    # the same config but another dtype: named by tensor, not promoted
    f32 = map_state(a, lambda t: t.float() if t.is_floating_point() else t)
    with pytest.raises(
        ValueError, match=r"cat_rows: tensor layers\.0\.\S+ is .*torch\.float64.* torch\.float32"
    ):
        cat_rows([a, f32])
    # a config field that changes neither layout nor outputs: joined, as check_state takes either
    _, d = prefill(tiny_model("mag", memory_backend="torch", name="other"), tokens(1, 10, seed=4))
    joined = cat_rows([a, d])
    assert state_batch_size(joined) == 2 and joined.config is a.config
    tiny_model("mag").check_state(joined, 2)
    with pytest.raises(TypeError, match="cat_rows: expected TitansStates, got dict"):
        cat_rows([a, {}])


def test_expand_state_refuses_a_batch_size_below_one():
    _, state = prefill(tiny_model("lmm"), tokens(1, 7))
    for bad in (-1, 0, -5, 2.0, True, "2"):
        with pytest.raises(ValueError, match=rf"expand_state: batch_size must be an int >= 1, got {bad!r}"):
            expand_state(state, bad)
    import numpy as np

    assert state_batch_size(expand_state(state, np.int64(3))) == 3


def test_select_rows_takes_a_list_and_refuses_bad_indices():
    import numpy as np

    from titans.models.state import state_digest

    _, state = prefill(tiny_model("mac"), tokens(3, 9))
    want = state_digest(select_rows(state, torch.tensor([2, 0])))
    for index in ([2, 0], (2, 0), np.array([2, 0]), torch.tensor([2, 0], dtype=torch.int32)):
        assert state_digest(select_rows(state, index)) == want
    with pytest.raises(
        ValueError, match=r"select_rows: rows \[3, -1\] out of range for a state of batch size 3"
    ):
        select_rows(state, [1, 3, -1])
    for bad in ([0.0, 1.0], [True], "01", 2):
        with pytest.raises(TypeError, match="select_rows: index must be a 1-D integer tensor or a list"):
            select_rows(state, bad)
    for bad in (torch.tensor([0.0]), torch.tensor([[0, 1]]), torch.tensor([True])):
        with pytest.raises(TypeError, match="select_rows: index must be a 1-D integer tensor of row numbers"):
            select_rows(state, bad)


def _storage_bytes(state: TitansState) -> int:
    """Bytes of every distinct storage the state's tensors live in: what the state keeps alive."""
    storages = {}
    for t in state_tensors(state).values():
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("variant", ["mag", "mal", "lmm", "swa", "transformer"])
def test_a_state_keeps_alive_what_state_nbytes_counts(variant):
    """Its pending memory rows are tensors of their own, not slices of the whole call's keys, values and
    gates: a state after a long call keeps no more than after a short one."""
    from titans.inference import state_nbytes

    model = tiny_model(variant)
    for length in (7, 203):
        with torch.no_grad():
            _, state = model(tokens(2, length))
        assert _storage_bytes(state) == state_nbytes(state)


def test_pending_rows_pass_gradients_back():
    """Copied, the pending rows still carry the gradient of the next call's loss to the earlier call's
    parameters (truncated backprop across calls): equal to that of one pass over both pieces."""
    ids = tokens(1, 14)
    grads = []
    for cuts in ((14,), (7, 7)):
        model = tiny_model("lmm", train=True)
        state, loss = None, 0.0
        start = 0
        for n in cuts:
            logits, state = model(ids[:, start : start + n], state)
            loss = loss + logits.square().sum()
            start += n
        loss.backward()
        grads.append(model.blocks[0].memory.to_qkv.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(memory_momentum=False),
        dict(memory_rule="yaad"),
        dict(memory_rule="memora"),
        dict(memory_rule="moneta"),
    ],
    ids=["no-momentum", "yaad", "memora", "moneta"],
)
def test_a_state_without_momentum_saves_and_continues(tmp_path, overrides):
    """A memory without momentum keeps log(eta) = -inf in the gates of tokens pending a chunk (eta = 0
    exactly): the state was refused as "diverged" by `save_state` and `state_to_bytes` at any position
    off a chunk boundary. It saves, and continues as the uninterrupted model does; NaN is still refused."""
    from titans.models.state import state_from_bytes, state_to_bytes

    model = tiny_model("lmm", **overrides)
    ids = tokens(2, 19)  # 3 tokens pending a chunk of 4 after 11
    with torch.no_grad():
        whole, _ = model(ids)
        _, state = model(ids[:, :11])
        assert bool(torch.isneginf(state.layers[0].pending_gates).any())
        path = save_state(state, tmp_path / "s.safetensors")
        for restored in (load_state(path, model=model), state_from_bytes(state_to_bytes(state))):
            rest, _ = model(ids[:, 11:], state=restored)
            torch.testing.assert_close(rest, whole[:, 11:], rtol=0, atol=1e-12)
    state.layers[0].pending_gates[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="1 NaN or inf"):
        state_to_bytes(state)
