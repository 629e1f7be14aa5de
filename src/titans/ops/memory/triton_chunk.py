"""The neural memory's chunk loop as a Triton kernel: `neural_memory_triton`, a drop-in for
`titans.ops.memory.chunk.neural_memory_chunked` where it covers the call: the same positional arguments
and the options chunk_size, activation, residual, surprise_clip and checkpoint_every (not error /
error_aux, surprise_threshold, max_norm or anchor), the same returns (shapes, and y and the surprise in the
state's dtype), the same values to float32 accuracy (the kernels compute in float32, with TF32 products
on CUDA where torch's float32 matmuls may use them: `dot_precision`).

Forward: ONE kernel launch per call (`triton_kernels.memory_chunks_fwd`): a program per sequence
(batch x head) runs every chunk with the state on chip, the chunk's write coefficients computed from the
raw per-token gates in the kernel, and writes the reads, the surprise norms, the final state and, when
gradients are recorded, the state at the start of every chunk (or of every `checkpoint_every`-th chunk).
Around it runs one torch op per memory layer (stacking W and S), none per chunk. A call shorter than a
chunk (decoding one token at a time) is the same single launch: a read, plus the write when the pending
tokens complete a chunk.

Backward: ONE launch too (`memory_chunks_bwd`): the chunks in reverse, each chunk's forward recomputed
from its saved start state and backpropagated, the state gradient carried on chip, the gates' gradients
computed in the kernel (no autograd graph through the coefficients). With `checkpoint_every` (only every
n-th state kept), two launches per group of n chunks, in reverse: the forward kernel recomputes the
group's chunk-start states from its saved one, and the backward kernel runs over the group. A shape whose
backward kernel needs more shared memory than the GPU has (found at its first backward, then remembered)
goes through the torch chunk step instead (`titans.ops.memory.chunk.run_chunks`, recomputed per group of
chunks from the saved states, the coefficients by `chunk_mix`, and backpropagated: the same gradients at
the torch path's speed). `compiled_kernels()` compiles both
kernels for a given GPU on a machine without one; `shared_memory()` says what shared memory they need.

Both launches are torch custom ops, `titans::memory_chunks` (its autograd registered) and
`titans::memory_chunks_backward`: `torch.compile` calls them as they are (no graph break, no tracing of
the launches), so a compiled model fuses the work around the memory, and decoding compiles too. The torch
chunk step of the fallback above runs in the registered backward, outside the ops (it runs autograd, which
a custom op's implementation cannot).

Covered (`covered()`): depth 1 and 2 (`DEPTHS`; a deeper memory is refused by name), silu / gelu / relu,
residual or not, clipping on or off, per-token gates with momentum or forgetting switched off, any chunk
size, trailing partial chunks, a state in and out, float32 / float16 / bfloat16 q, k, v and gates with a
float32 (or wider) state: the kernel computes in float32, so a float64 state gets float32-accurate results.
A float16 / bfloat16 state is taken too (a bf16 model's): read into float32, carried in float32 over the
call's chunks and rounded to its dtype when stored (the final state, and the chunk-start states the
backward recomputes from). Head dims and hidden width up to 256 (the state of one sequence lives in
registers).

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


# looked up once, at import (without importing triton): the memory asks on every call, and a lookup of a
# package that is not installed searches every path entry. Not lazily: a global set at the first call is a
# guard of compiled code, and the second call would compile again
_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Whether the `triton` package is installed (without importing it)."""
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


def dot_precision(t: Tensor) -> str:
    """tl.dot's float32 precision: tf32 where torch's own float32 matmuls may use it (its setting), else
    ieee: exact float32, without tensor cores (by the kernels' share of the step, the likely reason a 170M
    MAC's `titans train` steps on an H100 took 10x the benchmark's with TF32 off: docs/benchmarks.md,
    "TF32")."""
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


def ptxas_options(depth: int, precision: str, capability: int) -> str | None:
    """The options the kernels' machine code is built with by `ptxas`: None (Triton's own: -O3) where that
    builds them well; `--opt-level 1` for the largest kernels, which -O3 builds with 32 registers a thread,
    spilling most of their state to local memory: at depth 2 below compute capability 9.0 (an A100: each
    product is many small mma.sync) and with exact float32 products (`dot_precision` ieee: loops of fused
    multiply-adds) anywhere. Compiled for an A100 (`benchmarks/kernel_resources.py --capability 80`), the
    depth-2 backward spills 16,723 instructions per warp and chunk at -O3 and 4,605 at -O1. Not timed on
    such a GPU. TITANS_MEMORY_TRITON_PTXAS overrides it (empty: Triton's own)."""
    if "TITANS_MEMORY_TRITON_PTXAS" in os.environ:
        return os.environ["TITANS_MEMORY_TRITON_PTXAS"] or None
    if precision == "ieee" or (depth == 2 and capability < 90):
        return "--opt-level 1"
    return None


def _constants(
    config, dim: int, hidden: int, depth: int, precision: str, capability: int | None = None
) -> dict:
    """The compile-time arguments both kernels take (config: activation, residual, clip, chunk), with the
    launch's warps, stages and (`capability`: a CUDA device's, None under the interpreter) ptxas options."""
    activation, residual, clip, b = config
    options = ptxas_options(depth, precision, capability) if capability is not None else None
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
        **({"ptx_options": options} if options else {}),
    )


def _capability(device: torch.device) -> int | None:
    """A CUDA device's compute capability as one number (90: H100 / H200); None elsewhere."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache  # asked at every launch (each decoded token); a device's capability does not change
def _cuda_capability(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def compiled_kernels(
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
    rows: int | None = None,
    which: tuple[str, ...] = ("forward", "backward"),
) -> dict:
    """The forward and backward kernels for a memory of this shape compiled for a CUDA device of compute
    `capability` (90: H100 / H200) with the launch's own constants (`rows`: the backward's row block,
    `BACKWARD_ROWS` by default; `which`: the kernels to compile), on any machine: no GPU needed (Triton
    ships the compiler and `ptxas`), a few seconds to a minute per kernel on a CPU. Returns
    {"forward": ..., "backward": ...}, Triton's compiled kernels (`.metadata.shared`: shared memory bytes
    per program; `.asm["cubin"]`: the binary). Needs TRITON_INTERPRET unset (the kernels compiled, not
    interpreted). A compile error (a kernel Triton cannot build for that device) is raised."""
    if interpreting():
        raise RuntimeError("compiled_kernels compiles the kernels: unset TRITON_INTERPRET first")
    # imported here, not at the top: this module imports triton only when a kernel is first needed
    import triton
    from triton.backends.compiler import GPUTarget

    hidden = head_dim if depth == 1 else hidden
    scalars = {"T", "sn_in", "sn_out", "g_sn", "g_st", "n_full", "n_chunks", "n_saved", "save_until"}
    config = (activation, residual, clip, chunk)
    constants = _constants(config, head_dim, hidden, depth, precision, capability)
    options = {k: constants.pop(k) for k in ("num_warps", "num_stages", "ptx_options") if k in constants}

    def kind(arg: str, consts: dict) -> str:
        """Triton's type for a kernel argument: q, k, v of `qkv_dtype`, every other tensor float32."""
        if arg in consts:
            return "constexpr"
        if arg in ("Q", "K", "V"):
            return "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[qkv_dtype]
        return "fp32" if arg == "clip" else "i32" if arg in scalars else "*fp32"

    out = {}
    rows = min(_block(chunk), rows or BACKWARD_ROWS)
    for name, consts in (
        ("forward", {**constants, "SAVE_EVERY": 1}),
        ("backward", {**constants, "RB": rows}),
    ):
        if name not in which:
            continue
        kernel = _kernels().memory_chunks_fwd if name == "forward" else _kernels().memory_chunks_bwd
        signature = {arg: kind(arg, consts) for arg in kernel.arg_names}
        source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=consts)
        out[name] = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    return out


def shared_memory(depth: int, head_dim: int, hidden: int, chunk: int, **kwargs) -> dict[str, int]:
    """Bytes of shared memory the forward and backward kernels need per program for a memory of this shape
    (`compiled_kernels`, whose keyword arguments it takes), compiled here without a GPU. Compare with the
    device's limit per block (227 KB = 232,448 bytes on an H100 / H200): a backward over it runs the torch
    fallback."""
    kernels = compiled_kernels(depth, head_dim, hidden, chunk, **kwargs)
    return {name: kernel.metadata.shared for name, kernel in kernels.items()}


# shapes whose backward kernel needs more shared memory than the device has (found at the first try)
_UNFIT: set[tuple] = set()


def _shape_key(config, q: Tensor, states) -> tuple:
    return (q.device.type, q.shape[-1], tuple(tuple(x.shape[-2:]) for x in states), *config[:2], config[3])


def _n_saved(seq: int, chunk: int, save_every: int) -> int:
    """Chunk-start states the forward keeps per layer: every `save_every`-th complete chunk's (none if 0),
    and with `save_every` 1 the trailing partial chunk's too (the backward kernel reads it)."""
    if not save_every:
        return 0
    save_until = -(-seq // chunk) if save_every == 1 else seq // chunk
    return -(-save_until // save_every)


def _dense_rows(*xs: Tensor) -> tuple[list[Tensor], int]:
    """(N, T, d) tensors as the kernels read them, and the tokens from one sequence's first row to the next's:
    in place where every token's row of d is dense and all share one such stride, a multiple of d
    (contiguous tensors, and the same rows of contiguous (N, T', d) tensors: a group of chunks), else
    contiguous copies."""
    n, t, d = xs[0].shape
    step = xs[0].stride(0)
    dense = all(x.stride(2) == 1 and (t == 1 or x.stride(1) == d) and x.stride(0) == step for x in xs)
    if dense and step % d == 0:
        return list(xs), step // d
    return [x.contiguous() for x in xs], t


def _launch(config, q, k, v, gates, states, save_every: int):
    """Run the forward kernel. q, k, v (N, T, d) (read in place where `_dense_rows` allows); gates: theta,
    log_eta, log_keep (N, T) with the same strides; states: per layer (N, 2, d_in, d_out). Returns y (N, T,
    d), norm (N, T), the new states (like `states`) and per layer the saved chunk-start states (N, n_saved,
    2, d_in, d_out) (`_n_saved`)."""
    clip, b = config[2:]
    n_seq, seq, dim = q.shape
    n_full = seq // b
    depth = len(states)
    hidden = states[0].shape[-1]
    dtype, device = states[0].dtype, q.device
    (q, k, v), rows_in = _dense_rows(q, k, v)
    states = [x.contiguous() for x in states]
    n_chunks = -(-seq // b)
    n_saved = _n_saved(seq, b, save_every)
    save_until = n_chunks if save_every == 1 else n_full
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
        rows_in,
        seq,
        *gates[0].stride(),
        n_full,
        n_chunks,
        n_saved,
        save_until,
        float(clip) if clip is not None else 0.0,
        **_constants(config, dim, hidden, depth, dot_precision(q), _capability(q.device)),
        SAVE_EVERY=save_every if n_saved else 0,
    )
    return y, norm, new_states, saved


# The op is two torch custom ops (forward and backward), each opaque to torch.compile: a compiled model
# calls them as they are, fusing the work around them, and dynamo never traces the kernels' launches.
@torch.library.custom_op("titans::memory_chunks", mutates_args=())
def memory_chunks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    theta: Tensor,
    log_eta: Tensor,
    log_keep: Tensor,
    states: list[Tensor],
    activation: str,
    residual: bool,
    clip: float | None,
    chunk: int,
    save_every: int,
) -> list[Tensor]:
    """The forward kernel over whole sequences (`_launch`): q, k, v (N, T, d); theta, log_eta, log_keep
    (N, T) with the same strides; states per layer (N, 2, d_in, d_out). Returns [y (N, T, d), norm (N, T),
    *new states, *saved chunk-start states (N, n_saved, 2, d_in, d_out)], n_saved by `_n_saved`."""
    y, norm, new_states, saved = _launch(
        (activation, residual, clip, chunk), q, k, v, (theta, log_eta, log_keep), states, save_every
    )
    return [y, norm, *new_states, *saved]


@memory_chunks.register_fake
def _(q, k, v, theta, log_eta, log_keep, states, activation, residual, clip, chunk, save_every):
    n_seq, seq, dim = q.shape
    n_saved = _n_saved(seq, chunk, save_every)
    dtype = states[0].dtype
    return [
        q.new_empty(n_seq, seq, dim, dtype=dtype),
        q.new_empty(n_seq, seq, dtype=dtype),
        *(torch.empty_like(x, memory_format=torch.contiguous_format) for x in states),
        *(x.new_empty(n_seq, n_saved, *x.shape[1:]) for x in states),
    ]


@torch.library.custom_op("titans::memory_chunks_backward", mutates_args=())
def memory_chunks_backward(
    g_y: Tensor,
    g_norm: Tensor,
    g_final: list[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    theta: Tensor,
    log_eta: Tensor,
    log_keep: Tensor,
    final: list[Tensor],
    saved: list[Tensor],
    activation: str,
    residual: bool,
    clip: float | None,
    chunk: int,
    group: int,
) -> list[Tensor]:
    """The gradients of `memory_chunks` by the kernels (`_fused_backward`; `saved`: the forward's
    chunk-start states, every `group`-th): [g_q, g_k, g_v, g_theta, g_log_eta, g_log_keep, *g_states],
    each like its input. Raises the kernels' OutOfResources where the backward kernel needs more shared
    memory than the device has."""
    config = (activation, residual, clip, chunk, group)
    return _fused_backward(config, g_y, g_norm, g_final, q, k, v, (theta, log_eta, log_keep), final, saved)


@memory_chunks_backward.register_fake
def _(g_y, g_norm, g_final, q, k, v, theta, log_eta, log_keep, final, *rest):
    return [torch.empty_like(x) for x in (q, k, v, theta, log_eta, log_keep, *final)]


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, theta, log_eta, log_keep, states, activation, residual, clip, chunk, save_every = inputs
    depth = len(states)
    ctx.config, ctx.depth = (activation, residual, clip, chunk, save_every), depth
    ctx.save_for_backward(q, k, v, theta, log_eta, log_keep, *output[2:])


def _backward(ctx, grads):
    depth = ctx.depth
    q, k, v, theta, log_eta, log_keep = ctx.saved_tensors[:6]
    final, saved = ctx.saved_tensors[6 : 6 + depth], ctx.saved_tensors[6 + depth :]
    g_y, g_norm, *g_final = grads[: 2 + depth]
    # outputs not used downstream get no gradient (None or zeros, by the caller)
    g_y = final[0].new_zeros(q.shape) if g_y is None else g_y
    g_norm = final[0].new_zeros(q.shape[:2]) if g_norm is None else g_norm
    g_final = [torch.zeros_like(x) if g is None else g for x, g in zip(final, g_final)]
    config, gates = ctx.config, (theta, log_eta, log_keep)
    # the kernels where the backward kernel fits on the device; else the torch chunk step from the same
    # saved states (here, not in a custom op: it runs autograd, which a custom op's implementation cannot)
    g_inputs = None
    if FUSED_BACKWARD and _shape_key(config, q, final) not in _UNFIT:
        try:
            g_inputs = memory_chunks_backward(g_y, g_norm, g_final, q, k, v, *gates, final, saved, *config)
        except _kernels().OutOfResources:  # too big for one SM's shared memory
            _UNFIT.add(_shape_key(config, q, final))
    if g_inputs is None:
        with torch.autocast(q.device.type, enabled=False):  # as the forward ran
            g_inputs = _recomputed_backward(config, g_y, g_norm, g_final, q, k, v, gates, final, saved)
    needs = ctx.needs_input_grad
    g_in = [g if need else None for g, need in zip(g_inputs[:6], needs[:6])]
    g_states = [g if any_need else None for g, any_need in zip(g_inputs[6:], _list_needs(needs[6], depth))]
    return (*g_in, g_states, None, None, None, None, None)


def _list_needs(need, n: int) -> list[bool]:
    """needs_input_grad of a list argument: one flag per element (or one for the whole list)."""
    return list(need) if isinstance(need, (list, tuple)) else [bool(need)] * n


memory_chunks.register_autograd(_backward, setup_context=_setup_context)


def _fused_backward(config, g_y, g_norm, g_final, q, k, v, gates, final, saved) -> list[Tensor]:
    """`memory_chunks_backward` by the kernels. Every chunk's start state saved (group 1): one launch of the
    backward kernel. Every `group`-th (`checkpoint_every`): per group of chunks in reverse, the forward
    kernel recomputes the group's chunk-start states from its saved one, then the backward kernel runs over
    the group, the state gradient carried from group to group (the same arithmetic as one launch: the same
    gradients), for a forward launch more per group."""
    b, group = config[3:5]
    n_seq, seq, dim = q.shape
    device, f32 = q.device, torch.float32
    # laid out as the gradients of y are (the backward kernel reads them alike): copies of views only
    q, k, v = (x.contiguous() for x in (q, k, v))
    # written by the kernel: copies, never the caller's tensors
    g_states = [g.to(f32, copy=True).contiguous() for g in g_final]
    g_y, g_norm = g_y.to(f32).contiguous(), g_norm.to(f32).contiguous()
    g_q, g_k, g_v = (torch.empty(n_seq, seq, dim, dtype=f32, device=device) for _ in range(3))
    # the trailing partial chunk's gates write nothing: their gradients stay 0
    g_gates = [torch.zeros(n_seq, seq, dtype=f32, device=device) for _ in range(3)]
    if group == 1:
        _backward_launch(config, g_y, g_norm, g_states, q, k, v, gates, saved, (g_q, g_k, g_v, *g_gates))
    else:
        n_groups = saved[0].shape[1]  # >= 1: a group > 1 is only asked for with two complete chunks or more
        for i in range(n_groups - 1, -1, -1):
            # the last group runs to the end: the trailing partial chunk is read from its final state
            rows = slice(i * group * b, seq if i == n_groups - 1 else (i + 1) * group * b)
            # the group's rows of every (N, T, ...) tensor, in place (views)
            qkv, gates_i, g_out, outs = (
                [x[:, rows] for x in xs]
                for xs in ((q, k, v), gates, (g_y, g_norm), (g_q, g_k, g_v, *g_gates))
            )
            group_saved = _launch(config[:4], *qkv, gates_i, [x[:, i] for x in saved], 1)[3]
            _backward_launch(config, *g_out, g_states, *qkv, gates_i, group_saved, outs)
    return [g.to(x.dtype) for g, x in zip((g_q, g_k, g_v, *g_gates, *g_states), (q, k, v, *gates, *final))]


def _backward_launch(config, g_y, g_norm, g_states, q, k, v, gates, saved, outs) -> None:
    """One launch of the backward kernel over whole sequences, every chunk's start state in `saved` (per
    layer (N, n_chunks, 2, d_in, d_out)). g_y (N, T, d), g_norm (N, T) float32; g_states: per layer the
    float32 gradient of the state after the last chunk, overwritten with that of the state before the
    first; outs: g_q, g_k, g_v (N, T, d) and g_theta, g_log_eta, g_log_keep (N, T), float32, written (the
    gates' of a trailing partial chunk left as they are). q, k, v, g_y, g_norm share one layout (rows
    of d dense, one stride between sequences: contiguous tensors or the same rows of contiguous ones), and
    so do the outputs."""
    clip, b = config[2:4]
    depth = len(g_states)
    n_seq, seq, dim = q.shape
    hidden = g_states[0].shape[-1]
    rows_in, rows_out = q.stride(0) // dim, outs[0].stride(0) // dim
    dummy = outs[3]  # for the second layer's pointers at depth 1 (never touched)
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
        *outs,
        seq,
        rows_in,
        rows_out,
        *gates[0].stride(),
        seq // b,
        -(-seq // b),
        float(clip) if clip is not None else 0.0,
        **_constants(config[:4], dim, hidden, depth, dot_precision(q), _capability(q.device)),
        RB=min(_block(b), BACKWARD_ROWS),
    )


def _recomputed_backward(config, g_y, g_norm, g_final, q, k, v, gates, final, saved) -> list[Tensor]:
    """`memory_chunks_backward` by the torch chunk step: each group of chunks recomputed from its saved
    start state and backpropagated, in reverse, the state gradient carried between groups."""
    activation, residual, clip, b, group = config
    depth = len(final)
    dtype = final[0].dtype
    n_seq, seq, dim = q.shape
    n_full = seq // b
    saved = [x[:, :n_full] for x in saved]  # with group 1 the trailing partial chunk's is saved too
    length = n_full * b
    g_states = [g.to(dtype, copy=True) for g in g_final]  # added into: copies
    g_qkv = [torch.zeros(n_seq, seq, dim, dtype=dtype, device=q.device) for _ in range(3)]
    g_gates = [torch.zeros(x.shape, dtype=dtype, device=x.device) for x in gates]

    def leaf(x: Tensor) -> Tensor:
        return x.detach().to(dtype).requires_grad_(True)

    def grad_into(outs, grads_out, inputs, targets) -> list:
        """Backpropagate outs (with grads_out) to inputs; add each gradient into its target slice."""
        got = torch.autograd.grad(outs, inputs, grads_out, allow_unused=True)
        for g, target in zip(got, targets):
            if g is not None and target is not None:
                target += g
        return list(got)

    with torch.enable_grad():
        if seq > length:  # the trailing partial chunk: a read of the final weights
            tail = [leaf(x[:, length:]) for x in (q, k, v)]
            ws = [x[:, 0].detach().requires_grad_(True) for x in final]
            y, inputs, deltas = read_and_grads(
                *(x.unsqueeze(1) for x in tail), [w.unsqueeze(1) for w in ws], activation, residual
            )
            norm = surprise_norm(surprise_parts(inputs, deltas))[1]
            grads = grad_into(
                (y, norm),
                (g_y[:, length:].unsqueeze(1).to(dtype), g_norm[:, length:].unsqueeze(1).to(dtype)),
                [*tail, *ws],
                [g[:, length:] for g in g_qkv] + [None] * depth,
            )
            for g_state, g_w in zip(g_states, grads[3:]):
                if g_w is not None:
                    g_state[:, 0] += g_w

        n_groups = saved[0].shape[1] if saved else 0
        for i in range(n_groups - 1, -1, -1):
            c0, c1 = i * group, min(n_full, (i + 1) * group)
            rows = slice(c0 * b, c1 * b)
            pieces = [leaf(x[:, rows]) for x in (q, k, v)]
            gate_rows = [leaf(x[:, rows]) for x in gates]
            coefs = chunk_mix(*(x.unsqueeze(0) for x in gate_rows), b, dtype)
            starts = [x[:, i].detach().requires_grad_(True) for x in saved]
            outs = run_chunks(activation, residual, clip, None, b, None, *pieces, *coefs, None, *starts)
            grads = grad_into(
                outs,
                (g_y[:, rows].to(dtype), g_norm[:, rows].to(dtype), *g_states),
                [*pieces, *gate_rows, *starts],
                [g[:, rows] for g in (*g_qkv, *g_gates)] + [None] * depth,
            )
            g_states = [torch.zeros_like(s) if g is None else g for s, g in zip(starts, grads[6:])]

    return [g.to(x.dtype) for g, x in zip((*g_qkv, *g_gates, *g_states), (q, k, v, *gates, *final))]


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
    the arguments and returns; the module docstring for what it covers). q, k, v and the gates may be of
    any floating dtype, the state float32 or wider (float16 / bfloat16 is taken, rounded once per call):
    the kernel computes in float32; y and the surprise come out in the state's dtype."""
    check_int("neural_memory_triton: chunk_size", chunk_size)
    check_int("neural_memory_triton: checkpoint_every", checkpoint_every, none_ok=True)
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
        clip = None if surprise_clip is None else float(surprise_clip)
        config = (activation, residual, clip, b, min(group, max(n_full, 1)))
        inputs = (q, k, v, theta, log_eta, log_keep, *states)
        # the chunk-start states the backward needs, only where there will be one
        save_every = config[4] if torch.is_grad_enabled() and any(x.requires_grad for x in inputs) else 0
        y, norm, *states = memory_chunks(*flat, *gates, states, *config[:4], save_every)[: 2 + depth]
    weights, momentum = unstack_states(states, batch, heads)
    return y.view(batch, heads, seq, dim), weights, momentum, norm.view(batch, heads, seq)
