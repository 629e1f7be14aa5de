"""The variant registry and what rests on it: one entry per variant that every variant-dependent place
asks, MAL in the block pattern with its own state (same weights, same outputs, old state files load), and
residual projections marked by their layers (the same initial weights as the name-suffix rule)."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from tiny_lm import random_tokens
from tiny_lm import tiny_model as shared_model
from titans import VARIANTS, NeuralMemory, TitansConfig, TitansLM
from titans.layers.residual import is_residual_output
from titans.layers.state_tree import STATE_TYPES
from titans.models import MEMORY_VARIANTS, VARIANT_SPECS, LMOutput
from titans.models.blocks import IdentityInitGate, MAGState, MALState
from titans.models.state import load_state, save_state

VOCAB = 61
tiny_model = partial(shared_model, vocab_size=VOCAB)
tokens = partial(random_tokens, vocab=VOCAB)


def test_registry_is_the_one_list_of_variants():
    assert VARIANTS == ("mac", "mag", "mal", "lmm", "transformer", "swa")
    assert MEMORY_VARIANTS == ("mac", "mag", "mal", "lmm")
    assert [v for v, s in VARIANT_SPECS.items() if s.quadratic] == ["transformer"]
    assert [v for v, s in VARIANT_SPECS.items() if s.segmented] == ["mac"]
    for name, spec in VARIANT_SPECS.items():
        assert spec.name == name and spec.state_type.__name__ in STATE_TYPES
        model = tiny_model(name, memory_layers=[1] if spec.memory else None)
        _, state = model(tokens(1, 5))
        assert type(model.blocks[1]) is spec.block and type(state.layers[1]) is spec.state_type
        assert model.config.spec is spec


def test_streaming_unit_and_the_segment_check():
    cfg = TitansConfig(variant="mac", segment_len=12, chunk_size=4)
    assert cfg.spec.streaming_unit(cfg) == 12
    assert TitansConfig(variant="mag", segment_len=12, chunk_size=8).spec.streaming_unit(cfg) == 4
    with pytest.raises(ValueError, match="must divide segment_len=12 for mac"):
        TitansConfig(variant="mac", segment_len=12, chunk_size=8)
    TitansConfig(variant="mag", segment_len=12, chunk_size=8)  # only the segmented variant needs it


# A seeded tiny MAL's logits, two pieces threaded through the state, computed with the MAL block before it
# took the Block pattern (its own `forward`, MAG's state type): the same weights must give the same values.
MAL_NAMES = {
    "attn.k_proj.weight",
    "attn.o_proj.weight",
    "attn.persistent",
    "attn.q_proj.weight",
    "attn.qk_log_scale",
    "attn.v_proj.weight",
    "memory.conv.bias",
    "memory.conv.weight",
    "memory.init_weights.0",
    "memory.init_weights.1",
    "memory.norm.weight",
    "memory.to_gate.weight",
    "memory.to_gates.bias",
    "memory.to_gates.weight",
    "memory.to_out.weight",
    "memory.to_qkv.weight",
    "mlp.down_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "norm_mem.weight",
    "norm_mix.weight",
    "norm_mlp.weight",
}
MAL_EXPECTED = {
    "default": (
        [
            -0.04341936553844066, 0.04619733779101641, 0.017526394286952306, -0.08421280306148846,
            -0.023961311983816878, 0.05292770964772633, -0.12682516599238608, 0.009448185037101842,
            -0.018243702123989954, -0.07438951413679967, -0.016523984874360704, 0.09028429558022769,
            -0.15607452584176632, 0.02964987755253966, -0.043518077597947125, -0.14918643285588476,
            0.015816130286093525, -0.03219532614741529, -0.055109492373368485, 0.04007848962336824,
            0.020372788314716665, -0.11068867812563349, 0.032014078695994576, -0.017881063080290163,
        ],
        -20.647793813107132,
        100.65496152538228,
    ),
    "paper": (
        [
            -0.042503287007146805, 0.0480867215937925, -0.0008695366749187073, -0.08914443875484196,
            -0.021158256555341988, 0.055046809425539654, -0.13709612007734479, 0.012315245501738207,
            -0.015559489343441773, -0.08000769002285885, -0.014246548659773718, 0.09858886867823731,
            -0.1451102751906456, 0.03504801882808535, -0.06077151003143307, -0.16109513730306516,
            0.02364883381326037, -0.029487833975069978, -0.06435012950993688, 0.04093933663280412,
            0.02316648333368966, -0.11146916631267062, 0.034846225362487215, -0.017925993060758854,
        ],
        -20.67188108675086,
        100.60716964412241,
    ),
}  # fmt: skip
MAL_OPTIONS = {"default": {}, "paper": dict(persistent_to_memory=True, mal_attn_persistent=False)}


@pytest.mark.parametrize("case", MAL_EXPECTED)
def test_mal_weights_and_outputs_are_those_of_its_own_forward(case):
    model = tiny_model("mal", seed=3, **MAL_OPTIONS[case])
    names = MAL_NAMES - {"attn.persistent"} | {"memory_persistent"} if case == "paper" else MAL_NAMES
    expected_names = {f"blocks.{i}.{n}" for i in range(2) for n in names} | {
        "embed.weight",
        "head.weight",
        "norm.weight",
    }
    assert set(model.state_dict()) == expected_names  # checkpoints of MAL models load as they are
    x = tokens(2, 11)
    with torch.no_grad():
        first, state = model(x[:, :7])
        second, state = model(x[:, 7:], state)
    logits = torch.cat([first, second], 1)
    values, total, total_abs = MAL_EXPECTED[case]
    torch.testing.assert_close(logits[:, ::3, :3].flatten(), torch.tensor(values, dtype=torch.float64))
    assert logits.sum().item() == pytest.approx(total, abs=1e-10)
    assert logits.abs().sum().item() == pytest.approx(total_abs, abs=1e-10)
    assert all(type(s) is MALState for s in state.layers)


def test_a_mal_state_file_that_names_mag_state_loads_as_mal_state(tmp_path):
    """State files may name a MAL layer's state "MAGState" (the same fields): they load, as MALState, and
    continue the stream exactly."""
    model = tiny_model("mal", memory_layers=[0])
    x = tokens(2, 17)
    with torch.no_grad():
        _, state = model(x[:, :9])
    path = save_state(state, tmp_path / "new.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    layers = json.loads(meta["titans.layers"])
    assert [layer["type"] for layer in layers] == ["MALState", "AttentionState"]
    layers[0]["type"] = "MAGState"
    old = tmp_path / "old.safetensors"
    save_file(tensors, str(old), metadata={**meta, "titans.layers": json.dumps(layers)})

    loaded = load_state(old, model=model)
    assert [type(s) for s in loaded.layers] == [MALState, type(state.layers[1])]
    with torch.no_grad():
        want, _ = model(x[:, 9:], state)
        got, _ = model(x[:, 9:], loaded)
    assert torch.equal(got, want)
    # a MAG model's MAGState stays one
    mag = tiny_model("mag")
    with torch.no_grad():
        _, mag_state = mag(x[:, :5])
    assert type(load_state(save_state(mag_state, tmp_path / "mag.safetensors")).layers[0]) is MAGState


def _old_rule_init(model: TitansLM) -> None:
    """`TitansLM.reset_parameters` as it picked the residual outputs by the suffix of their names."""
    std = model.config.init_std
    memory_gates = {id(m.to_gates) for m in model.modules() if isinstance(m, NeuralMemory)}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and id(module) not in memory_gates:
            residual_out = name.endswith(("o_proj", "down_proj", "to_out", "combine.proj"))
            scale = (2 * model.config.depth) ** -0.5 if residual_out else 1.0
            nn.init.normal_(module.weight, std=std * scale)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
    for module in model.modules():
        if isinstance(module, IdentityInitGate):
            module.reset_parameters()


OPTIONS = [
    {},
    {"attn_output_gate": True, "persistent_to_memory": True},
    {"mac_gate": "open", "mac_norm_memory_tokens": True, "mal_attn_persistent": False},
    {"memory_layers": [1], "tie_embeddings": False},
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("options", OPTIONS, ids=range(len(OPTIONS)))
def test_marked_residual_projections_are_those_of_the_name_rule(variant, options):
    model = tiny_model(variant, seed=5, dtype=torch.float32, **options)
    marked = {name for name, m in model.named_modules() if is_residual_output(m)}
    by_name = {
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.endswith(("o_proj", "down_proj", "to_out", "combine.proj"))
    }
    assert marked == by_name and marked
    torch.manual_seed(9)
    model.reset_parameters()
    new = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(9)
    _old_rule_init(model)
    old = model.state_dict()
    assert all(torch.equal(new[k], old[k]) for k in old)


def test_stats_come_typed():
    model = tiny_model("mac")
    x = tokens(2, 13)
    with torch.no_grad():
        out = model.forward_with_stats(x)
        plain, _ = model(x)
    assert isinstance(out, LMOutput) and torch.equal(plain, out.logits)
    assert len(out.stats) > 0
    assert out.state.position == 13

    mem = NeuralMemory(16, heads=2, chunk_size=4).double()
    y = torch.randn(2, 9, 16, dtype=torch.float64)
    got = mem.forward_with_stats(y)
    o, _ = mem(y)
    assert torch.equal(got.output, o)
    assert got.stats.surprise.shape == (2, 2, 9)


def test_state_and_streaming_names_import_from_every_documented_place():
    import importlib

    import titans
    from titans.inference import generation
    from titans.layers import state_tree
    from titans.models import lm, state, streaming

    assert titans.TitansState is lm.TitansState is state.TitansState
    assert state.register_state_type is state_tree.register_state_type
    assert state.STATE_TYPES is state_tree.STATE_TYPES
    for name in ("save_state", "load_state", "map_state", "expand_state", "select_rows", "StateFileError"):
        assert getattr(titans.inference, name) is getattr(state, name)
    assert titans.inference.prefill is streaming.prefill
    for alias in ("titans.inference.prefill", "titans.inference.state_io"):  # no alias modules
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(alias)
    assert generation.generate is streaming.generate
    assert generation.sample_next is streaming.sample_next


def test_the_lmm_has_no_attention_window():
    """`window` sets the sliding-window attention of the blocks that have one; the LMM's blocks have none,
    so the main job's window (16) and the preset's (64) build the same LMM (docs/long_context.md compares
    the LMM's runs with the window-16 models on that ground)."""
    x = random_tokens(2, 37, vocab=256)
    out = []
    for window in (16, 64):
        torch.manual_seed(0)
        model = TitansLM(TitansConfig.preset("tiny", variant="lmm", window=window)).eval()
        with torch.no_grad():
            out.append((model.state_dict(), model(x)[0]))  # (weights, logits)
    assert out[0][0].keys() == out[1][0].keys()
    assert all(torch.equal(out[0][0][k], out[1][0][k]) for k in out[0][0])
    assert torch.equal(out[0][1], out[1][1])
