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
