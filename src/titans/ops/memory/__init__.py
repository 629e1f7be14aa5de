"""The neural memory op: read and write a memory over a sequence, chunk by chunk (docs/design.md, "The
memory", "The chunked form", "Memory rules").

    y, weights, momentum, surprise = neural_memory(q, k, v, gates, weights, momentum, chunk_size=64)

`neural_memory` is the op's one entry point: the same call for every update rule and every path, the
backend and rule choosing what runs. The package holds:

    chunk.py           the chunked torch path (custom autograd): the "titans" rule and every rule whose
                       retention, window and optimiser are Titans's (any bias, as the inner loss's error map)
    triton_chunk.py    the same chunk loop as Triton kernels (triton_kernels.py): the "titans" rule
    rules.py           the memory rules' parts (`MemoryRule`) and the chunked path of the other rules
                       (torch autograd)
    common.py          what the paths share: the memory MLP and its inner backprop, the chunk coefficients,
                       the surprise, clip, write mask and weight bound
    chunk_ref.py       the float64 per-token references, written from the equations; each shares no code
    rules_ref.py       with the path it checks

Code outside `titans.ops` imports this package only, never its modules.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titans.ops.memory.chunk import neural_memory_chunked
from titans.ops.memory.chunk_ref import neural_memory_ref
from titans.ops.memory.common import (
    ACTIVATIONS,
    bound_weights,
    check_max_norm,
    check_threshold,
    memory_forward,
    segsum,
    suffix_sum,
    write_mask,
)
from titans.ops.memory.rules import (
    BIASES,
    OPTIMIZERS,
    RETENTIONS,
    RULE_PRESETS,
    Bias,
    DecayRetention,
    GateSpec,
    HuberBias,
    KLRetention,
    L2Bias,
    LpBias,
    LqRetention,
    MemoryRule,
    MomentumSGD,
    Muon,
    Optimizer,
    Retention,
    RulePart,
    Window,
    check_gates,
    check_history,
    fits_fast_path,
    memory_rule_chunked,
    memory_rule_chunked_autograd,
    newton_schulz,
    newton_schulz_flops,
    resolve_rule,
)
from titans.ops.memory.rules_ref import memory_rule_ref
from titans.ops.memory.triton_chunk import DEPTHS as TRITON_DEPTHS
from titans.ops.memory.triton_chunk import covered, device_reason, dot_precision, neural_memory_triton
from titans.validation import check_int

BACKENDS = ("torch", "triton", "reference")


def triton_reason(
    depth: int, head_dim: int, hidden: int, activation: str, device: torch.device | None = None
) -> str | None:
    """None where the Triton path can run a memory of this shape (on `device`, if given), else why not."""
    reason = covered(depth, head_dim, hidden, activation)
    if reason is None and device is not None:
        reason = device_reason(device)
    return reason


def _reference(fn, *args, **options):
    """A reference's run: it takes its inner gradients by autograd, so it records even under no_grad (and
    then hands back its outputs without the graph, as the other backends do there)."""
    if torch.is_grad_enabled():
        return fn(*args, **options)

    def detached(x):  # a view made under no_grad may say it requires grad, yet has no graph to differentiate
        return x.detach() if isinstance(x, Tensor) else tuple(map(detached, x)) if isinstance(x, tuple) else x

    args, options = tuple(map(detached, args)), {k: detached(v) for k, v in options.items()}
    with torch.enable_grad():
        y, weights, momentum, surprise = fn(*args, **options)
    return (
        y.detach(),
        tuple(w.detach() for w in weights),
        tuple(s.detach() for s in momentum),
        surprise.detach(),
    )


def _check_state(
    q: Tensor, k: Tensor, v: Tensor, weights: tuple, momentum: tuple, anchor: tuple | None
) -> None:
    """The memory's state against q, k, v, each mismatch named (torch raised from inside a matmul or a
    stack, and the reference broadcast a momentum of batch 1 over weights of batch 2)."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"neural_memory: q and k must be of one width, got {q.shape[-1]} and {k.shape[-1]}")
    if not weights:
        raise ValueError("neural_memory: weights must hold one tensor per memory layer, got none")
    for name, state in (("momentum", momentum), ("anchor", anchor)):
        if state is not None and len(state) != len(weights):
            layers = len(weights)
            raise ValueError(
                f"neural_memory: {name} must hold one tensor per memory layer ({layers}), got {len(state)}"
            )
    batch, heads, width = *q.shape[:2], k.shape[-1]
    for i, w in enumerate(weights):
        if w.dim() != 4 or tuple(w.shape[:3]) != (batch, heads, width):
            raise ValueError(
                f"neural_memory: weights[{i}] must be (B, H, d_in, d_out) = ({batch}, {heads}, {width}, ...)"
                f" after the layer before it, got {tuple(w.shape)}"
            )
        width = w.shape[3]
        if momentum[i].shape != w.shape:
            raise ValueError(
                f"neural_memory: momentum[{i}] must be of weights[{i}]'s shape {tuple(w.shape)}, got "
                f"{tuple(momentum[i].shape)}"
            )
        if w.dtype != weights[0].dtype or momentum[i].dtype != w.dtype:  # the state computes in one dtype
            raise TypeError(
                f"neural_memory: weights and momentum must share one dtype, got weights[{i}] {w.dtype} and "
                f"momentum[{i}] {momentum[i].dtype} (weights[0] {weights[0].dtype})"
            )
        if anchor is not None and tuple(anchor[i].shape[-2:]) != tuple(w.shape[-2:]):
            raise ValueError(
                f"neural_memory: anchor[{i}] must end in weights[{i}]'s (d_in, d_out) {tuple(w.shape[-2:])}, "
                f"got {tuple(anchor[i].shape)}"
            )
    if width != v.shape[-1]:
        raise ValueError(f"neural_memory: the last layer's output width {width} must be v's, {v.shape[-1]}")


def _no_rows(v: Tensor, weights: tuple[Tensor, ...], momentum: tuple[Tensor, ...]):
    """What every backend returns for a call with no rows to read or write: empty y and surprise in the
    state's dtype, the state as it came."""
    batch, heads, _, dim = v.shape
    empty = weights[0].new_empty(batch, heads, 0)
    return weights[0].new_empty(batch, heads, 0, dim), tuple(weights), tuple(momentum), empty


def neural_memory(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gates: Tensor,
    weights: tuple[Tensor, ...],
    momentum: tuple[Tensor, ...],
    *,
    chunk_size: int,
    rule: str | dict | MemoryRule | None = None,
    backend: str = "torch",
    history: int = 0,
    activation: str = "silu",
    residual: bool = False,
    surprise_clip: float | None = None,
    checkpoint_every: int | None = None,
    surprise_threshold: float | None = None,
    max_norm: float | None = None,
    anchor: tuple[Tensor, ...] | None = None,
) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...], Tensor]:
    """Read and write the memory over a sequence with `rule`, on `backend`.

    q, k, v: (B, H, h + T, d), the first h = `history` rows context only (a windowed rule's written tokens
        its window reaches back to; 0 for the other rules).
    gates: (B, H, h + T, 3 + e): theta, log(eta), log(1 - alpha) per token and head, then the rule's e
        extra gates (`MemoryRule.extra_gates`).
    weights, momentum: per memory layer (B, H, d_in, d_out); for a rule with a retention map, the
        pre-retention state A (the memory reads W = g(A)).
    rule: a preset name, a parts dict or a `MemoryRule` (None: "titans").
    backend: "torch" (the chunked torch path), "triton" (the Triton kernels: the "titans" rule of depth 1
        or 2 without a surprise threshold, weight bound or anchor) or "reference" (the per-token loop, for
        tests).
    checkpoint_every: activation checkpointing of the chunk loop (`neural_memory_chunked`); same outputs
        and gradients. The reference keeps every step.
    surprise_threshold, max_norm, anchor: as `neural_memory_chunked`'s; max_norm and anchor with the
        "titans" rule only.

    q, k, v may be of another dtype than the state (bf16 with a float32 state), the gates of any floating
    dtype. The torch backend computes in the state's dtype (q, k, v cast to it), the chunk coefficients
    in the widest of the gates' dtype, the state's and float32 on the Titans loop (`neural_memory_chunked`,
    and the rules that fit it) and in the state's dtype on the other rules' loop
    (`memory_rule_chunked_autograd`). The Triton kernels compute in float32 whatever the dtypes: with a
    float64 state the results are float32-accurate; a float16 / bfloat16 state is read into float32 and
    rounded back to its dtype once per call (the torch backend rounds it after every chunk). The reference
    computes in its inputs' dtypes (run it in float64).

    Returns y (B, H, T, d), weights and momentum after the last complete chunk, surprise (B, H, T), y and
    surprise in the state's dtype.
    """
    rule = resolve_rule(rule)
    if backend not in BACKENDS:
        raise ValueError(f"neural_memory: backend must be one of {BACKENDS}, got {backend!r}")
    check_int("neural_memory: chunk_size", chunk_size)
    if activation not in ACTIVATIONS:
        raise ValueError(f"neural_memory: activation must be one of {ACTIVATIONS}, got {activation!r}")
    check_max_norm("neural_memory: surprise_clip", surprise_clip)
    rows = {name: tuple(t.shape[:3]) for name, t in (("q", q), ("k", k), ("v", v), ("gates", gates))}
    if len(set(rows.values())) > 1:
        raise ValueError(f"neural_memory: q, k, v and gates must agree on (B, H, T), got {rows}")
    _check_state(q, k, v, tuple(weights), tuple(momentum), None if anchor is None else tuple(anchor))
    common = dict(
        chunk_size=chunk_size, activation=activation, residual=residual, surprise_clip=surprise_clip
    )
    if backend != "triton":
        # the memory runs in its state's dtype, as the kernels run bf16 / fp16 q, k, v with a float32 state:
        # y and the surprise come out in it, the gradients in the inputs' dtypes
        q, k, v = (x.to(weights[0].dtype) for x in (q, k, v))
    if not rule.is_titans:
        titans_only = {"max_norm": max_norm, "anchor": anchor}
        used = sorted(name for name, value in titans_only.items() if value is not None)
        if used or backend == "triton":
            what = ", ".join(used) if used else "backend='triton'"
            raise ValueError(f"neural_memory: {what} runs rule='titans' only, got rule={rule.to_config()!r}")
        check_history(history, k, "neural_memory")
        if k.shape[2] == history:
            check_gates(rule, k, gates)
            return _no_rows(v, weights, momentum)
        options = dict(rule=rule, history=history, surprise_threshold=surprise_threshold, **common)
        if backend == "reference":
            return _reference(memory_rule_ref, q, k, v, gates, weights, momentum, **options)
        return memory_rule_chunked(
            q, k, v, gates, weights, momentum, checkpoint_every=checkpoint_every, **options
        )
    if history:
        raise ValueError(f"neural_memory: history rows are for a windowed rule, got history={history}")
    if gates.shape[-1] != 3:
        raise ValueError(f"neural_memory: rule 'titans' takes 3 gates per token, got {tuple(gates.shape)}")
    if not k.shape[2]:
        return _no_rows(v, weights, momentum)
    theta, log_eta, log_keep = gates.unbind(-1)  # one stack in the backward pass, not three zero-fills
    args = (q, k, v, theta, log_eta, log_keep, weights, momentum)
    if backend == "triton":
        options = {"surprise_threshold": surprise_threshold, "max_norm": max_norm, "anchor": anchor}
        used = sorted(name for name, value in options.items() if value is not None)
        if used:
            raise ValueError(f"neural_memory(backend='triton'): {', '.join(used)} not covered by the kernels")
        return neural_memory_triton(*args, checkpoint_every=checkpoint_every, **common)
    options = dict(surprise_threshold=surprise_threshold, max_norm=max_norm, anchor=anchor, **common)
    if backend == "reference":
        return _reference(neural_memory_ref, *args, **options)
    return neural_memory_chunked(*args, checkpoint_every=checkpoint_every, **options)


__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "BIASES",
    "OPTIMIZERS",
    "RETENTIONS",
    "RULE_PRESETS",
    "TRITON_DEPTHS",
    "Bias",
    "DecayRetention",
    "GateSpec",
    "HuberBias",
    "KLRetention",
    "L2Bias",
    "LpBias",
    "LqRetention",
    "MemoryRule",
    "MomentumSGD",
    "Muon",
    "Optimizer",
    "Retention",
    "RulePart",
    "Window",
    "bound_weights",
    "check_max_norm",
    "check_threshold",
    "dot_precision",
    "fits_fast_path",
    "memory_forward",
    "memory_rule_chunked",
    "memory_rule_chunked_autograd",
    "memory_rule_ref",
    "neural_memory",
    "neural_memory_chunked",
    "neural_memory_ref",
    "neural_memory_triton",
    "newton_schulz",
    "newton_schulz_flops",
    "resolve_rule",
    "segsum",
    "suffix_sum",
    "triton_reason",
    "write_mask",
]
