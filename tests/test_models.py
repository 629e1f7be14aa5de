"""Titans LMs (MAC, MAG, MAL, LMM) and the baselines: causality, gradients, learning, config."""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from tiny_lm import tiny_config, tiny_model
from titans import PRESETS, VARIANTS, TitansConfig, TitansLM
from titans.layers.memory import NeuralMemory
from titans.layers.norm import RMSNorm
from titans.models.blocks import GatedCombine, IdentityInitGate
from titans.models.state import state_tensors

F64 = torch.float64

tiny = partial(tiny_config, vocab_size=64, dim=32)
model64 = partial(tiny_model, vocab_size=64, dim=32, train=True)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("j", [0, 8, 11, 16, 21])
def test_causality(variant, j):
    """Perturb token j (segment/chunk start, middle, last token): logits before j do not move."""
    model = model64(variant)
    tokens = torch.randint(0, 64, (2, 22))  # 22: not a multiple of the segment (8) or chunk (4)
    logits, _ = model(tokens)
    changed = tokens.clone()
    changed[:, j] = (changed[:, j] + 1 + torch.arange(2)) % 64
    logits2, _ = model(changed)
    assert j == 0 or (logits2[:, :j] - logits[:, :j]).abs().max() <= 1e-12
    assert (logits2[:, j:] - logits[:, j:]).abs().max() > 1e-6


@pytest.mark.parametrize("variant", VARIANTS)
def test_streaming_equals_parallel(variant):
    model = model64(variant, seed=1)
    tokens = torch.randint(0, 64, (2, 29))
    full, _ = model(tokens)
    pieces, state = [], None
    for a, b in [(0, 1), (1, 6), (6, 8), (8, 19), (19, 20), (20, 29)]:
        out, state = model(tokens[:, a:b], state)
        pieces.append(out)
    assert (torch.cat(pieces, 1) - full).abs().max() < 1e-10
    assert state.position == 29


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradient_checkpointing_recomputes_blocks_with_the_same_gradients(variant):
    """`gradient_checkpointing`: the logits, the stats, the new state and every gradient (the parameters'
    and, through a state carried from an earlier piece, the earlier piece's) are those of the plain
    forward, while autograd keeps a fraction of the bytes; evaluation and no-grad calls are unchanged."""
    model = model64(variant, seed=3)
    for module in model.modules():
        if isinstance(module, IdentityInitGate):  # open, so that every path carries gradient
            torch.nn.init.normal_(module.gate.weight, std=0.1)
    first, second = torch.randint(0, 64, (2, 11)), torch.randint(0, 64, (2, 21))
    results, saved = [], []
    for recompute in (False, True):
        model.gradient_checkpointing = recompute
        model.zero_grad()
        start = len(saved)
        _, state = model(first)  # the carried state's tensors are differentiable
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.untyped_storage().nbytes()) or t, lambda t: t
        ):
            out = model.forward_with_stats(second, state)
        loss = out.logits.square().mean() + sum(x.square().sum() for x in state_tensors(out.state).values())
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append(
            (
                out.logits.detach(),
                list(state_tensors(out.state).values()),
                len(out.stats),
                grads,
                sum(saved[start:]),
            )
        )
    plain, recomputed = results
    assert torch.equal(plain[0], recomputed[0]) and plain[2] == recomputed[2]
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(plain[1], recomputed[1]))
    assert len(plain[3]) == len(recomputed[3]) and all(
        torch.equal(a, b) for a, b in zip(plain[3], recomputed[3])
    )
    assert recomputed[4] < plain[4] / 3
    with torch.no_grad():  # no recomputation where no backward will run: the same calls as without
        on = model(second, state)[0]
        model.gradient_checkpointing = False
        assert torch.equal(on, model(second, state)[0])


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_parameter_gets_gradient(variant):
    model = model64(variant, seed=2)
    for module in model.modules():
        if isinstance(module, IdentityInitGate):  # zero at init by design: nothing flows past it then
            torch.nn.init.normal_(module.gate.weight, std=0.1)
    tokens = torch.randint(0, 64, (2, 20))
    logits, _ = model(tokens)
    torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens.roll(-1, 1).reshape(-1)).backward()
    missing = [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and (p.grad is None or p.grad.abs().sum() == 0)
    ]
    assert not missing, f"no gradient reaches: {missing}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_drives_loss_down(variant):
    """A few hundred AdamW steps on a tiny repeated-pattern dataset drive the loss far down."""
    torch.manual_seed(0)
    model = TitansLM(tiny(variant, vocab_size=16, dim=32, depth=2, segment_len=16))
    pattern = torch.randint(0, 16, (10,))
    data = pattern.repeat(4)[None].repeat(4, 1)[:, :33]  # (4, 33)
    for i in range(4):
        data[i] = data[i].roll(3 * i)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    losses = []
    for _ in range(100):
        logits, _ = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.25 * losses[0], (losses[0], losses[-1])


def test_memory_layers_choice():
    cfg = tiny("mag", depth=3, memory_layers=[1])
    model = TitansLM(cfg)
    kinds = [type(b).__name__ for b in model.blocks]
    assert kinds == ["AttentionBlock", "MAGBlock", "AttentionBlock"]
    # the variants without a memory take it and build none (as with every memory_* field), so that one
    # override fits each config of a comparison
    for variant in ("swa", "transformer"):
        model = TitansLM(tiny(variant, depth=3, memory_layers=[1]))
        assert [type(b).__name__ for b in model.blocks] == ["AttentionBlock"] * 3
        assert not any(isinstance(m, NeuralMemory) for m in model.modules())


def test_weight_tying():
    model = TitansLM(tiny("mac", tie_embeddings=True))
    assert model.head.weight is model.embed.weight
    untied = TitansLM(tiny("mac", tie_embeddings=False))
    assert untied.head.weight is not untied.embed.weight


def test_config_round_trip(tmp_path):
    cfg = TitansConfig.preset("small", variant="mal", memory_layers=[0, 2], memory_momentum=False)
    path = tmp_path / "cfg.json"
    cfg.save(path)
    assert TitansConfig.load(path) == cfg
    assert TitansConfig.load(path).to_dict() == cfg.to_dict()


def test_memory_gate_inits_are_config_fields():
    """memory_eta_init / memory_alpha_init reach every memory's gate biases: at zero input the gates
    are exactly those values."""
    model = TitansLM(tiny("mag", memory_eta_init=0.5, memory_alpha_init=0.2))
    memories = [block.memory for block in model.blocks]
    assert len(memories) == 2
    for mem in memories:
        log_eta, log_keep = mem.gates(torch.zeros(1, 3, mem.dim))[..., 1:].unbind(-1)
        assert torch.allclose(log_eta.exp(), torch.tensor(0.5))
        assert torch.allclose(1 - log_keep.exp(), torch.tensor(0.2))
    default = TitansLM(tiny("mag")).blocks[0].memory.to_gates.bias.detach()
    assert not torch.allclose(default, memories[0].to_gates.bias.detach())


LM_MAC = dict(mac_gate="open", mac_norm_memory_tokens=True)


@pytest.mark.parametrize("j", [0, 8, 13])
def test_open_gate_mac_block_is_causal_and_streams(j):
    """The MAC block of the main job (`mac_gate="open"`, normalised memory tokens; the VARIANTS tests cover
    the default block). The gate starts at zero (the identity on y): with it as initialised, the memory's
    read does not reach the output, so a read of later tokens passed; its weights are made random here."""
    model = model64("mac", seed=3, **LM_MAC)
    assert isinstance(model.blocks[0].combine, IdentityInitGate)
    with torch.no_grad():
        for block in model.blocks:
            torch.nn.init.normal_(block.combine.gate.weight, std=0.5)
    tokens = torch.randint(0, 64, (2, 22))
    logits, _ = model(tokens)
    changed = tokens.clone()
    changed[:, j] = (changed[:, j] + 1) % 64
    assert j == 0 or (model(changed)[0][:, :j] - logits[:, :j]).abs().max() <= 1e-12
    pieces, state = [], None
    for a, b in [(0, 5), (5, 8), (8, 22)]:
        out, state = model(tokens[:, a:b], state)
        pieces.append(out)
    assert (torch.cat(pieces, 1) - logits).abs().max() < 1e-10


class _CountOutputs(TorchDispatchMode):
    """Counts the elements of every tensor the ops produce while active."""

    produced = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.produced += sum(t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, Tensor))
        return out


@pytest.mark.parametrize("which", ["mac", "memory-rule"])
def test_backward_is_linear_in_length(which):
    """The backward pass of a MAC model and of a memory with a rule's torch path (moneta) produces O(T)
    elements: pieces of a sequence are cut with split(), whose gradient is one cat, not sliced, where each
    slice's gradient is a zero-filled tensor of the whole sequence's size (O(T^2) over a sequence)."""
    torch.manual_seed(0)
    if which == "mac":
        model = TitansLM(tiny("mac", depth=1))

        def loss(t):
            return model(torch.randint(0, 64, (1, t)))[0].square().mean()
    else:
        mem = NeuralMemory(32, heads=2, chunk_size=4, rule="moneta")

        def loss(t):
            return mem(torch.randn(1, t, 32, requires_grad=True))[0].square().mean()

    produced = []
    for t in (64, 128, 192):  # multiples of the segments and chunks: a linear count grows by equal steps
        value = loss(t)
        with _CountOutputs() as counter:
            value.backward()
        produced.append(counter.produced)
    step, second = produced[1] - produced[0], produced[2] - 2 * produced[1] + produced[0]
    assert abs(second) < 0.005 * step, produced  # sliced: 2% (MAC) and 13% (moneta) of a step


def test_identity_init_gate_starts_as_the_identity():
    torch.manual_seed(0)
    gate = IdentityInitGate(12, 1e-6)
    y, m = torch.randn(2, 5, 12), torch.randn(2, 5, 12)
    assert torch.equal(gate(y, m), y)
    # and TitansLM's own init keeps it so (it re-initialises every other Linear)
    model = model64("mac", seed=4, **LM_MAC)
    assert all(b.combine.gate.weight.abs().max() == 0 for b in model.blocks)
    assert all(b.norm_tokens for b in model.blocks)


def test_mac_memory_tokens_are_normalised_only_when_asked():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32, dtype=F64)
    for norm in (False, True):
        block = model64("mac", seed=5, mac_norm_memory_tokens=norm).blocks[0]
        assert isinstance(block.combine, GatedCombine)  # the default gate
        h = block.retrieve(x, block.memory.initial_state(2, dtype=F64).weights)
        rms = h.pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.ones_like(rms), atol=1e-2) == norm  # h is small: the eps shows


def test_config_without_mac_fields_loads_the_default_block():
    """A config saved before `mac_gate` / `mac_norm_memory_tokens` existed describes the default block."""
    old = TitansConfig(variant="mac").to_dict()
    del old["mac_gate"], old["mac_norm_memory_tokens"]
    cfg = TitansConfig.from_dict(old)
    default = TitansConfig()
    assert (cfg.mac_gate, cfg.mac_norm_memory_tokens) == (default.mac_gate, default.mac_norm_memory_tokens)
    assert (default.mac_gate, default.mac_norm_memory_tokens) == ("norm", False)


def test_config_without_gate_inits_loads_with_defaults():
    """A model config saved before the gate inits were fields (old checkpoints) still loads."""
    old = TitansConfig(variant="lmm").to_dict()
    del old["memory_eta_init"], old["memory_alpha_init"]
    cfg = TitansConfig.from_dict(old)
    assert (cfg.memory_eta_init, cfg.memory_alpha_init) == (0.9, 0.01)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"memory_eta_init": 1.0}, "memory_eta_init"),
        ({"memory_alpha_init": 0}, "memory_alpha_init"),
        ({"memory_alpha_init": "small"}, "memory_alpha_init"),
        ({"window": 0}, "window"),
        ({"segment_len": -4}, "segment_len"),
        ({"variant": "mac", "segment_len": 10, "chunk_size": 4}, "chunk_size"),
        ({"variant": "transformers"}, "variant"),
        ({"dim": 30, "heads": 4}, "heads"),
        ({"memory_layers": [5]}, "memory_layers"),
        ({"persistent_tokens": -1}, "persistent_tokens"),
        ({"memory_checkpoint_every": 0}, "memory_checkpoint_every"),
        ({"mac_gate": "closed"}, "mac_gate"),
        ({"mac_norm_memory_tokens": "yes"}, "mac_norm_memory_tokens"),
        ({"memory_checkpoint_every": True}, "memory_checkpoint_every"),
        # each of these built a model that ran: the memory raising its own loss (a negative clip or
        # learning rate), a string read as true, a string or float read as block numbers, 0 read as null
        ({"memory_surprise_clip": -1.0}, "memory_surprise_clip"),
        ({"memory_surprise_clip": float("nan")}, "memory_surprise_clip"),
        ({"memory_max_lr": -0.03, "memory_theta_init": -0.01}, "memory_max_lr"),
        ({"memory_max_lr": 0.0}, "memory_max_lr"),
        ({"memory_theta_init": 0.05}, "memory_theta_init=0.05 must be below memory_max_lr"),
        ({"memory_write": "false"}, "memory_write must be a bool"),
        ({"tie_embeddings": "false"}, "tie_embeddings must be a bool"),
        ({"qk_norm": 0}, "qk_norm must be a bool"),
        ({"depth": 13, "memory_layers": "12"}, "memory_layers must list block numbers"),
        ({"memory_layers": [0.9]}, "memory_layers must list block numbers"),
        ({"head_dim": 0}, "head_dim"),
        ({"memory_heads": 0}, "memory_heads"),
        ({"memory_head_dim": 0}, "memory_head_dim"),
        ({"dim": 16, "heads": 2, "memory_heads": 32}, "memory_heads=32 leaves no width per head"),
        # accepted, then floored (part of dim in no head) or refused by the model without naming the field
        ({"dim": 12, "heads": 3, "memory_heads": 5}, "memory_heads=5 does not divide dim=12"),
        ({"rope_base": 1.0}, "rope_base must be"),
        ({"memory_expansion": 0.01}, "memory_expansion=0.01 gives the memory MLP a hidden width of 0"),
        # and these failed later, inside torch, naming no field
        ({"init_std": -0.02}, "init_std"),
        ({"norm_eps": float("nan")}, "norm_eps"),
        ({"memory_conv_kernel": 2.5}, "memory_conv_kernel"),
        ({"memory_expansion": float("nan")}, "memory_expansion"),
        # accepted and not applied: no memory anywhere; an MLP of width 0 refused by the model's SwiGLU
        ({"dim": 32, "mlp_mult": 0.01}, "mlp_mult=0.01 gives an MLP of width 0 at dim=32"),
        # accepted (and saved) by the config, refused only by the layer when a model was built
        ({"memory_rule": "atlas", "memory_checkpoint_every": 4}, "memory_checkpoint_every applies"),
        ({"memory_rule": "moneta", "memory_checkpoint_every": 4}, "memory_checkpoint_every applies"),
    ],
)
def test_bad_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TitansConfig(**kwargs)


@pytest.mark.parametrize("variant", ["mac", "swa"])
def test_config_refuses_an_unknown_memory_activation(variant):
    """At construction, naming the config's field, for every variant: the memory's own check came only when
    a model was built, and never for a variant without a memory."""
    with pytest.raises(ValueError, match=r"TitansConfig.memory_activation must be one of .*'slu'.*'silu'\?"):
        TitansConfig(variant=variant, memory_activation="slu")
    for name in ("silu", "gelu", "relu"):
        assert TitansConfig(variant=variant, memory_activation=name).memory_activation == name


def test_bad_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config file"):
        TitansConfig.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"variant": "mac", "dimension": 3}')
    with pytest.raises(ValueError, match="dimension"):
        TitansConfig.load(tmp_path / "bad.json")
    # a file in Latin-1 raised UnicodeDecodeError naming no file; one saved as UTF-16 is read
    (tmp_path / "latin1.json").write_bytes('{"variant": "mac", "x": "\xe9"}'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.json' is not valid JSON"):
        TitansConfig.load(tmp_path / "latin1.json")
    (tmp_path / "utf16.json").write_text('{"variant": "swa", "dim": 32}', encoding="utf-16")
    assert TitansConfig.load(tmp_path / "utf16.json").variant == "swa"


def test_bad_tokens_and_state():
    model = TitansLM(tiny("mac"))
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        model(torch.randint(0, 64, (10,)))
    with pytest.raises(TypeError, match="integer"):
        model(torch.rand(2, 5))
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        model(torch.tensor([[1, 64]]))
    _, state = TitansLM(tiny("mac", persistent_tokens=3))(torch.randint(0, 64, (1, 5)))
    with pytest.raises(ValueError, match="persistent_tokens"):
        model(torch.randint(0, 64, (1, 5)), state)


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_empty_batch_is_refused_by_every_variant(variant):
    """Batch size 0 had failed in a reshape inside the memory op (MAG, MAL, LMM; MAC with grad) and run
    through the baselines: every variant refuses it by name."""
    with pytest.raises(ValueError, match="at least one sequence"):
        TitansLM(tiny(variant))(torch.randint(0, 64, (0, 7)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_state_of_another_batch_size_is_refused(variant):
    model = TitansLM(tiny(variant))
    _, state = model(torch.randint(0, 64, (2, 11)))
    with pytest.raises(ValueError, match="state is for batch size 2, the tokens have batch size 3"):
        model(torch.randint(0, 64, (3, 4)), state)


def test_presets_and_parameter_counts():
    """The paper-scale presets land near their names (counted without building the large ones twice)."""
    expected = {"170M": 170e6, "340M": 340e6, "400M": 400e6, "760M": 760e6}
    for name, target in expected.items():
        with torch.device("meta"):
            model = TitansLM(TitansConfig.preset(name))
        n = model.num_parameters()
        assert 0.8 * target < n < 1.2 * target, (name, n)
    assert {"tiny", "small"} <= set(PRESETS)


def test_long_sequence_sliding_window_is_linear_memory():
    """A 32K-token forward of a small SWA/MAC model runs on CPU (no seq x seq mask)."""
    torch.manual_seed(0)
    for variant in ("swa", "mac"):
        model = TitansLM(tiny(variant, dim=32, depth=1, segment_len=256, window=256, chunk_size=64))
        with torch.no_grad():
            logits, _ = model(torch.randint(0, 64, (1, 32768)))
        assert logits.shape == (1, 32768, 64) and torch.isfinite(logits).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_cpu_bf16_autocast(variant):
    """Forward and backward inside a bf16 autocast region (as a training step may run them): the memory
    runs in its float32 state dtype, its backward too, and the logits stay near float32's."""
    torch.manual_seed(0)
    model = TitansLM(tiny(variant))
    tokens = torch.randint(0, 64, (2, 40))
    ref, _ = model(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(tokens)
        logits.float().logsumexp(-1).mean().backward()
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert (logits.float() - ref).abs().max() < 0.1 * ref.abs().max() + 0.1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_bf16_autocast(variant):
    torch.manual_seed(0)
    model = TitansLM(tiny(variant)).cuda()
    tokens = torch.randint(0, 64, (2, 40), device="cuda")
    ref, _ = model(tokens)
    with warnings.catch_warnings(record=True) as caught, torch.autocast("cuda", dtype=torch.bfloat16):
        warnings.simplefilter("always")
        logits, _ = model(tokens)
        logits.float().logsumexp(-1).mean().backward()
    assert torch.isfinite(logits).all()
    assert (logits.float() - ref).abs().max() < 0.1 * ref.abs().max() + 0.1
    # every norm keeps its fused kernel: no float32 weight meets a bf16 input
    assert not [w for w in caught if "Mismatch dtype" in str(w.message)]


def test_rms_norm_module_follows_a_lower_precision_input():
    """layers.norm.RMSNorm: exactly nn.RMSNorm in float32; a bf16 input gets a bf16 output, the weight's
    gradient stays float32."""
    torch.manual_seed(0)
    ours, ref = RMSNorm(24, eps=1e-6), torch.nn.RMSNorm(24, eps=1e-6)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ref.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 24)
    assert torch.equal(ours(x), ref(x))
    y = ours(x.bfloat16())
    assert y.dtype == torch.bfloat16
    assert (y.float() - ref(x)).abs().max() < 0.05
    y.float().sum().backward()
    assert ours.weight.grad.dtype == torch.float32


def test_state_config_is_read_only():
    """Every state a model returns carries the model's one config mapping: it must not be mutable, or
    changing one state's would change all of them and the model's check of states."""
    torch.manual_seed(0)
    model = TitansLM(tiny("mac"))
    tokens = torch.randint(0, 64, (1, 12))
    _, first = model(tokens[:, :5])
    _, second = model(tokens[:, 5:], state=first)
    assert first.config is second.config
    with pytest.raises(TypeError):
        first.config["dim"] = 1


def memory_states(tree) -> list:
    """Every `MemoryState` in a model state (in block states, nested dataclasses)."""
    from dataclasses import fields, is_dataclass

    from titans import MemoryState

    if isinstance(tree, MemoryState):
        return [tree]
    if isinstance(tree, list | tuple):
        return [m for t in tree for m in memory_states(t)]
    if is_dataclass(tree):
        return [m for f in fields(tree) for m in memory_states(getattr(tree, f.name))]
    return []


@pytest.mark.parametrize("variant", ["mac", "mag", "mal", "lmm"])
def test_frozen_memory_leaves_the_model_state_unchanged(variant):
    """memory_write=False: after any tokens, in one pass or in pieces, every memory's weights and momentum
    (and MAC's segment weights) are bit-identical to a fresh state's, and pieces still equal one pass."""
    model = tiny_model(variant, vocab_size=64, dim=32, memory_write=False)
    x = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, state = model(x)
        outs, piece_state = [], None
        for a, b in [(0, 3), (3, 20), (20, 21), (21, 45)]:
            out, piece_state = model(x[:, a:b], piece_state)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0, atol=1e-10)
    for s in (state, piece_state):
        mems = memory_states(s.layers)
        assert len(mems) == model.config.depth
        for block, mem in zip(model.blocks, mems):
            start = block.memory.initial_state(2)
            for a, b in zip(mem.weights + mem.momentum, start.weights + start.momentum):
                assert torch.equal(a, b)
        if variant == "mac":
            for layer in s.layers:
                for a, b in zip(layer.segment_weights, layer.memory.weights):
                    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.uint64]
)
def test_forward_takes_every_integer_dtype(dtype):
    """As prefill and generate do (they cast to int64): the ids are checked, not the dtype."""
    model = model64("mag").eval()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        want, _ = model(ids)
        got, _ = model(ids.to(dtype))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 64\), got \[3, 100\]"):
        model(torch.tensor([[3, 100]]).to(dtype))


def test_forward_refuses_ids_of_no_integer_dtype_and_wrapping_uint64():
    model = model64("lmm").eval()
    for bad in (torch.tensor([[1.0, 2.0]]), torch.tensor([[True, False]]), torch.tensor([[1 + 0j]])):
        with pytest.raises(TypeError, match=f"tokens must hold integer token ids, got dtype {bad.dtype}"):
            model(bad)
    huge = torch.tensor([[2**63 + 5, 1]], dtype=torch.uint64)  # -2**63 + 5 as int64
    with pytest.raises(ValueError, match=r"got an id >= 2\*\*63 \(uint64\)"):
        model(huge)
