"""The fused-backward normalisations == their plain-PyTorch references (values and gradients)."""

import pytest
import torch
import torch.nn.functional as F

from titans.ops.norms import l2_normalize, rms_norm

F64 = torch.float64


@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 1, 4, 1), (9,)])
def test_l2_normalize_matches_f_normalize(shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=F64)
    if len(shape) > 1:
        x[..., 0, :] = 0  # a zero row: the eps clamp holds it
    x.requires_grad_()
    torch.testing.assert_close(l2_normalize(x), F.normalize(x, dim=-1), rtol=1e-13, atol=1e-13)
    g = torch.randn(shape, dtype=F64)
    (ours,) = torch.autograd.grad(l2_normalize(x), x, g)
    (ref,) = torch.autograd.grad(F.normalize(x, dim=-1), x, g)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(l2_normalize, (torch.randn(*shape, dtype=F64, requires_grad=True),))


@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("eps", [None, 1e-5])
def test_rms_norm_matches_f_rms_norm(with_weight, eps):
    torch.manual_seed(1)
    x = torch.randn(3, 4, 7, dtype=F64, requires_grad=True)
    w = torch.randn(7, dtype=F64, requires_grad=True) if with_weight else None
    torch.testing.assert_close(rms_norm(x, w, eps), F.rms_norm(x, (7,), w, eps), rtol=1e-13, atol=1e-13)
    g = torch.randn_like(x)
    leaves = [x, w] if with_weight else [x]
    ours = torch.autograd.grad(rms_norm(x, w, eps), leaves, g)
    ref = torch.autograd.grad(F.rms_norm(x, (7,), w, eps), leaves, g)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *t: rms_norm(*t, eps=eps), tuple(leaves))


def test_float32_close_to_float64():
    """In float32 (the hand-written path runs when autograd records; without it, F.* itself)."""
    torch.manual_seed(2)
    x, w = torch.randn(2, 3, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    x64, w64 = x.detach().double(), w.detach().double()
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(rms_norm(x, w), F.rms_norm(x64, (64,), w64).float())
            torch.testing.assert_close(l2_normalize(x), F.normalize(x64, dim=-1).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_normalize_forms_are_the_callers_own(dtype):
    """The attention's form (float32 accumulation, rsqrt, eps on the norm) and MAC's (autograd through
    `F.normalize`) give, to the bit, what those callers computed with their own code."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 17, 8, dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True).clamp_min(1e-12))).to(dtype)
    got = l2_normalize(x, eps=1e-6, in_float32=True)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(*(torch.autograd.grad(y, x, g)[0] for y in (got, want)))
    plain = F.normalize(x, dim=-1)
    mine = l2_normalize(x, fused_backward=False)
    assert torch.equal(mine, plain)
    assert torch.equal(*(torch.autograd.grad(y, x, g)[0] for y in (mine, plain)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_l2_normalize_in_float32_keeps_no_float32_copy(dtype):
    """The attention's form on a bf16 / fp16 x (autocast) keeps x and two numbers per row for the backward
    pass, not x's float32 copy as autograd's composition does, with the composition's outputs and
    gradients to the bit: over scales from 1e-4 to 1e2, with rows of zeros and rows below eps."""
    torch.manual_seed(3)
    for scale in (1e-4, 1e-2, 1.0, 1e2):
        x = (torch.randn(2, 3, 33, 64) * scale).to(dtype)
        x[0, 0, :2] = 0
        x[1, 1, 4] = 1e-8
        x.requires_grad_()
        g = torch.randn(x.shape).to(dtype)
        xf = x.float()
        want = (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True).clamp_min(1e-12))).to(dtype)
        saved = {}

        def pack(t, saved=saved):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            got = l2_normalize(x, eps=1e-6, in_float32=True)
        assert torch.equal(got, want)
        assert torch.equal(*(torch.autograd.grad(y, x, g)[0] for y in (got, want)))
        rows = x.numel() // x.shape[-1]
        assert sum(saved.values()) == x.untyped_storage().nbytes() + 2 * rows * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_default_eps_is_the_same_with_and_without_autograd(dtype, with_weight):
    """eps None is `F.rms_norm`'s default on both paths: for a bf16 / fp16 x that is float32's epsilon (it
    computes in float32), which the no-grad path took while the recording one took x's own (bf16: 7.8e-3),
    so a bf16 model scored tokens differently in training and in generation. Rows of small values show it
    (eps is most of their mean square)."""
    torch.manual_seed(4)
    x = torch.randn(3, 5, 7).to(dtype)
    x[0, 1] = (torch.randn(7) * 1e-2).to(dtype)
    x[2, 3, 1:] = 0
    x[2, 3, 0] = 1e-3
    w = (torch.rand(7) + 0.5).to(dtype) if with_weight else None
    want = F.rms_norm(x, (7,), w)
    with torch.no_grad():
        plain = rms_norm(x, w)
    leaves = [x.clone().requires_grad_(), None if w is None else w.clone().requires_grad_()]
    recorded = rms_norm(*leaves)
    torch.testing.assert_close(plain, want, rtol=0, atol=0)  # F.rms_norm itself
    torch.testing.assert_close(recorded.detach(), want)  # the fused backward's forward: rounding apart
    assert recorded.grad_fn is not None and "RMSNorm" in type(recorded.grad_fn).__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rms_norm_default_eps_keeps_float32_and_float64_results(dtype):
    """For float32 and float64 the explicit eps is x's own epsilon, as before: the no-grad path's results
    are `F.rms_norm`'s without an eps to the bit (the library's float32 numbers depend on it)."""
    torch.manual_seed(5)
    x, w = torch.randn(2, 9, 13, dtype=dtype), torch.randn(13, dtype=dtype)
    x[1, 4] *= 1e-4
    with torch.no_grad():
        for weight in (w, None):
            assert torch.equal(rms_norm(x, weight), F.rms_norm(x, (13,), weight))


def test_float16_zero_rows_and_small_rows_stay_finite():
    """In float16, l2_normalize's eps (1e-12) rounded to 0, so a zero row (a zero token's key) gave 0 / 0,
    and the memory written with it was NaN from then on; the fused rms_norm backward formed rstd^3 of a
    small row in float16 (inf) before x scaled it down, so every gradient of a float16 model was NaN."""
    x = torch.randn(4, 8, dtype=torch.float16)
    x[1] = 0
    for fused in (True, False):
        xr = x.clone().requires_grad_()
        y = l2_normalize(xr, fused_backward=fused)
        y.sum().backward()
        assert torch.isfinite(y).all() and torch.isfinite(xr.grad).all()
        assert torch.equal(y[1], torch.zeros(8, dtype=torch.float16))
    small = (torch.randn(4, 16) * 1e-3).half().requires_grad_()
    g = torch.randn(4, 16).half()
    rms_norm(small).backward(g)
    want = torch.autograd.grad(F.rms_norm(small.float(), (16,)), small, g.float())[0]  # float32 reference
    assert torch.isfinite(small.grad).all()
    torch.testing.assert_close(small.grad.float(), want.float(), rtol=2e-2, atol=5e-2)
