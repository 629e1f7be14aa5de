"""torch.compile on the CPU training path: the memory's chunk step (`titans.ops.memory.chunk._ChunkStep`, a
custom autograd.Function) traces whole, forward and backward, so a compiled MAC block is one graph.

Two things used to split it (about 26 graphs per MAC block): the step's backward filled a dict of reused
state-gradient buffers (`_GradBuffers`, Dynamo's "HOP: Unsafe side effect") and wrote activations with
`out=` into strided views (`activate`, `act_backward`). Under torch.compile each step's backward now
allocates its gradients and copies the activations in; eager runs are unchanged."""

import pytest
import torch
from torch._dynamo.utils import counters

from titans.models.config import TitansConfig
from titans.models.lm import TitansLM
from titans.ops.memory import neural_memory


@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def _graph_breaks(counters) -> int:
    return sum(counters["graph_break"].values())


def test_compiled_mac_training_step_has_no_graph_breaks(dynamo):
    torch.manual_seed(0)
    model = TitansLM(TitansConfig.preset("tiny", variant="mac", depth=1)).train()
    for module in model.modules():  # as the trainer does: divergence is caught by the loss
        if hasattr(module, "check_finite"):
            module.check_finite = False
    model.compile_blocks(backend="eager")  # Dynamo's graph breaks do not depend on the backend
    tokens = torch.randint(0, model.config.vocab_size, (1, 33))  # 2 chunks of a first segment
    logits, _ = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    assert _graph_breaks(dynamo) <= 0, dict(dynamo["graph_break"])
    assert all(p.grad is not None for p in model.blocks[0].parameters() if p.requires_grad)


@pytest.mark.parametrize("activation", ["gelu"])
def test_memory_op_forward_and_backward_trace_whole(dynamo, activation):
    """The op alone, fullgraph (a graph break raises): depth 2 (the backward's activations into views),
    a surprise clip (its data-dependent skip) and a trailing partial chunk; the compiled gradients match
    eager's."""
    torch.manual_seed(0)
    b, h, t, d, hidden = 1, 2, 40, 8, 16
    q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))
    gates = torch.stack([torch.rand(b, h, t), -torch.rand(b, h, t), -0.1 * torch.rand(b, h, t)], -1)
    gates.requires_grad_(True)
    weights = tuple(
        (0.3 * torch.randn(b, h, *shape)).requires_grad_(True) for shape in ((d, hidden), (hidden, d))
    )
    momentum = tuple(torch.zeros_like(w) for w in weights)
    inputs = (q, k, v, gates, *weights)

    def run(q, k, v, gates, w1, w2):
        y, new_w, _, surprise = neural_memory(
            q, k, v, gates, (w1, w2), momentum, chunk_size=16, activation=activation, surprise_clip=0.5
        )
        return y.square().sum() + new_w[0].sum() + new_w[1].square().sum() + surprise.sum()

    want = torch.autograd.grad(run(*inputs), inputs)
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(*inputs), inputs)
    assert _graph_breaks(dynamo) == 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "options",
    [
        {"memory_rule": "atlas"},  # the rules' chunked path (bisect broke it)
        {"memory_rule": "memora"},
        {"memory_max_norm": 0.5},  # out of place under compile (mark_dirty, out= into a view broke it)
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_compiled_block_options_train_like_eager_in_one_graph(dynamo, options):
    """A compiled MAC block with a memory option that takes another code path: no graph break, and the
    loss and every parameter's gradient equal the eager model's."""
    torch.manual_seed(0)
    model = TitansLM(TitansConfig.preset("tiny", variant="mac", depth=1, **options)).train()
    for module in model.modules():
        if hasattr(module, "check_finite"):
            module.check_finite = False
    tokens = torch.randint(0, model.config.vocab_size, (2, 50))  # 3 chunks of 16 and a partial one

    def step():
        model.zero_grad(set_to_none=True)
        logits, _ = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want = step()
    model.compile_blocks(backend="eager")
    got_loss, got = step()
    assert _graph_breaks(dynamo) == 0, dict(dynamo["graph_break"])
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
