"""The block options of `TitansConfig`: MAC's normalised memory input, and the paper's forms of the
attention output gate and of the persistent tokens (docs/design.md, "Departures from the paper").

Each option keeps the model causal and streaming == parallel, at lengths that are not multiples of the chunk
(4), segment (8) or window (6).
"""

from __future__ import annotations

import pytest
import torch

from tiny_lm import random_tokens, tiny_model
from titans import TitansConfig, TitansLM
from titans.layers.attention import SegmentAttention, SelfAttention
from titans.models.blocks import MACBlock, MAGState

VOCAB = 61

# (variant, options): each option on its own, and the paper's MAL (memory prefix, no attention prefix)
OPTION_CASES = [
    ("mac", dict(mac_norm_memory_input=False)),
    ("mac", dict(mac_memory_residual=False)),
    ("mac", dict(attn_output_gate=True)),
    ("mag", dict(attn_output_gate=True)),
    ("mal", dict(attn_output_gate=True)),
    ("swa", dict(attn_output_gate=True)),
    ("transformer", dict(attn_output_gate=True)),
    ("mag", dict(persistent_to_memory=True)),
    ("mal", dict(persistent_to_memory=True)),
    ("mal", dict(mal_attn_persistent=False)),
    ("mal", dict(persistent_to_memory=True, mal_attn_persistent=False)),
    ("mag", dict(persistent_to_memory=True, attn_output_gate=True, memory_layers=[1])),
]
CASE_IDS = [f"{v}-{'-'.join(f'{k}={x}' for k, x in o.items())}" for v, o in OPTION_CASES]


@pytest.mark.parametrize("variant,options", OPTION_CASES, ids=CASE_IDS)
@pytest.mark.parametrize("j", [0, 9, 20])
def test_options_keep_the_model_causal(variant, options, j):
    model = tiny_model(variant, seed=1, **options)
    tokens = random_tokens(2, 22, vocab=VOCAB)
    with torch.no_grad():
        logits, _ = model(tokens)
        changed = tokens.clone()
        changed[:, j] = (changed[:, j] + 1) % VOCAB
        logits2, _ = model(changed)
    assert j == 0 or (logits2[:, :j] - logits[:, :j]).abs().max() <= 1e-12
    assert (logits2[:, j:] - logits[:, j:]).abs().max() > 1e-6


@pytest.mark.parametrize("variant,options", OPTION_CASES, ids=CASE_IDS)
def test_options_stream_equals_parallel(variant, options):
    model = tiny_model(variant, seed=2, **options)
    tokens = random_tokens(2, 37, vocab=VOCAB)
    with torch.no_grad():
        full, _ = model(tokens)
        outs, state, start = [], None, 0
        for size in (1, 2, 5, 1, 9, 3, 13, 1, 2):  # 37 tokens, single tokens and pieces past a segment
            logits, state = model(tokens[:, start : start + size], state)
            outs.append(logits)
            start += size
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-10, rtol=0)
    assert state.position == 37


@pytest.mark.parametrize("variant,options", OPTION_CASES, ids=CASE_IDS)
def test_options_every_parameter_gets_gradient(variant, options):
    model = tiny_model(variant, seed=3, train=True, **options)
    tokens = random_tokens(2, 20, vocab=VOCAB)
    logits, _ = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens.roll(-1, 1).reshape(-1))
    loss.backward()
    skip = ("combine.gate.weight",)  # MAC's identity-init gate is not used by these cases
    missing = [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and not n.endswith(skip) and (p.grad is None or p.grad.abs().sum() == 0)
    ]
    assert not missing, f"no gradient reaches: {missing}"


def test_attn_output_gate_normalises_and_gates_every_attention():
    for variant in ("mac", "mag", "mal", "swa", "transformer"):
        model = tiny_model(variant, attn_output_gate=True)
        attns = [m for m in model.modules() if isinstance(m, (SelfAttention, SegmentAttention))]
        assert attns and all(a.gate_proj is not None for a in attns), variant
        plain = [m for m in tiny_model(variant).modules() if isinstance(m, (SelfAttention, SegmentAttention))]
        assert all(a.gate_proj is None for a in plain)


@pytest.mark.parametrize("variant", ["mag", "mal"])
def test_persistent_to_memory_writes_the_prefix_before_the_sequence(variant):
    """With the option the memory starts every sequence from the state it reaches after reading p: the same
    weights give other outputs, and feeding p's state by hand to the plain block gives the option's output."""
    tokens = random_tokens(2, 13, vocab=VOCAB)
    on = tiny_model(variant, seed=4, persistent_to_memory=True)
    off = tiny_model(variant, seed=4)
    off.load_state_dict(on.state_dict())  # one set of tokens either way: the same parameters
    with torch.no_grad():
        assert (on(tokens)[0] - off(tokens)[0]).abs().max() > 1e-6
        x = on.embed(tokens)
        block_on, block_off = on.blocks[0], off.blocks[0]
        _, mem_state = block_on.memory(block_on.attn.persistent.unsqueeze(0).expand(2, -1, -1))
        expected, _ = block_off(x, MAGState(None, mem_state))
        got, _ = block_on(x)
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_paper_mal_gives_the_persistent_tokens_to_the_memory_only():
    model = tiny_model("mal", persistent_to_memory=True, mal_attn_persistent=False)
    for block in model.blocks:
        assert block.attn.persistent is None
        assert block.memory_persistent is not None and block.memory_persistent.shape == (2, 24)
    assert tiny_model("mal", mal_attn_persistent=False).blocks[0].memory_persistent is None


def _memory_keys(model: TitansLM, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The keys (B, H, T, d) each MAC block's memory computes from what it is asked to write."""
    keys = []
    for block in model.blocks:
        if isinstance(block, MACBlock):
            project = block.memory.project

            def spy(x, tail, project=project):
                out = project(x, tail)
                keys.append(out[1].detach())
                return out

            block.memory.project = spy
    with torch.no_grad():
        model(tokens)
    return keys


def test_mac_memory_write_carries_the_input_at_init():
    """At initialisation, MAC's memory keys differ from token to token (tiny preset, random tokens).

    The attention output y is tiny at init (its output projection is N(0, 0.02 / 2)): written as it is, the
    memory's conv adds its bias, and every token's key is that bias (pairwise cosine 1 - 1e-6) — the memory
    cannot tell tokens apart, and nothing in training's first steps tells it to. With y RMS-normalised the
    keys vary as much as an LMM's at init."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 64))

    def mean_pairwise_cos(cfg: TitansConfig) -> float:
        torch.manual_seed(0)
        keys = _memory_keys(TitansLM(cfg), tokens)[0][0]  # first MAC block, first sequence: (H, T, d)
        cos = keys @ keys.transpose(-1, -2)  # keys are l2-normalised
        off = ~torch.eye(cos.shape[-1], dtype=torch.bool)
        return cos[:, off].mean().item()

    assert mean_pairwise_cos(TitansConfig.preset("tiny", variant="mac")) < 0.99
    raw = TitansConfig.preset("tiny", variant="mac", mac_norm_memory_input=False, mac_memory_residual=False)
    assert mean_pairwise_cos(raw) > 0.9999


def test_mac_residual_write_keys_follow_the_token_at_init():
    """With `mac_memory_residual` (the default) MAC's memory keys carry the token they sit on at init.

    The attention spreads over its segment at init, so its output y changes little from one token to the
    next: keys built from norm(y) alone are close to their neighbours', and changing one token moves its own
    key little. Written as x + y, the token shows through (what pass-key retrieval has to match on)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 64))
    changed = tokens.clone()
    changed[:, 40] = (changed[:, 40] + 101) % 256

    def keys(residual: bool, inputs: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)
        cfg = TitansConfig.preset("tiny", variant="mac", mac_memory_residual=residual)
        return _memory_keys(TitansLM(cfg), inputs)[0]  # first MAC block: (B, H, T, d), l2-normalised

    def own_change(residual: bool) -> float:
        return (keys(residual, tokens)[..., 40, :] - keys(residual, changed)[..., 40, :]).norm(dim=-1).mean()

    def neighbour_cos(residual: bool) -> float:
        k = keys(residual, tokens)
        return (k[..., 1:, :] * k[..., :-1, :]).sum(-1).mean().item()

    assert TitansConfig().mac_memory_residual is True
    assert own_change(True) > 1.5 * own_change(False)
    assert neighbour_cos(True) < 0.88 < neighbour_cos(False)


def test_saved_config_without_the_residual_write_rebuilds_the_y_only_block():
    """A MAC saved before `mac_memory_residual` existed wrote norm(y) alone: loading it keeps that."""
    old = TitansConfig.preset("tiny", variant="mac").to_dict()
    del old["mac_memory_residual"]
    assert TitansConfig.from_saved_dict(old).mac_memory_residual is False
    assert TitansConfig.from_dict(old).mac_memory_residual is True
    assert TitansLM(TitansConfig.from_saved_dict(old)).blocks[0].memory_residual is False


def test_mac_memory_input_norm_is_a_learned_rms_norm():
    model = tiny_model("mac")
    block = model.blocks[0]
    assert block.norm_memory_input is not None and block.norm_memory_input.weight.shape == (24,)
    assert tiny_model("mac", mac_norm_memory_input=False).blocks[0].norm_memory_input is None


def test_saved_config_without_the_memory_input_norm_rebuilds_the_unnormalised_block():
    """A model saved before `mac_norm_memory_input` existed was trained without the norm: loading it
    rebuilds that block (its state dict has no norm weight), while a config written by hand gets today's
    default."""
    old = TitansConfig(variant="mac").to_dict()
    del old["mac_norm_memory_input"]
    assert TitansConfig.from_saved_dict(old).mac_norm_memory_input is False
    assert TitansConfig.from_dict(old).mac_norm_memory_input is True
    assert TitansConfig.from_saved_dict(TitansConfig().to_dict()).mac_norm_memory_input is True


@pytest.mark.parametrize(
    "field",
    [
        "mac_norm_memory_input",
        "mac_memory_residual",
        "attn_output_gate",
        "persistent_to_memory",
        "mal_attn_persistent",
    ],
)
def test_option_must_be_a_bool(field):
    with pytest.raises(ValueError, match=field):
        TitansConfig(**{field: "yes"})


def test_mac_default_gate_passes_the_loss_gradient_to_the_memory_at_init():
    """MAC's output o = gate(y, M(u)): with the default "norm" gate (W (norm(y) * sigmoid(norm(m))), MAG's)
    the memory gets a gradient of the same order as the rest of the block; with the "open" gate
    (y * 2 sigmoid(W norm(m)), W = 0) it is scaled by the attention output y, which its small output
    projection keeps far below 1 at init: an order of magnitude less, the onset of learning through the
    memory comes late or not at all (docs/evaluations.md, "MAC on the pass-key recipe")."""
    tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))

    def memory_grad(gate: str) -> float:
        torch.manual_seed(0)
        model = TitansLM(TitansConfig.preset("tiny", variant="mac", mac_gate=gate))
        logits, _ = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        grads = [p.grad for b in model.blocks for p in b.memory.parameters() if p.grad is not None]
        return torch.cat([g.flatten() for g in grads]).norm().item()

    assert TitansConfig().mac_gate == "norm"
    assert memory_grad("norm") > 5 * memory_grad("open")


def test_mag_gates_the_attention_output_by_the_memory():
    """MAG's output is W(norm(attn) * sigmoid(norm(mem))) (docs/design.md): the attention output is the
    gated value and the memory's the gate. Swapped, every other test passed (both sides of the streaming
    and reference comparisons swap alike)."""
    model = tiny_model("mag", vocab_size=61)
    block = model.blocks[0]
    seen = {}
    block.attn.register_forward_hook(lambda mod, args, out: seen.__setitem__("attn", out[0]))
    block.memory.register_forward_hook(lambda mod, args, out: seen.__setitem__("memory", out[0]))
    block.combine.register_forward_pre_hook(lambda mod, args: seen.__setitem__("combine", args))
    model(random_tokens(1, 9, vocab=61))
    value, gate = seen["combine"]
    assert torch.equal(value, seen["attn"]) and torch.equal(gate, seen["memory"])
