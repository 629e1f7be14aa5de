"""The neural memory's chunk loop as a Triton kernel: `neural_memory_triton`, a drop-in for
`titans.ops.memory.chunk.neural_memory_chunked` (same arguments, same returns).

Forward: ONE kernel launch per call (`triton_kernels.memory_chunks_fwd`): a program per sequence
(batch x head) runs every chunk with the state on chip, the chunk's write coefficients computed from the
raw per-token gates in the kernel, and writes the reads, the surprise norms, the final state and, when
gradients are recorded, the state at the start of every chunk (or of every `checkpoint_every`-th chunk).
Around it runs one torch op per memory layer (stacking W and S), none per chunk. A call shorter than a
chunk (decoding one token at a time) is the same single launch: a read, plus the write when the pending
tokens complete a chunk.

Backward: ONE launch too (`memory_chunks_bwd`): the chunks in reverse, each chunk's forward recomputed
from its saved start state and backpropagated, the state gradient carried on chip, the gates' gradients
computed in the kernel (no autograd graph through the coefficients). Two cases go through the torch chunk
step instead (`titans.ops.memory.chunk.run_chunks`, recomputed per group of chunks from the saved states,
the coefficients by `chunk_mix`, and backpropagated: the same gradients at the torch path's speed):
`checkpoint_every` (only every n-th state is kept), and a shape whose backward kernel needs more shared
memory than the GPU has (found at its first backward, then remembered). `shared_memory()` compiles both
kernels for a given GPU on a machine without one and says what they need.

Covered (`covered()`): depth 1 and 2 (`DEPTHS`; a deeper memory is refused by name), silu / gelu / relu,
residual or not, clipping on or off, per-token gates with momentum or forgetting switched off, any chunk
size, trailing partial chunks, a state in and out, float32 / float16 / bfloat16 q, k, v with a float32 (or
wider) state: the kernel computes in float32. Head dims and hidden width up to 256 (the state of one
sequence lives in registers).

Triton is imported only when a kernel first runs, so `TRITON_INTERPRET=1` (Triton's CPU interpreter, how
the tests run the kernels without a GPU) can be set by then.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

from titans.ops.memory.chunk import read_and_grads, run_chunks
from titans.ops.memory.common import (
    chunk_mix,
    stack_states,
    surprise_norm,
    surprise_parts,
    unstack_states,
    without_autocast,
)
from titans.validation import check_int

# the backward kernel where every chunk's state is kept (False: the torch chunk step recomputes, for tests)
FUSED_BACKWARD = True
# rows of a chunk the backward kernel takes at a time (a power of two >= 16)
BACKWARD_ROWS = int(os.environ.get("TITANS_MEMORY_TRITON_ROWS", 32))
MAX_WIDTH = 256  # widest head dim / hidden width the kernel keeps on chip
# memory depths the kernels run: each layer's [W; S] is its own pair of register tensors, and a third
# 128 x 128 layer would not fit one program's registers beside the others
DEPTHS = (1, 2)
_ACT_CODES = {"silu": 0, "gelu": 1, "relu": 2}


_TRITON_FOUND: bool | None = None  # looked up on first use


def triton_available() -> bool:
    """Whether the `triton` package is installed (without importing it). Looked up once per process: the
    memory asks on every call, and a lookup of a package that is not installed searches every path entry.
    A module global rather than `functools.cache`, which torch.compile warns about in a compiled step."""
    global _TRITON_FOUND
    if _TRITON_FOUND is None:
        _TRITON_FOUND = importlib.util.find_spec("triton") is not None
    return _TRITON_FOUND


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is requested (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _kernels():
    # lazily: importing it imports triton (optional), and TRITON_INTERPRET must be set by then
    from titans.ops.memory import triton_kernels

    return triton_kernels


def covered(depth: int, head_dim: int, hidden: int, activation: str) -> str | None:
    """None where the kernels cover a memory of this shape, else the reason they do not."""
    if depth not in DEPTHS:
        covers = " and ".join(map(str, DEPTHS))
        return f"memory depth {depth} is not covered by the kernels (they cover depth {covers})"
    if activation not in _ACT_CODES:
        return f"activation {activation!r} is not covered by the kernels ({', '.join(_ACT_CODES)})"
    widest = head_dim if depth == 1 else max(head_dim, hidden)
    if widest > MAX_WIDTH:
        return f"width {widest} is not covered by the kernels (they keep widths <= {MAX_WIDTH} on chip)"
    return None


def device_reason(device: torch.device) -> str | None:
    """None where the kernels can run on `device`, else why not."""
    if not triton_available():
        return "triton is not installed (pip install 'titans[kernels]')"
    if device.type == "cuda":
        return None
    if interpreting():
        return None
    return f"the tensors are on {device.type}: the kernels run on CUDA (or on CPU under TRITON_INTERPRET=1)"


def _block(n: int) -> int:
    """The power of two >= max(n, 16) a dimension is padded to (`tl.dot` needs 16 or more)."""
    return max(16, 1 << (n - 1).bit_length())


def _precision(t: Tensor) -> str:
    """tl.dot's float32 precision: tf32 where torch's own float32 matmuls may use it (its setting)."""
    if os.environ.get("TITANS_MEMORY_TRITON_PREC"):
        return os.environ["TITANS_MEMORY_TRITON_PREC"]
    if t.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _num_warps(dim: int, hidden: int, chunk: int) -> int:
    """Warps per program: more for wider states (they are spread over the program's registers)."""
    width = _block(dim) * _block(hidden) + _block(chunk) * _block(hidden)
    return int(os.environ.get("TITANS_MEMORY_TRITON_WARPS", 0)) or (4 if width <= 2 * 64 * 64 else 8)


# no software pipelining of the chunk loop: its buffers would multiply the shared memory the dots stage
# their operands in, beyond what one SM has for a state of 64 x 128
_NUM_STAGES = int(os.environ.get("TITANS_MEMORY_TRITON_STAGES", 1))


def _constants(config, dim: int, hidden: int, depth: int, precision: str) -> dict:
    """The compile-time arguments both kernels take (config: activation, residual, clip, chunk), with the
    launch's warps and stages."""
    activation, residual, clip, b = config
    return dict(
        D=dim,
        H1=hidden,
        BD=_block(dim),
        BH=_block(hidden),
        BC=_block(b),
        CHUNK=b,
        DEPTH=depth,
        ACT=_ACT_CODES[activation],
        RESIDUAL=bool(residual),
        CLIP=clip is not None,
        PREC=precision,
        num_warps=_num_warps(dim, hidden, b),
        num_stages=_NUM_STAGES,
    )


def shared_memory(
    depth: int,
    head_dim: int,
    hidden: int,
    chunk: int,
    *,
    capability: int = 90,
    activation: str = "silu",
    residual: bool = False,
    clip: float | None = 1.0,
    precision: str = "tf32",
    qkv_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, int]:
    """Bytes of shared memory the forward and backward kernels need per program for a memory of this shape
    on a CUDA device of compute `capability` (90: H100 / H200), compiled here with the launch's own
    constants: no GPU needed (Triton ships the compiler and `ptxas`), a few seconds to a minute per kernel
    on a CPU. Compare with the device's limit per block (227 KB = 232,448 bytes on an H100 / H200): a
    backward over it runs the torch fallback. Needs TRITON_INTERPRET unset (the kernels compiled, not
    interpreted). A compile error (a kernel Triton cannot build for that device) is raised."""
    if interpreting():
        raise RuntimeError("shared_memory compiles the kernels: unset TRITON_INTERPRET first")
    import triton
    from triton.backends.compiler import GPUTarget

    hidden = head_dim if depth == 1 else hidden
    scalars = {"T", "g_sn", "g_st", "n_full", "n_chunks", "n_saved", "save_until"}
    constants = _constants((activation, residual, clip, chunk), head_dim, hidden, depth, precision)
    options = {k: constants.pop(k) for k in ("num_warps", "num_stages")}

    def kind(arg: str, consts: dict) -> str:
        """Triton's type for a kernel argument: q, k, v of `qkv_dtype`, every other tensor float32."""
        if arg in consts:
            return "constexpr"
        if arg in ("Q", "K", "V"):
            return "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[qkv_dtype]
        return "fp32" if arg == "clip" else "i32" if arg in scalars else "*fp32"

    out = {}
    rows = min(_block(chunk), BACKWARD_ROWS)
    for name, consts in (
        ("forward", {**constants, "SAVE_EVERY": 1}),
        ("backward", {**constants, "RB": rows}),
    ):
        kernel = _kernels().memory_chunks_fwd if name == "forward" else _kernels().memory_chunks_bwd
        signature = {arg: kind(arg, consts) for arg in kernel.arg_names}
        source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=consts)
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
        out[name] = compiled.metadata.shared
    return out


# shapes whose backward kernel needs more shared memory than the device has (found at the first try)
_UNFIT: set[tuple] = set()


def _shape_key(config, q: Tensor, states) -> tuple:
    return (q.device.type, q.shape[-1], tuple(tuple(x.shape[-2:]) for x in states), *config[:2], config[3])


def _launch(config, q, k, v, gates, states, save_every: int, save_tail: bool):
    """Run the forward kernel. q, k, v (N, T, d); gates: theta, log_eta, log_keep (N, T) with the same
    strides; states: per layer (N, 2, d_in, d_out). Returns y (N, T, d), norm (N, T), the new states (like
    `states`) and per layer the saved chunk-start states (N, n_saved, 2, d_in, d_out): of every
    `save_every`-th complete chunk (none if 0), and with `save_tail` of the trailing partial chunk too."""
    clip, b = config[2:]
    n_seq, seq, dim = q.shape
    n_full = seq // b
    depth = len(states)
    hidden = states[0].shape[-1]
    dtype, device = states[0].dtype, q.device
    q, k, v = (x.contiguous() for x in (q, k, v))
    states = [x.contiguous() for x in states]
    n_chunks = -(-seq // b)
    save_until = n_chunks if save_tail else n_full
    n_saved = -(-save_until // save_every) if save_every else 0
    y = torch.empty(n_seq, seq, dim, dtype=dtype, device=device)
    norm = torch.empty(n_seq, seq, dtype=dtype, device=device)
    new_states = [torch.empty_like(x) for x in states]
    saved = [x.new_empty(n_seq, n_saved, *x.shape[1:]) for x in states]
    dummy = norm  # for the pointers the kernel never touches (no second layer, no saves): no allocation
    second = (states[1], new_states[1], saved[1]) if depth == 2 else (dummy, dummy, dummy)
    _kernels().memory_chunks_fwd[(n_seq,)](
        q,
        k,
        v,
        *gates,
        states[0],
        second[0],
        new_states[0],
        second[1],
        saved[0] if n_saved else dummy,
        second[2] if n_saved else dummy,
        y,
        norm,
        seq,
        *gates[0].stride(),
        n_full,
        n_chunks,
        n_saved,
        save_until,
        float(clip) if clip is not None else 0.0,
        **_constants(config, dim, hidden, depth, _precision(q)),
        SAVE_EVERY=save_every if n_saved else 0,
    )
    return y, norm, new_states, saved


class _TritonChunks(torch.autograd.Function):
    """The whole sequence: kernel forward, chunk-by-chunk recomputing backward (module docstring).

    config: (activation, residual, clip, chunk_size, group), group = chunks per saved state. q, k, v
    (N, T, d); theta, log_eta, log_keep (N, T) with the same strides (the kernels compute the chunks'
    coefficients from them); states (N, 2, d_in, d_out) per layer.
    Returns y (N, T, d), the surprise norms (N, T) and the states after the last complete chunk.
    """

    @staticmethod
    def forward(ctx, config, q, k, v, theta, log_eta, log_keep, *states):
        group = config[4]
        grad = any(ctx.needs_input_grad[1:])
        # every chunk's start state kept: the backward kernel runs (where it fits on the device)
        fused = group == 1 and FUSED_BACKWARD and _shape_key(config, q, states) not in _UNFIT
        gates = (theta, log_eta, log_keep)
        y, norm, new_states, saved = _launch(config[:4], q, k, v, gates, states, group if grad else 0, fused)
        ctx.config, ctx.depth, ctx.fused = config, len(states), fused
        if grad:
            ctx.save_for_backward(q, k, v, *gates, *new_states, *saved)
        return (y, norm, *new_states)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, g_y, g_norm, *g_final):
        if ctx.fused:
            try:
                return _fused_backward(ctx, g_y, g_norm, *g_final)
            except _kernels().OutOfResources:
                # too big for one SM's shared memory: the torch chunk step from the same saved states
                _UNFIT.add(_shape_key(ctx.config, ctx.saved_tensors[0], ctx.saved_tensors[6 : 6 + ctx.depth]))
        activation, residual, clip, b, group = ctx.config
        depth = ctx.depth
        q, k, v, *gates = ctx.saved_tensors[:6]
        final, saved = ctx.saved_tensors[6 : 6 + depth], ctx.saved_tensors[6 + depth :]
        needs = ctx.needs_input_grad[1:]
        dtype = final[0].dtype
        n_seq, seq, dim = q.shape
        n_full = seq // b
        saved = [x[:, :n_full] for x in saved]  # the fused backward's also holds the tail's
        length = n_full * b
        g_states = [torch.zeros_like(x) if g is None else g.to(dtype) for x, g in zip(final, g_final)]
        g_qkv = [
            torch.zeros(n_seq, seq, dim, dtype=dtype, device=q.device) if need else None for need in needs[:3]
        ]
        g_gates = [
            torch.zeros(x.shape, dtype=dtype, device=x.device) if need else None
            for x, need in zip(gates, needs[3:6])
        ]

        def leaf(x: Tensor, need: bool) -> Tensor:
            return x.detach().to(dtype).requires_grad_(need)

        def grad_into(outs, grads_out, inputs, targets) -> list:
            """Backpropagate outs (with grads_out) to inputs; add each gradient into its target slice."""
            wanted = [x for x in inputs if x.requires_grad]
            got = iter(torch.autograd.grad(outs, wanted, grads_out, allow_unused=True))
            result = []
            for x, target in zip(inputs, targets):
                g = next(got) if x.requires_grad else None
                if g is not None and target is not None:
                    target += g
                result.append(g)
            return result

        if seq > length:  # the trailing partial chunk: a read of the final weights
            with torch.enable_grad():
                tail = [leaf(x[:, length:], need) for x, need in zip((q, k, v), needs[:3])]
                ws = [x[:, 0].detach().requires_grad_(True) for x in final]
                y, inputs, deltas = read_and_grads(
                    *(x.unsqueeze(1) for x in tail), [w.unsqueeze(1) for w in ws], activation, residual
                )
                norm = surprise_norm(surprise_parts(inputs, deltas))[1]
                grads = grad_into(
                    (y, norm),
                    (g_y[:, length:].unsqueeze(1).to(dtype), g_norm[:, length:].unsqueeze(1).to(dtype)),
                    [*tail, *ws],
                    [None if g is None else g[:, length:] for g in g_qkv] + [None] * depth,
                )
            for g_state, g_w in zip(g_states, grads[3:]):
                if g_w is not None:
                    g_state[:, 0] += g_w

        n_groups = saved[0].shape[1] if saved else 0
        for i in range(n_groups - 1, -1, -1):
            c0, c1 = i * group, min(n_full, (i + 1) * group)
            rows = slice(c0 * b, c1 * b)
            with torch.enable_grad():
                pieces = [leaf(x[:, rows], need) for x, need in zip((q, k, v), needs[:3])]
                gate_rows = [leaf(x[:, rows], need) for x, need in zip(gates, needs[3:6])]
                coefs = chunk_mix(*(x.unsqueeze(0) for x in gate_rows), b, dtype)
                starts = [x[:, i].detach().requires_grad_(True) for x in saved]
                outs = run_chunks(activation, residual, clip, None, b, None, *pieces, *coefs, None, *starts)
                grads = grad_into(
                    outs,
                    (g_y[:, rows].to(dtype), g_norm[:, rows].to(dtype), *g_states),
                    [*pieces, *gate_rows, *starts],
                    [None if g is None else g[:, rows] for g in (*g_qkv, *g_gates)] + [None] * depth,
                )
            g_states = [torch.zeros_like(s) if g is None else g for s, g in zip(starts, grads[6:])]

        g_in = [None if g is None else g.to(x.dtype) for g, x in zip((*g_qkv, *g_gates), (q, k, v, *gates))]
        g_init = [g if need else None for g, need in zip(g_states, needs[6:])]
        return (None, *g_in, *g_init)


def _fused_backward(ctx, g_y, g_norm, *g_final):
    """`_TritonChunks.backward` by the backward kernel (every chunk's start state saved)."""
    clip, b = ctx.config[2:4]
    depth = ctx.depth
    q, k, v, *gates = ctx.saved_tensors[:6]
    final, saved = ctx.saved_tensors[6 : 6 + depth], ctx.saved_tensors[6 + depth :]
    needs = ctx.needs_input_grad[1:]
    n_seq, seq, dim = q.shape
    n_full, hidden = seq // b, final[0].shape[-1]
    device = q.device
    f32 = torch.float32
    g_states = [
        torch.zeros(x.shape, dtype=f32, device=device) if g is None else g.to(f32).contiguous()
        for x, g in zip(final, g_final)
    ]
    g_y = torch.zeros(n_seq, seq, dim, dtype=f32, device=device) if g_y is None else g_y.contiguous()
    g_norm = torch.zeros(n_seq, seq, dtype=f32, device=device) if g_norm is None else g_norm.contiguous()
    g_q, g_k, g_v = (torch.empty(n_seq, seq, dim, dtype=f32, device=device) for _ in range(3))
    # the trailing partial chunk's gates write nothing: their gradients stay 0
    g_gates = torch.zeros(3, n_seq, seq, dtype=f32, device=device)
    dummy = g_gates  # for the second layer's pointers at depth 1 (never touched)
    _kernels().memory_chunks_bwd[(n_seq,)](
        q,
        k,
        v,
        *gates,
        saved[0],
        saved[1] if depth == 2 else dummy,
        g_y,
        g_norm,
        g_states[0],
        g_states[1] if depth == 2 else dummy,
        g_q,
        g_k,
        g_v,
        *g_gates,
        seq,
        *gates[0].stride(),
        n_full,
        -(-seq // b),
        float(clip) if clip is not None else 0.0,
        **_constants(ctx.config[:4], dim, hidden, depth, _precision(q)),
        RB=min(_block(b), BACKWARD_ROWS),
    )
    g_qkv = [g.to(x.dtype) if need else None for g, x, need in zip((g_q, g_k, g_v), (q, k, v), needs[:3])]
    g_gates = [g.to(x.dtype) if need else None for g, x, need in zip(g_gates, gates, needs[3:6])]
    g_init = [g.to(x.dtype) if need else None for g, x, need in zip(g_states, final, needs[6:])]
    return (None, *g_qkv, *g_gates, *g_init)


def neural_memory_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    theta: Tensor,
    log_eta: Tensor,
    log_keep: Tensor,
    weights: tuple[Tensor, ...],
    momentum: tuple[Tensor, ...],
    *,
    chunk_size: int,
    activation: str = "silu",
    residual: bool = False,
    surprise_clip: float | None = None,
    checkpoint_every: int | None = None,
) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...], Tensor]:
    """`titans.ops.memory.chunk.neural_memory_chunked` with the chunk loop in a Triton kernel (see there for
    the arguments and returns). q, k, v may be float16 / bfloat16 with a float32 state (the kernel computes
    in float32; y and the surprise come out in the state's dtype)."""
    check_int("chunk_size", chunk_size)
    check_int("checkpoint_every", checkpoint_every, none_ok=True)
    depth = len(weights)
    reason = covered(depth, q.shape[-1], weights[0].shape[-1], activation) or device_reason(q.device)
    if reason is not None:
        raise ValueError(f"neural_memory_triton: {reason}")
    with torch.autocast(q.device.type, enabled=False):
        batch, heads, seq, dim = q.shape
        b = chunk_size
        n_full = seq // b
        n_seq = batch * heads
        # the raw per-token gates go in (views where they can be): the kernels compute the coefficients
        gates = [x.reshape(n_seq, seq) for x in (theta, log_eta, log_keep)]
        if len({x.stride() for x in gates}) > 1:
            gates = [x.contiguous() for x in gates]
        states = stack_states(weights, momentum)
        flat = (x.reshape(n_seq, seq, dim) for x in (q, k, v))
        group = checkpoint_every if checkpoint_every and torch.is_grad_enabled() else 1
        config = (activation, residual, surprise_clip, b, min(group, max(n_full, 1)))
        inputs = (q, k, v, theta, log_eta, log_keep, *states)
        if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
            y, norm, *states = _TritonChunks.apply(config, *flat, *gates, *states)
        else:  # no autograd node (decoding): torch.compile traces the kernel launch itself
            y, norm, states, _ = _launch(config[:4], *flat, gates, states, 0, False)
    weights, momentum = unstack_states(states, batch, heads)
    return y.view(batch, heads, seq, dim), weights, momentum, norm.view(batch, heads, seq)
