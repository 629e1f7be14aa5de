"""Decoding through fixed state buffers (`titans.models.decode_graph.StaticDecoder`) equals the eager
single-token step: logits, greedy tokens and the state, over a prompt and more than two memory chunks (and
one MAC segment boundary) of new tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titans import TitansConfig, TitansLM
from titans.inference.inspection.trace import set_surprise_threshold
from titans.inference.session import frozen_twin
from titans.models.decode_graph import StaticDecoder, checkout, decode_cycle
from titans.models.streaming import generate

# chunk 4, segment and window 8: 13 new tokens after a 7-token prompt cross three chunk boundaries, a
# segment boundary and the window's wrap-around
SMALL = dict(
    dim=32, heads=2, depth=2, chunk_size=4, segment_len=8, window=8, vocab_size=64, persistent_tokens=2
)
VARIANTS = ("mac", "mag", "mal", "lmm", "swa")


def _model(variant: str, **overrides) -> TitansLM:
    torch.manual_seed(0)
    return TitansLM(TitansConfig.preset("tiny", variant=variant, **{**SMALL, **overrides})).eval()


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor of a state tree in field order (aliases repeated, unlike `map_tensors`)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    return []


def _assert_states_close(got, want, tol: float = 1e-5) -> None:
    assert got.position == want.position
    a, b = _tensors(got.layers), _tensors(want.layers)
    assert [t.shape for t in a] == [t.shape for t in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


def _compare(
    model: TitansLM, mode: str, steps: int = 13, batch: int = 2, tol: float = 1e-5, **kwargs
) -> StaticDecoder:
    """Step the eager model and a StaticDecoder from the same prefilled state, greedily, asserting at every
    step that their logits, greedy tokens and states agree; returns the decoder after `steps` steps (from
    a 7-token prompt)."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (batch, 7), generator=gen)
    prompt = prompt.to(next(model.parameters()).device)
    with torch.no_grad():
        logits, state = model(prompt)
        decoder = StaticDecoder(model, state, mode=mode, **kwargs)
        logits = logits[:, -1]
        for _ in range(steps):
            token = logits.argmax(-1, keepdim=True)
            want, state = model(token, state)
            logits = want[:, -1]
            got = decoder.step(token)
            torch.testing.assert_close(got, logits, rtol=tol, atol=tol)
            assert torch.equal(got.argmax(-1), logits.argmax(-1))
            _assert_states_close(decoder.state(), state, tol)
    return decoder


@pytest.mark.parametrize("variant", VARIANTS)
def test_static_step_equals_eager(variant):
    decoder = _compare(_model(variant), "eager")  # asserts every step's logits and state
    assert decoder.state().position == 7 + 13


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["cuda_graph", "compile"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_static_step_on_cuda_equals_eager(variant, mode):
    """On a GPU: the step replayed as a CUDA graph (and compiled) equals the eager step, the eager memory on
    the Triton kernels; float32 both, tf32 off (torch's default)."""
    decoder = _compare(_model(variant).cuda(), mode, tol=1e-4)
    assert decoder.state().position == 7 + 13


@pytest.mark.parametrize(
    "overrides",
    [
        dict(memory_rule="atlas"),  # a windowed rule: history rows before the chunk's pending rows
        dict(memory_write=False),  # a frozen memory: read, never written
        dict(memory_max_norm=1.0, memory_forget_to="init"),
        dict(memory_conv_kernel=0, memory_depth=1),
    ],
    ids=["atlas", "frozen", "max_norm_init", "no_conv_depth1"],
)
def test_static_step_memory_options(overrides):
    decoder = _compare(_model("mag", **overrides), "eager")  # asserts every step's logits and state
    assert decoder.state().position == 7 + 13


@pytest.mark.parametrize("variant", ["swa", "mag", "mal"])
def test_static_step_persistent_rope_none(variant):
    """Queries score the persistent tokens unrotated: the static step follows the eager layer."""
    decoder = _compare(_model(variant, persistent_rope="none"), "eager")
    assert decoder.state().position == 7 + 13


def test_static_step_persistent_to_memory():
    """MAG's memory reads the persistent tokens first: its chunk phase is offset from the model's."""
    decoder = _compare(_model("mal", persistent_to_memory=True, persistent_tokens=3), "eager")
    assert {layer.memory.offset for layer in decoder.layers} == {3}


@pytest.mark.slow  # about a minute of tracing on a loaded 2-core CPU
def test_compiled_step_traces_and_equals_eager():
    """torch.compile traces every phase's step (read, chunk write, segment end) into one graph each, and the
    traced step equals the eager step. aot_eager runs the traced graph without code generation (inductor's
    compile takes minutes on a small CPU; `benchmarks/decode_graph.py` runs it)."""
    torch._dynamo.reset()
    # 5 steps from position 7: a segment end (7), reads (8-10) and a chunk write (11)
    decoder = _compare(_model("mac", depth=1), "compile", steps=5, compile_backend="aot_eager")
    assert set(decoder._steps) == {(False, False), (True, False), (True, True)}
    # a code object per phase: torch.compile's cache limit (8 per code) is the phase's alone
    codes = decoder.model._static_decoders.codes
    assert len(codes) == 3 and len({c.co_name for c in codes.values()}) == 3


@pytest.mark.parametrize(
    "variant, overrides",
    [("mac", {}), ("lmm", {}), ("mag", dict(memory_max_norm=1.0, memory_forget_to="init"))],
    ids=["mac", "lmm", "mag_max_norm_init"],
)
def test_compiled_step_has_no_graph_break_at_batch_above_one(variant, overrides):
    """At batch 2 and 3 each phase's step traces to one graph (the memory's conv writes its q/k/v layout, a
    strided view there, without an `out=` that dynamo refuses; the bound and the anchor of a chunk write
    without their autograd Functions) and equals the eager step over a whole chunk/segment cycle.
    backend "eager": dynamo's tracing alone, no code generation."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model = _model(variant, depth=1, **overrides)
    phases = 3 if variant == "mac" else 2  # read, chunk write (and MAC's segment end)
    for batch in (2, 3):
        decoder = _compare(model, "compile", steps=decode_cycle(model), batch=batch, compile_backend="eager")
        assert len(decoder._steps) == phases
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 2 * phases  # one per phase and batch size


def _guard_kinds(model: TitansLM) -> list[str]:
    """The guards of each compiled step's code on the model, in the order they were made."""
    return [key[3] for key in model._static_decoders.codes]


@pytest.mark.slow  # tracing, as above, for two batch sizes
def test_state_guards_equal_eager_and_tell_shapes_apart():
    """guards="state" drops torch.compile's guards on the model's modules and globals (about nine in ten)
    and keeps those on tensors and on the decoder's own objects. A batch-1 decoder after a batch-2 one
    shares their compiled code: the kept guards see the other shapes and compile again (with every guard
    dropped, the batch-2 graph would run on batch-1 buffers), and both equal the eager step, over chunk
    writes and segment ends, with the state equal after each step."""
    torch._dynamo.reset()
    model = _model("mac", depth=1, memory_conv_kernel=0)
    kwargs = dict(steps=10, compile_backend="aot_eager", guards="state")
    two = _compare(model, "compile", **kwargs)  # positions 7..16: two segment ends, two chunk writes
    one = _compare(model, "compile", batch=1, **kwargs)
    assert two._steps.keys() == one._steps.keys() == {(False, False), (True, False), (True, True)}
    assert _guard_kinds(model) == ["state"] * 3  # one code per phase, shared by both decoders
    with torch.no_grad():  # back to the first decoder: its own entries still match it
        _, state = model(torch.randint(0, 64, (2, 12)))
        two.load(state)
        token = torch.randint(0, 64, (2, 1))
        want, state = model(token, state)
        torch.testing.assert_close(two.step(token), want[:, -1], rtol=1e-5, atol=1e-5)
        _assert_states_close(two.state(), state)


@pytest.mark.slow  # tracing, as above, twice
def test_state_guards_see_a_changed_model():
    """A setting of the model's modules changed between generations (a memory's surprise threshold, which
    the dropped guards would have seen) is picked up by a new decoder and by one loaded again: their steps
    compile anew and equal the eager step, the memory now skipping writes."""
    torch._dynamo.reset()
    model = _model("mac", depth=1, memory_conv_kernel=0)
    first = _compare(model, "compile", steps=2, compile_backend="aot_eager", guards="state")
    set_surprise_threshold(model, 1e6)  # no token is that surprising: nothing is written
    _compare(model, "compile", steps=6, compile_backend="aot_eager", guards="state")  # a new decoder
    assert _guard_kinds(model) == ["state"] * 5  # 2 phases before, 3 after
    with torch.no_grad():  # the first decoder, loaded again, steps as the changed model does
        _, state = model(torch.randint(0, 64, (2, 11)))
        first.load(state)
        for _ in range(2):  # positions 11, 12: a chunk end (no token written, the forgetting applied), a read
            token = torch.randint(0, 64, (2, 1))
            want, state = model(token, state)
            torch.testing.assert_close(first.step(token), want[:, -1], rtol=1e-5, atol=1e-5)
            _assert_states_close(first.state(), state)  # a stale step would have written the chunk


@pytest.mark.slow  # tracing, as above
def test_state_guards_fall_back_on_a_graph_break():
    """A step that does not trace to one graph (here a forward hook that breaks it) is compiled with every
    guard instead (a frame compiled after a break is shared by all decoders and models: its guards must
    stay), and equals the eager step."""
    torch._dynamo.reset()
    model = _model("mac", depth=1)
    model.blocks[0].mlp.register_forward_hook(lambda *_: torch._dynamo.graph_break())
    _compare(model, "compile", steps=3, compile_backend="aot_eager", guards="state")
    assert _guard_kinds(model) == ["state", "full"] * 2  # each phase tried once, then compiled in full


@pytest.mark.slow  # inductor's code generation: minutes on a loaded 2-core CPU
def test_pointwise_matmuls_equal_eager():
    """The default mm="pointwise" (inductor writes the one-token matmuls into its generated code), with
    guards="state", compiled by inductor, equals the eager step over a segment end and a chunk write."""
    torch._dynamo.reset()
    model = _model("mac", depth=1, memory_conv_kernel=0)
    decoder = _compare(model, "compile", steps=5, batch=1, guards="state")
    assert decoder.mm == "pointwise" and _guard_kinds(model) == ["state"] * 3


def test_generate_compiled_equals_eager_and_reuses_decoder():
    model = _model("mac")
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    want, want_state = generate(model, prompt, 14, greedy=True, return_state=True)
    got, got_state = generate(model, prompt, 14, greedy=True, return_state=True, compiled="eager")
    assert torch.equal(got, want)
    _assert_states_close(got_state, want_state)
    (free,) = model._static_decoders.values()
    (first,) = free  # given back
    again = generate(model, got[:, :9], 10, greedy=True, compiled="eager")  # reloads the same decoder
    assert torch.equal(again, generate(model, got[:, :9], 10, greedy=True))
    assert free == [first]
    with checkout(model, got_state, "eager") as a, checkout(model, want_state, "eager") as b:
        assert a is first and b is not first  # taken: a second caller gets buffers of its own
    assert len(free) == 2
    assert frozen_twin(model)._static_decoders == {}  # a deep copy's decoders would step the original


def test_decode_cycle():
    assert decode_cycle(_model("mac")) == 8  # chunk 4, segment 8
    assert decode_cycle(_model("mag", chunk_size=3)) == 3
    assert decode_cycle(_model("swa")) == 1


def test_generate_compiled_refuses_a_non_finite_memory():
    """The static steps skip the eager memory's per-token finiteness check: generate checks the decoder's
    memory once at the end, and refuses as the eager step does (a server's guard reads "non-finite")."""
    model = _model("mag")
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, state = model(prompt)
    state.layers[0].memory.weights[0][0, 0, 0, 0] = float("nan")
    for compiled in (False, "eager"):
        with pytest.raises(ValueError, match="non-finite"):
            generate(model, prompt[:, :1], 6, greedy=True, state=state, compiled=compiled)


@pytest.mark.parametrize(
    "sampling", [dict(greedy=True), dict(temperature=1.0), dict(temperature=0.8, top_k=10)], ids=str
)
def test_generate_compiled_refuses_logits_from_a_memory_that_diverges(sampling):
    """A chunk write that diverges while decoding (the chunk the second new token completes): the eager
    step's check refuses the next token at once; the static steps meet non-finite logits, which multinomial
    refused with a RuntimeError (sampling) and argmax turned into token 0 (greedy, passed to on_token).
    Both paths raise ValueError ("non-finite", which a session's guard reads), and on_token gets the same
    tokens, none drawn from non-finite logits."""
    model = _model("lmm")
    for block in model.blocks:
        block.memory.max_lr, block.memory.surprise_clip = 1e30, None
    prompt = torch.randint(0, 64, (1, 2), generator=torch.Generator().manual_seed(2))
    seen: dict[object, list[int]] = {}
    for compiled in (False, "eager"):
        for on_token in (None, lambda t, key=compiled: seen.setdefault(key, []).append(int(t))):
            with pytest.raises(ValueError, match="non-finite"):
                gen = torch.Generator().manual_seed(0)
                generate(model, prompt, 8, compiled=compiled, on_token=on_token, generator=gen, **sampling)
    assert len(seen[False]) == 3 and seen["eager"] == seen[False]


def test_load_continues_from_another_state():
    model = _model("mag")
    with torch.no_grad():
        _, a = model(torch.randint(0, 64, (1, 6)))
        logits, b = model(torch.randint(0, 64, (1, 11)))
        decoder = StaticDecoder(model, a, mode="eager")
        decoder.load(b)
        token = logits[:, -1:].argmax(-1)
        want, b = model(token, b)
        torch.testing.assert_close(decoder.step(token), want[:, -1], rtol=1e-5, atol=1e-5)
        _assert_states_close(decoder.state(), b)


def test_refusals():
    with torch.no_grad():
        _, state = _model("transformer")(torch.zeros(1, 3, dtype=torch.long))
        with pytest.raises(ValueError, match="full causal attention"):
            StaticDecoder(_model("transformer"), state, mode="eager")
        # generate refuses it before the prompt is read, whatever max_new_tokens (0 and 1 built no
        # decoder and ran eagerly; 2 read the whole prompt first)
        read = []
        transformer = _model("transformer")
        transformer.forward = lambda *a, **k: read.append(1)
        for n in (0, 1, 2):
            with pytest.raises(ValueError, match="generate: full causal attention"):
                generate(transformer, torch.zeros(1, 3, dtype=torch.long), n, compiled=True)
        assert not read
        model = _model("lmm")
        _, state = model(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="mode must be one of"):
        StaticDecoder(model, state, mode="graph")
    with pytest.raises(ValueError, match="guards must be one of"):
        StaticDecoder(model, state, guards="none")
    with pytest.raises(ValueError, match="mm must be one of"):
        StaticDecoder(model, state, mm="gemm")
    with pytest.raises(ValueError, match="needs a CUDA model"):
        StaticDecoder(model, state, mode="cuda_graph")
    with pytest.raises(ValueError, match="at least one token"):
        StaticDecoder(model, None, mode="eager")
    decoder = StaticDecoder(model, state, mode="eager")
    with pytest.raises(ValueError, match=r"tokens must be \(1, 1\)"):
        decoder.step(torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(TypeError, match="tokens must hold integer token ids, got dtype torch.float32"):
        decoder.step(torch.tensor([[1.7]]))  # as the eager model refuses it (.long() truncated it to 1)
    assert decoder.position == 3


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_step_refuses_ids_outside_the_vocab(mode):
    """As `TitansLM.forward` does (a bare IndexError from the embedding before): nothing runs, the state
    stays where it was; every integer dtype is taken. (mode "cuda_graph" leaves ids to its caller.)"""
    model = _model("mag")
    with torch.no_grad():
        _, state = model(torch.zeros(2, 3, dtype=torch.long))
    decoder = StaticDecoder(model, state, mode=mode, compile_backend="eager")
    for bad, got in (([[64], [3]], r"\[3, 64\]"), ([[-1], [3]], r"\[-1, 3\]")):
        with pytest.raises(
            ValueError, match=rf"StaticDecoder.step: token ids must lie in \[0, 64\), got {got}"
        ):
            decoder.step(torch.tensor(bad))
    assert decoder.position == 3 and int(decoder.pos) == 3
    ids = torch.tensor([[5], [63]])
    want = model(ids, state)[0][:, -1]
    for dtype in (torch.uint16, torch.int8):  # TitansLM.forward takes them too
        reference = StaticDecoder(model, state, mode="eager")
        torch.testing.assert_close(reference.step(ids.to(dtype)), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decoder.step(ids), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"StaticDecoder.step: tokens must be \(2, 1\), got list"):
        decoder.step([[1], [2]])


def test_cli_generate_compile_flag(tmp_path, capsys):
    """`titans generate --compile eager` prints what the eager steps print (20 tokens: writes included)."""
    from tiny_lm import save_tiny_run, tiny_model
    from titans.cli import main as titans_main

    model = tiny_model("mac", dtype=torch.float32, vocab_size=256, segment_len=16, chunk_size=8)
    save_tiny_run(tmp_path / "run", model)
    args = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "ab", "--max-new-tokens", "20"]
    outs = []
    for extra in ([], ["--compile", "eager"]):
        assert titans_main([*args, "--greedy", "--no-stop", "--device", "cpu", *extra]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and len(outs[0]) > 2


# chunk 3, segment 6, window 5: 13 steps from a 7-token prompt cross four chunk ends, two segment ends and
# the window's wrap, at positions that are no multiple of 4 or 8
AWKWARD = dict(chunk_size=3, segment_len=6, window=5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_static_step_under_autocast_equals_eager(variant):
    """Under bf16 autocast the attention's new keys and values come in bf16 (index_copy_ refused them into
    float32 buffers): the buffers take the state's dtypes, as the eager caches hold them, and a write is
    cast to them. Fed the eager step's greedy tokens, the static step's logits and state are the eager
    step's to bf16 accuracy, and the eager model continues from the decoder's state (a float32 cache was
    refused). The memory reads in its state's dtype, as the eager op does: without attention (lmm) the
    logits agree to float32 accuracy (a bf16 read was 3e-3 off)."""
    model = _model(variant, **AWKWARD)
    tol = 1e-5 if variant == "lmm" else 2e-2
    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits, state = model(prompt)
        decoder = StaticDecoder(model, state, mode="eager")
        for _ in range(13):
            token = logits[:, -1].argmax(-1, keepdim=True)
            logits, state = model(token, state)
            torch.testing.assert_close(decoder.step(token).float(), logits[:, -1].float(), rtol=0, atol=tol)
        got = decoder.state()
        a, b = _tensors(got.layers), _tensors(state.layers)
        assert [(t.shape, t.dtype) for t in a] == [(t.shape, t.dtype) for t in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=2e-2)
        token = logits[:, -1].argmax(-1, keepdim=True)
        torch.testing.assert_close(
            model(token, got)[0].float(), model(token, state)[0].float(), rtol=0, atol=tol
        )


def test_decoders_under_autocast_and_without_keep_their_dtypes():
    """A state streamed under autocast and one without get decoders of their own from the pool (their
    buffers hold the state's dtypes), and loading a decoder with a state of other dtypes is refused by name:
    copy_ rounded a float32 state into bf16 buffers."""
    model = _model("mag", **AWKWARD)
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    token = prompt[:, -1:]
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, half = model(prompt)
            with checkout(model, half, "eager") as first:
                first.step(token)
        _, state = model(prompt)
        with checkout(model, state, "eager") as second:
            assert second is not first
            torch.testing.assert_close(
                second.step(token), model(token, state)[0][:, -1], rtol=1e-5, atol=1e-5
            )
        with pytest.raises(
            ValueError, match="state holds torch.float32 where this decoder holds torch.bfloat16"
        ):
            first.load(state)


@pytest.mark.parametrize("variant", ["mac", "mag", "swa"])
def test_static_step_float64_attends_in_float64(variant):
    """A float64 model's static attention scores in float64, not float32 (which left the logits ~1e-9 off
    the eager step's): the static and eager steps agree to float64 rounding."""
    decoder = _compare(_model(variant, **AWKWARD).double(), "eager", tol=1e-12)
    assert decoder.state().position == 7 + 13
