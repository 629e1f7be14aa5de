"""docs/extending.md's recipes, followed: the rule part and the session store in `examples/` work as the
page says (a new bias is one class and runs in a NeuralMemory; a new store is one class and a scheme, and
the server runs on it)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from titans import NeuralMemory
from titans.ops.memory import Bias, MemoryRule

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
F64 = torch.float64


@pytest.fixture(scope="module")
def examples():
    """The examples folder importable; what they register is removed afterwards (registries are global)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield
    finally:
        sys.path.remove(str(EXAMPLES))
        Bias.registry.pop("scaled_l2", None)
        from titans.serving.stores import STORES

        STORES.pop("memory", None)
        for name in ("scaled_l2_bias", "memory_store"):
            sys.modules.pop(name, None)


def memory(rule, seed: int = 0) -> NeuralMemory:
    torch.manual_seed(seed)
    return NeuralMemory(12, heads=2, depth=2, chunk_size=4, rule=rule).to(F64)


def test_a_bias_written_as_one_class_runs_in_the_memory(examples):
    example = importlib.import_module("scaled_l2_bias")
    x = torch.randn(2, 11, 12, dtype=F64, generator=torch.Generator().manual_seed(1))
    # c = 1 is Titans' l2 bias: the same outputs as the default rule (its fast path), to float64 rounding
    ours = memory(MemoryRule(bias=example.ScaledL2Bias(1.0)))
    titans = memory(MemoryRule())
    ours.load_state_dict(titans.state_dict())
    torch.testing.assert_close(ours(x)[0], titans(x)[0], rtol=1e-10, atol=1e-12)
    # another c is another rule: different outputs; streamed in two calls, the same as one
    half = memory(MemoryRule(bias=example.ScaledL2Bias(0.5)))
    half.load_state_dict(titans.state_dict())
    whole, _ = half(x)
    assert not torch.allclose(whole, titans(x)[0])
    first, state = half(x[:, :5])
    rest, _ = half(x[:, 5:], state)
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, rtol=1e-10, atol=1e-12)
    # gradients reach the layer's parameters through the new part
    whole.square().sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in half.parameters() if p.requires_grad)
    # its field is checked as the built-in parts' are: NaN and inf filled the memory with NaN
    for bad in (float("nan"), float("inf"), True, "abc", -1.0):
        with pytest.raises(ValueError, match="ScaledL2Bias: c must be"):
            example.ScaledL2Bias(bad)
    # a rule with the part round-trips through the config form, and a second class cannot take its kind
    rule = MemoryRule(bias=example.ScaledL2Bias(0.5))
    assert MemoryRule.from_dict(rule.to_dict()) == rule
    with pytest.raises(ValueError, match="scaled_l2"):

        class Again(Bias, kind="scaled_l2"):
            def error_map(self, e, aux):
                return e

            def grad(self, g, e, aux):
                return g, None


def test_a_part_without_dataclass_is_refused_by_the_rule():
    """A part class written without @dataclass registers (the decorator runs after registration), but a
    rule refuses it by name; it built a memory that failed at its first call, inside `dataclasses`."""

    class PlainBias(Bias, kind="plain_for_test"):
        def error_map(self, e, aux):
            return 2 * e

        def grad(self, g, e, aux):
            return 2 * g, None

    try:
        with pytest.raises(
            TypeError, match=r"bias part PlainBias is not a dataclass.*@dataclass\(frozen=True\)"
        ):
            MemoryRule(bias=PlainBias())
    finally:
        Bias.registry.pop("plain_for_test")


@pytest.fixture
def scratch_kinds():
    """Kinds registered by a test, removed from their slots' registries afterwards (they are global)."""
    from titans.ops.memory import Optimizer, Retention

    slots = (Bias, Retention, Optimizer)
    before = [dict(slot.registry) for slot in slots]
    yield
    for slot, kinds in zip(slots, before):
        slot.registry.clear()
        slot.registry.update(kinds)


def test_a_part_derived_from_a_built_in_part_runs_its_own_maths(scratch_kinds):
    """A part derived from L2Bias, DecayRetention or MomentumSGD, with its own maths, ran the parent's:
    it inherited the parent's consent to the fast path, which computes the built-in maths itself and calls
    none of the overrides, so outputs equalled the default rule's exactly. A derived part with a method of
    its own runs on the fast path only if it says so itself; a bias's map and backward come from one
    class."""
    from dataclasses import dataclass

    from titans.ops.memory import DecayRetention, L2Bias, LpBias, MomentumSGD, fits_fast_path

    @dataclass(frozen=True)
    class TripleL2(L2Bias, kind="triple_l2_for_test"):  # 1.5 ||e||^2: 3 e
        def error_map(self, e, aux):
            return 3 * e

        def grad(self, g, e, aux):
            return 3 * g, None

    @dataclass(frozen=True)
    class HalfRead(DecayRetention, kind="half_read_for_test"):
        def read(self, a):
            return a / 2

    @dataclass(frozen=True)
    class FrozenSGD(MomentumSGD, kind="frozen_sgd_for_test"):  # the state never moves
        @property
        def uses_momentum(self):
            return super().uses_momentum

        def momentum_coefficients(self, beta, log_eta):
            return super().momentum_coefficients(beta, log_eta)

        def update(self, a_state, s_state, s_new, *args):
            return a_state

    x = torch.randn(2, 11, 12, dtype=F64, generator=torch.Generator().manual_seed(1))
    titans = memory(MemoryRule())
    y, _ = titans(x)
    triple = memory(MemoryRule(bias=TripleL2()))
    triple.load_state_dict(titans.state_dict())
    assert fits_fast_path(triple.rule)  # a bias's maths run there through its own methods

    @dataclass(frozen=True)
    class Scaled(Bias, kind="scaled_for_test"):  # c ||e||^2 written from the slot
        c: float

        def error_map(self, e, aux):
            return 2 * self.c * e

        def grad(self, g, e, aux):
            return 2 * self.c * g, None

    scaled = memory(MemoryRule(bias=Scaled(1.5)))
    scaled.load_state_dict(titans.state_dict())
    torch.testing.assert_close(triple(x)[0], scaled(x)[0], rtol=1e-10, atol=1e-12)
    assert not torch.allclose(triple(x)[0], y)
    for rule in (MemoryRule(retention=HalfRead()), MemoryRule(optimizer=FrozenSGD())):
        assert not fits_fast_path(rule)
        ours = memory(rule)
        ours.load_state_dict(titans.state_dict())
        assert not torch.allclose(ours(x)[0], y)
    _, state = memory(MemoryRule(optimizer=FrozenSGD()))(x)
    first = memory(MemoryRule(optimizer=FrozenSGD())).initial_state(2, x.device, F64)
    assert all(torch.equal(a, b) for a, b in zip(state.weights, first.weights))
    # a derived part that writes its error map and leaves the gradient to its parent is refused: the fast
    # path would pair the two
    with pytest.raises(TypeError, match=r"takes error_map from Cubic, grad from LpBias: define error_map"):

        class Cubic(LpBias, kind="cubic_for_test"):
            def error_map(self, e, aux):
                return e**3


def test_a_part_s_property_written_as_a_method_is_refused(scratch_kinds):
    """`uses_momentum` written as a method (the table listed it among the methods) was read as always
    true: momentum stayed on for a part that meant it off."""
    from titans.ops.memory import Optimizer

    with pytest.raises(TypeError, match=r"uses_momentum must be a property"):

        class NoMomentum(Optimizer, kind="no_momentum_for_test"):
            def uses_momentum(self):
                return False

            def momentum_coefficients(self, beta, log_eta):
                return beta

            def update(self, *args):
                return args[0]

    from dataclasses import dataclass

    from titans.ops.memory import MomentumSGD

    @dataclass(frozen=True)
    class FieldMomentum(MomentumSGD, kind="field_momentum_for_test"):  # a field is a value, as a property
        uses_momentum: bool = False

    assert MemoryRule(optimizer=FieldMomentum()).uses_momentum is False


def test_a_window_subclass_and_an_unknown_kind_are_refused_by_name(scratch_kinds):
    """A Window subclass ran in a NeuralMemory, but a config saved it as a plain Window and rebuilt that;
    a saved rule whose part's module was not imported said only that its kind was not one of the
    built-in ones."""
    from dataclasses import dataclass

    from titans.ops.memory import Window

    @dataclass(frozen=True)
    class FlatWindow(Window):
        pass

    with pytest.raises(TypeError, match="window must be a Window, got FlatWindow"):
        MemoryRule(window=FlatWindow(4))
    with pytest.raises(ValueError, match=r"got 'not_imported'.*import it before building or loading"):
        MemoryRule.from_dict({"bias": {"kind": "not_imported"}})


def test_a_part_defined_again_replaces_itself(scratch_kinds):
    """A notebook cell defining a part, run a second time (after a fix), was refused: its kind was taken
    by its own earlier definition. The same class (module and name) replaces itself; another class
    cannot take the kind."""

    def define(scale):
        class Mine(Bias, kind="mine_for_test"):
            def error_map(self, e, aux):
                return scale * e

            def grad(self, g, e, aux):
                return scale * g, None

        return Mine

    first, second = define(2), define(3)
    assert Bias.registry["mine_for_test"] is second is not first
    with pytest.raises(ValueError, match="kind 'mine_for_test' is taken by Mine; Other needs another"):

        class Other(Bias, kind="mine_for_test"):
            def error_map(self, e, aux):
                return e

            def grad(self, g, e, aux):
                return g, None


def test_the_server_runs_on_a_store_added_as_one_class(examples, tmp_path):
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    httpx = pytest.importorskip("httpx", reason="the serve-test extra is not installed")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serving_support import ThreadServer, make_checkpoint
    from titans.runtime.loading import load_trained
    from titans.serving.app import create_app
    from titans.serving.session import Engine
    from titans.serving.stores import open_store

    importlib.import_module("memory_store")
    store = open_store("memory://")
    assert store.kind == "memory"
    model, tokenizer = load_trained(make_checkpoint(tmp_path / "run"))
    app = create_app(Engine(model, tokenizer, max_snapshots=3), store, key_hashes=None, workers=1)
    with ThreadServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        sid = http.post("/v1/sessions").json()["id"]
        first = http.post(f"/v1/sessions/{sid}/read", json={"text": "Call me Ishmael."})
        assert first.status_code == 200, first.text
        digest = http.get(f"/v1/sessions/{sid}/stats").json()["state_sha256"]
        r = http.post(f"/v1/sessions/{sid}/generate", json={"prompt": "Some years", "max_new_tokens": 5})
        assert r.status_code == 200, r.text
        assert http.get(f"/v1/sessions/{sid}/stats").json()["state_sha256"] != digest
        assert len(http.get(f"/v1/sessions/{sid}/snapshots").json()["snapshots"]) >= 1
        assert http.post(f"/v1/sessions/{sid}/rollback", json={"snapshot": 1}).status_code == 200
        assert http.get(f"/v1/sessions/{sid}/stats").json()["state_sha256"] == digest
        assert store.count() == 1 and store.usage(store.get(sid).owner)[0] == 1
        assert http.delete(f"/v1/sessions/{sid}").status_code == 200
        assert store.count() == 0


def test_the_example_store_expires_like_the_built_in_ones_and_keeps_out_of_workers(examples):
    """The server expires an idle session with `delete(sid, owner, changed_before=...)`: the example store
    took no such argument, so each expiry failed with a TypeError (logged as a store failure) and the
    session stayed. A store added with `register_store` cannot be opened by a worker process (a fresh
    interpreter), and `--worker-processes yes` on one never became ready: it is refused by name."""
    import torch

    from titans.serving.cli import worker_processes
    from titans.serving.stores import open_store

    importlib.import_module("memory_store")
    store = open_store("memory://")
    written = store.create("s1", "key", b"state").updated
    assert not store.delete("s1", "key", changed_before=written)  # written since: kept
    assert not store.delete("s1", "other", changed_before=written + 60)  # not the owner's
    assert store.delete("s1", "key", changed_before=written + 60) and store.count() == 0
    with pytest.raises(ValueError, match="--worker-processes yes: .* a 'memory' store is not one it can"):
        worker_processes("yes", torch.device("cpu"), store)
    assert not worker_processes("auto", torch.device("cpu"), store)


def test_a_registered_variant_without_a_static_step_is_refused_before_the_prompt_is_read(monkeypatch):
    """A variant added as docs/extending.md says (a `Variant` entry, its block a new class) decodes
    eagerly. The compiled decoder has steps for the built-in blocks only: it took a subclass of one for
    that block and left the subclass's change out, and a new block failed with a TypeError only after the
    prompt was prefilled. It is refused by `generate(compiled=...)` before any work, naming the block."""
    import dataclasses

    from titans import TitansConfig, TitansLM
    from titans.layers.memory import MemoryState
    from titans.models.blocks import MemoryBlock
    from titans.models.streaming import generate
    from titans.models.variants import VARIANT_SPECS, Variant

    class HalfMemoryBlock(MemoryBlock):  # the memory's output halved: another token mixer
        def mix(self, x, state, stats):
            y, new = super().mix(x, state, stats)
            return y / 2, new

    spec = Variant("half", HalfMemoryBlock, MemoryState, "window", memory=True, attention=False)
    monkeypatch.setitem(VARIANT_SPECS, "half", spec)  # as an entry written into variants.py would be
    monkeypatch.setattr("titans.models.config.VARIANTS", tuple(VARIANT_SPECS))
    cfg = TitansConfig(vocab_size=32, dim=16, depth=1, heads=2, chunk_size=4, variant="half")
    torch.manual_seed(0)
    model = TitansLM(cfg).eval()
    prompt = torch.randint(0, 32, (1, 5))
    assert generate(model, prompt, 3).shape == (1, 8)  # eager decoding follows the block's forward
    for compiled in (True, "eager"):
        with pytest.raises(ValueError, match="block HalfMemoryBlock has no static decoding step"):
            generate(model, prompt, 3, compiled=compiled)
    lmm = TitansLM(dataclasses.replace(cfg, variant="lmm")).eval()
    lmm.load_state_dict(model.state_dict())  # the same weights: the built-in block decodes compiled
    assert torch.equal(
        generate(lmm, prompt, 3, compiled="eager", greedy=True), generate(lmm, prompt, 3, greedy=True)
    )
