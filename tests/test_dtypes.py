"""Narrow and mixed dtypes: a bf16-cast model scores tokens alike with and without autograd recording, and
the memory op takes bf16 / fp16 q, k, v with a float32 state on every backend, computing in the state's
dtype as the Triton kernels do."""

from __future__ import annotations

import pytest
import torch

from titans import TitansConfig, TitansLM
from titans.ops.memory import neural_memory, resolve_rule, triton_reason

HALVES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("variant", ["mac", "mag", "mal", "lmm"])
def test_bf16_model_scores_alike_with_and_without_autograd(variant):
    """`model.to(torch.bfloat16)`: the memory's output norm took bf16's eps (7.8e-3) where autograd recorded
    on CPU (training) and float32's, `F.rms_norm`'s, where it did not (eval, generation): logits 2e-2 to
    1e-1 apart at a scale of 0.5. With one eps they are bf16 rounding apart (4e-3)."""
    torch.manual_seed(0)
    cfg = TitansConfig(
        variant=variant,
        vocab_size=31,
        dim=32,
        depth=2,
        heads=2,
        window=6,
        chunk_size=4,
        segment_len=8,
        persistent_tokens=2,
    )
    model = TitansLM(cfg).to(torch.bfloat16).eval()
    tokens = torch.randint(0, 31, (2, 21), generator=torch.Generator().manual_seed(0))  # 5 chunks and 1
    with torch.no_grad():
        plain, _ = model(tokens)
    recorded, _ = model(tokens)
    assert recorded.requires_grad
    torch.testing.assert_close(recorded.detach().float(), plain.float(), rtol=0, atol=1e-2)


def _problem(rule: str, half: torch.dtype, seq: int = 10, d: int = 8):
    """Random half q, k, v (B=1, H=2, seq, d), float32 gates (with the rule's extra gates) and a float32
    depth-2 state."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.nn.functional.normalize(torch.randn(1, 2, seq, d, generator=g), dim=-1) for _ in range(3)
    )
    extra = len(resolve_rule(rule).extra_gates)
    gates = torch.cat(
        [
            0.2 * torch.rand(1, 2, seq, 1, generator=g),  # theta
            torch.full((1, 2, seq, 1), -0.1),  # log eta
            torch.full((1, 2, seq, 1), -0.01),  # log(1 - alpha)
            0.1 * torch.rand(1, 2, seq, extra, generator=g),
        ],
        -1,
    )
    ws = (torch.randn(1, 2, d, 2 * d, generator=g) / d**0.5, torch.randn(1, 2, 2 * d, d, generator=g) / 4)
    ms = tuple(0.1 * torch.randn(w.shape, generator=g) for w in ws)
    return [x.to(half) for x in (q, k, v)], gates, ws, ms


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("rule", ["titans", "yaad", "atlas"])  # Titans's path, the fast path, autograd's
def test_half_qkv_with_float32_state_on_every_backend(rule, half):
    """bf16 / fp16 q, k, v and a float32 state (10 tokens, chunks of 4: a tail of 2): the torch path and the
    references raised matmul's dtype error where the kernels run. Every backend now computes in the state's
    dtype: y, the surprise and the state come out float32, equal to the bit to the same backend's run on
    the inputs cast to float32 (the gradients too, cast back to the inputs' dtype), with or without
    autograd recording; and the backends agree (the kernels' own half-input test is
    tests/test_memory_triton.py's: here their forward only, in Triton's interpreter where there is one)."""
    qkv, gates, ws, ms = _problem(rule, half)
    ys = {}
    for backend in ("torch", "reference"):
        kw = dict(chunk_size=4, rule=rule, backend=backend)
        with torch.no_grad():
            plain = neural_memory(*qkv, gates, ws, ms, **kw)
        leaves = [x.clone().requires_grad_() for x in qkv]
        y, w, s, surprise = neural_memory(*leaves, gates, ws, ms, **kw)
        assert y.dtype == surprise.dtype == w[0].dtype == s[1].dtype == torch.float32, backend
        assert not plain[0].requires_grad
        wide = [x.float().requires_grad_() for x in qkv]
        want = neural_memory(*wide, gates, ws, ms, **kw)
        with torch.no_grad():
            want_plain = neural_memory(*wide, gates, ws, ms, **kw)
        for got, ref in ((plain, want_plain), ((y, w, s, surprise), want)):
            for a, b in zip((got[0], *got[1], *got[2], got[3]), (ref[0], *ref[1], *ref[2], ref[3])):
                torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)
        grads = torch.autograd.grad((y.sum(), surprise.sum()), leaves)
        wants = torch.autograd.grad((want[0].sum(), want[3].sum()), wide)
        for a, b in zip(grads, wants):
            assert a.dtype == half
            torch.testing.assert_close(a, b.to(half), rtol=0, atol=0)
        ys[backend] = y.detach()
    if rule == "titans" and triton_reason(2, 8, 16, "silu", torch.device("cpu")) is None:
        with torch.no_grad():
            ys["triton"] = neural_memory(*qkv, gates, ws, ms, chunk_size=4, backend="triton")[0]
    for backend, y in ys.items():
        torch.testing.assert_close(y, ys["reference"], rtol=1e-4, atol=1e-5, msg=backend)
