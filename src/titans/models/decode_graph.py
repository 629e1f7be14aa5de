"""Decoding as a fixed graph: static state buffers and one step function per phase of the chunk/segment
cycle, compiled with `torch.compile` (CPU or CUDA) or captured as CUDA graphs.

    decoder = StaticDecoder(model, state, mode="compile")    # state: after prefill (position >= 1)
    logits = decoder.step(tokens)                             # tokens (B, 1) -> next-token logits (B, vocab)
    state = decoder.state()                                   # a TitansState, as the eager steps return

The eager step (`TitansLM.forward` on one token) builds a new state per token: caches grow by
concatenation, pending memory rows are re-sliced, and every shape depends on the position. Here every
tensor of the state lives in a buffer of fixed shape that the step updates in place:

- sliding-window attention: a ring of `window` key/value slots (slot = position mod window, the slots not
  yet written masked out);
- MAC segment attention: `segment_len` slots for the segment's keys/values and memory tokens, slot =
  position mod segment_len, the later slots masked out (a new segment overwrites them);
- the neural memory: its weights and momentum, the conv tail, and `chunk_size` pending rows of keys,
  values and gates (after a windowed rule's history rows); the token at phase r of its chunk fills row r.

The position is a device tensor that the step advances, so the only thing that differs from one token to
the next is which phase it is: a token that completes a memory chunk also writes the chunk (and in MAC,
one that completes a segment also moves the segment weights). So there are at most three distinct steps
(read; read + write; read + write + new segment), each compiled (or captured) once and picked by the
position on the host. Each step equals the eager step to float tolerance (`tests/test_decode_graph.py`):
the same layers run, only the attention's key order and the matmul shapes differ.

Modes: "eager" runs the static step as it is, "compile" through `torch.compile(dynamic=False)`,
"cuda_graph" captures each phase's step as a CUDA graph and replays it (CUDA only; the static buffers and
the in-place position make the step capturable: no host sync, no allocation that outlives it).
In "compile", `mm="pointwise"` (the default) has inductor write the one-token matmuls into its generated
code instead of calling BLAS, and `guards="state"` (opt-in) has torch.compile check before each call only
the guards on tensors, torch's global state and the decoder's own objects, the decoder checking the
model's modules itself when it is built or loaded (`_state_guards`, `_model_key`).

Decoders are pooled on their model (`checkout`): `generate` (and so the server) takes one, loads a state
into its buffers and gives it back; the compiled code is shared by a model's decoders (the transformers
wrapper keeps one decoder per batch size and mode, held by its live cache).

Full causal attention (the "transformer" variant) has a cache that grows with the context: it is refused.
"""

from __future__ import annotations

import math
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from titans.layers.attention import (
    AttentionState,
    SegmentAttention,
    SegmentAttentionState,
    SelfAttention,
    _l2_normalize,
)
from titans.layers.memory import MemoryState, NeuralMemory
from titans.layers.rotary import RotaryEmbedding
from titans.layers.state_tree import map_tensors
from titans.models.blocks import (
    AttentionBlock,
    Block,
    MACBlock,
    MACState,
    MAGBlock,
    MAGState,
    MALBlock,
    MALState,
    MemoryBlock,
)
from titans.models.ids import check_token_dtype, check_token_ids
from titans.models.state import TitansState

MODES = ("eager", "compile", "cuda_graph")
GUARDS = ("full", "state")
MMS = ("blas", "pointwise")
# torch.compile's guards kept by guards="state": tensors (shape, dtype, device, strides) and torch's global
# state; and every guard on the decoder's own objects (its buffers, lists, Python ints such as the memories'
# offsets), which is everything rooted in the decoder that is not a module of the model
_GLOBAL_GUARDS = {
    "TENSOR_MATCH",
    "GRAD_MODE",
    "GLOBAL_STATE",
    "DEFAULT_DEVICE",
    "DETERMINISTIC_ALGORITHMS",
    "TORCH_FUNCTION_STATE",
    "AUTOGRAD_SAVED_TENSORS_HOOKS",
    "SHAPE_ENV",
}


# ------------------------------------------------------------------------------------------- helpers
def _rotate(rotary: RotaryEmbedding, x: Tensor, positions: Tensor) -> Tensor:
    """RoPE of x (B, H, T, D) at `positions` (T,) (a device tensor), with the angles computed as the
    rotary's cache computes them (float64), so no table lookup depends on a host-side bound."""
    if rotary.half == 0:
        return x
    cos, sin = rotary._angles_cos_sin(positions)
    dtype = torch.promote_types(x.dtype, torch.float32)
    cos, sin, xf = cos.to(dtype), sin.to(dtype), x.to(dtype)
    half = rotary.half
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).to(x.dtype)


def _queries(attn, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """`_ProjectedAttention._queries` at device positions: x (B, 1, dim) -> the rotated queries and the
    unrotated ones, (B, H, 1, D) each."""
    q = attn._query_heads(x)
    return _rotate(attn.rotary, q, positions), q


def _keys_values(attn, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """`_ProjectedAttention._keys_values` at device positions: x (B, 1, dim) -> k, v (B, H, 1, D)."""
    k = attn._split_heads(attn._keys(x))
    if attn.qk_norm:
        k = _l2_normalize(k)
    v = attn._split_heads(attn._values(x))
    return _rotate(attn.rotary, k, positions), v


def _attend(
    attn, q: Tensor, keys: list[Tensor], values: list[Tensor], masks: list[Tensor], q_persistent: Tensor
) -> Tensor:
    """Softmax attention of q (B, H, 1, D) over the concatenated keys/values (B, H, n_i, D) (persistent
    ones (H, P, D) broadcast, scored by ``q_persistent`` where the layer's `persistent_rope` is "none"),
    each key kept where its mask (n_i,) is True. Returns (B, H, 1, D)."""
    pk, pv = attn._persistent_kv()
    b = q.shape[0]
    dt = torch.promote_types(q.dtype, torch.float32)  # at least float32: a float64 model's stays float64
    scale = attn._softmax_scale
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    k, v, mask = torch.cat(keys, 2), torch.cat(values, 2), torch.cat(masks)
    scores = torch.matmul(q.to(dt), k.to(dt).transpose(-1, -2)) * scale
    if pk is not None:
        by = q_persistent if attn.persistent_rope == "none" else q
        p_scores = torch.matmul(by.to(dt), pk.to(dt).unsqueeze(0).transpose(-1, -2)) * scale
        scores = torch.cat([p_scores, scores], dim=-1)
        v = torch.cat([pv.unsqueeze(0).expand(b, -1, -1, -1).to(v.dtype), v], dim=2)
        mask = torch.cat([mask.new_ones(pk.shape[1]), mask])
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), v.to(dt)).to(q.dtype)


# ------------------------------------------------------------------------------------- layer states
class _Static:
    """A layer's state in fixed buffers: `step` updates them in place, `export` returns the eager state."""

    def buffers(self) -> list[Tensor]:
        return [t for t in vars(self).values() if isinstance(t, Tensor)] + [
            t for v in vars(self).values() if isinstance(v, list) for t in v if isinstance(t, Tensor)
        ]


class _WindowAttention(_Static):
    """`SelfAttention` with a window w: a ring of w key/value slots, slot = position mod w."""

    def __init__(self, attn: SelfAttention, state: AttentionState | None, batch: int, like: Tensor):
        assert attn.window is not None  # full attention: refused by `check_static_decoding`
        self.attn, w = attn, attn.window
        shape = (batch, attn.heads, w, attn.head_dim)
        # in the state's dtype (autocast's, if it was prefilled under autocast: the eager step's caches are),
        # so that `export` gives back what the eager steps hold
        dtype = like.dtype if state is None else state.k.dtype
        self.k, self.v = like.new_zeros(shape, dtype=dtype), like.new_zeros(shape, dtype=dtype)
        if state is not None and state.k.shape[2]:
            n = state.k.shape[2]
            slots = torch.arange(state.position - n, state.position, device=like.device) % w
            self.k[:, :, slots] = state.k
            self.v[:, :, slots] = state.v

    def step(self, x: Tensor, pos: Tensor) -> Tensor:
        attn, w = self.attn, self.attn.window
        positions = pos.view(1)
        q, q_heads = _queries(attn, x, positions)
        k, v = _keys_values(attn, x, positions)
        slot = positions % w
        # k, v come in autocast's dtype under autocast, the parameters' without: the buffers' may be either
        self.k.index_copy_(2, slot, k.to(self.k.dtype))
        self.v.index_copy_(2, slot, v.to(self.v.dtype))
        mask = torch.arange(w, device=x.device) <= pos  # before the ring wraps, the later slots are empty
        return attn._output(_attend(attn, q, [self.k], [self.v], [mask], q_heads), x)

    def export(self, position: int) -> AttentionState:
        n = min(position, self.attn.window - 1)
        slots = torch.arange(position - n, position, device=self.k.device) % self.attn.window
        return AttentionState(self.k[:, :, slots], self.v[:, :, slots], position)


class _SegmentAttention(_Static):
    """MAC's `SegmentAttention`: segment_len slots for the segment's keys/values and memory tokens."""

    def __init__(self, attn: SegmentAttention, state: SegmentAttentionState | None, batch: int, like: Tensor):
        self.attn, c = attn, attn.segment_len
        shape = (batch, attn.heads, c, attn.head_dim)
        dtype = like.dtype if state is None else state.k.dtype  # the state's, as `_WindowAttention`'s
        self.k, self.v, self.ctx_k, self.ctx_v = (like.new_zeros(shape, dtype=dtype) for _ in range(4))
        if state is not None:
            n = state.k.shape[2]
            for buf, src in ((self.k, state.k), (self.v, state.v), (self.ctx_k, state.ctx_k)):
                buf[:, :, :n] = src
            self.ctx_v[:, :, :n] = state.ctx_v

    def step(self, x: Tensor, ctx: Tensor, pos: Tensor) -> Tensor:
        attn, c = self.attn, self.attn.segment_len
        local = pos.view(1) % c
        q, q_heads = _queries(attn, x, local)
        k, v = _keys_values(attn, x, local)
        ctx_k, ctx_v = _keys_values(attn, ctx, local)
        for buf, new in ((self.k, k), (self.v, v), (self.ctx_k, ctx_k), (self.ctx_v, ctx_v)):
            buf.index_copy_(2, local, new.to(buf.dtype))  # as `_WindowAttention.step`
        mask = torch.arange(c, device=x.device) <= local  # slots past the token: the last segment's
        o = _attend(attn, q, [self.ctx_k, self.k], [self.ctx_v, self.v], [mask, mask], q_heads)
        return attn._output(o, x)

    def export(self, position: int) -> SegmentAttentionState:
        n = position % self.attn.segment_len
        k, v, ck, cv = (t[:, :, :n].clone() for t in (self.k, self.v, self.ctx_k, self.ctx_v))
        return SegmentAttentionState(k, v, ck, cv, position)


class _Memory(_Static):
    """`NeuralMemory`: weights, momentum, conv tail and the chunk's pending rows in fixed buffers.

    `offset`: the memory's position minus the model's (MAG/MAL read persistent tokens first)."""

    def __init__(self, mem: NeuralMemory, state: MemoryState, model_position: int):
        self.mem = mem
        self.offset = state.position - model_position
        self.hist = mem._history
        self.weights = [w.contiguous().clone() for w in state.weights]
        self.momentum = [s.contiguous().clone() for s in state.momentum]
        b, h, r, d = state.pending_k.shape
        self.rows0 = r
        rows = self.hist + mem.chunk_size
        self.pk = state.pending_k.new_zeros(b, h, rows, d)
        self.pv = state.pending_v.new_zeros(b, h, rows, d)
        self.pg = state.pending_gates.new_zeros(b, h, rows, state.pending_gates.shape[-1])
        self.pk[:, :, :r], self.pv[:, :, :r], self.pg[:, :, :r] = (
            state.pending_k,
            state.pending_v,
            state.pending_gates,
        )
        self.tail = None if state.conv_tail is None else state.conv_tail.clone()

    def completes(self, model_position: int) -> bool:
        """Whether the token at this model position completes one of the memory's chunks."""
        return (
            self.mem.write and (model_position + self.offset) % self.mem.chunk_size == self.mem.chunk_size - 1
        )

    def step(self, x: Tensor, pos: Tensor, write: bool) -> Tensor:
        """x (B, 1, dim) -> y (B, 1, dim): read at the chunk-start weights; with `write`, the token completes
        its chunk and the chunk is written (as `NeuralMemory.scan` does when a call completes a chunk)."""
        mem = self.mem
        q, k, v, tail = mem.project(x, self.tail)
        if tail is not None:
            self.tail.copy_(tail)
        if torch.is_autocast_enabled(q.device.type):
            # as the eager op reads (`neural_memory`): in the state's dtype, not autocast's, so y and the
            # output norm's eps are the eager step's
            with torch.autocast(q.device.type, enabled=False):
                y = mem.read(q.to(self.weights[0].dtype), tuple(self.weights))
        else:
            y = mem.read(q, tuple(self.weights))
        if mem.write:
            slot = (pos.view(1) + self.offset) % mem.chunk_size + self.hist
            self.pk.index_copy_(2, slot, k.to(self.pk.dtype))
            self.pv.index_copy_(2, slot, v.to(self.pv.dtype))
            self.pg.index_copy_(2, slot, mem.gates(x).to(self.pg.dtype))
        if write:
            held = MemoryState(tuple(self.weights), tuple(self.momentum), self.pk, self.pv, self.pg, None, 0)
            _, weights, momentum, _ = mem._run_op(
                self.pk, self.pk, self.pv, self.pg, held, mem.chunk_size, None, history=self.hist
            )
            for buf, new in zip(self.weights + self.momentum, weights + momentum):
                buf.copy_(new)
            if self.hist:  # a windowed rule's history: the chunk's last rows
                c = mem.chunk_size
                for buf in (self.pk, self.pv, self.pg):
                    buf[:, :, : self.hist] = buf[:, :, c : c + self.hist].clone()
        return mem.combine_heads(y, x)

    def export(self, model_position: int) -> MemoryState:
        position = model_position + self.offset
        # a frozen memory's pending rows never change
        keep = self.hist + position % self.mem.chunk_size if self.mem.write else self.rows0
        return MemoryState(
            tuple(w.clone() for w in self.weights),
            tuple(s.clone() for s in self.momentum),
            self.pk[:, :, :keep].clone(),
            self.pv[:, :, :keep].clone(),
            self.pg[:, :, :keep].clone(),
            None if self.tail is None else self.tail.clone(),
            position,
        )


@dataclass
class _Layer:
    """One block's static state: its kind and parts (the ones it has)."""

    block: Block
    attn: _WindowAttention | _SegmentAttention | None = None
    memory: _Memory | None = None
    segment_weights: list[Tensor] | None = None

    def parts(self) -> list[_Static]:
        return [p for p in (self.attn, self.memory) if p is not None]


# the blocks with a static step below, exactly these types: a subclass (a variant registered elsewhere)
# may change what its forward computes, which these steps would silently leave out
_STATIC_BLOCKS = (MACBlock, MAGBlock, MALBlock, MemoryBlock, AttentionBlock)


def _make_layer(block: Block, state, batch: int, position: int, like: Tensor) -> _Layer:
    if type(block) not in _STATIC_BLOCKS:
        raise TypeError(f"StaticDecoder: no static step for block {type(block).__name__}")
    if isinstance(block, MACBlock):
        if state is None:
            mem_state = block.memory.initial_state(batch, like.device, like.dtype)
            state = MACState(mem_state, mem_state.weights, None)
        layer = _Layer(block, _SegmentAttention(block.attn, state.attention, batch, like))
        layer.memory = _Memory(block.memory, state.memory, position)
        layer.segment_weights = [w.contiguous().clone() for w in state.segment_weights]
        return layer
    if isinstance(block, (MAGBlock, MALBlock)):
        if state is None or state.memory is None:
            raise ValueError("StaticDecoder: start from the state after at least one token (prefill first)")
        layer = _Layer(block, _WindowAttention(block.attn, state.attention, batch, like))
        layer.memory = _Memory(block.memory, state.memory, position)
        return layer
    if isinstance(block, MemoryBlock):
        if state is None:
            state = block.memory.initial_state(batch, like.device, like.dtype)
        return _Layer(block, memory=_Memory(block.memory, state, position))
    return _Layer(block, _WindowAttention(block.attn, state, batch, like))  # an attention block


def _block_step(layer: _Layer, x: Tensor, pos: Tensor, write: bool, new_segment: bool) -> Tensor:
    """`Block.forward` on one token (B, 1, dim) through the layer's static state."""
    block = layer.block
    if isinstance(block, MALBlock):
        x = x + layer.memory.step(block.norm_mem(x), pos, write)
    u = block.norm_mix(x)
    if isinstance(block, MACBlock):
        h = block.retrieve(u, tuple(layer.segment_weights))
        y = layer.attn.step(u, h, pos)
        w = u + y if block.memory_residual else y
        w = w if block.norm_memory_input is None else block.norm_memory_input(w)
        h = block.combine(y, layer.memory.step(w, pos, write))
        if new_segment:
            for buf, new in zip(layer.segment_weights, layer.memory.weights):
                buf.copy_(new)
    elif isinstance(block, MAGBlock):
        h = block.combine(layer.attn.step(u, pos), layer.memory.step(u, pos, write))
    elif isinstance(block, MemoryBlock):
        h = layer.memory.step(u, pos, write)
    else:  # MAL's attention, or an attention block
        h = layer.attn.step(u, pos)
    x = x + h
    return x + block.mlp(block.norm_mlp(x))


def _state_guards(entries) -> list[bool]:
    """torch.compile's `guard_filter_fn` for guards="state": of the ~1100 guards a tiny MAC's step has, keep
    the ~110 above (`_GLOBAL_GUARDS`, and those on the decoder's own objects); drop those on the model's
    modules (their attributes, hooks, identities: ~900) and on module globals (functions, imported modules).
    The dropped ones only change when the model's code or modules do, which a decoder does not allow for
    (`StaticDecoder`'s guards)."""
    keep = []
    for e in entries:
        src = e.orig_guard.source
        module = src is not None and (src.is_unspecialized_nn_module() or src.is_specialized_nn_module())
        keep.append(e.guard_type in _GLOBAL_GUARDS or not (e.is_global or module))
    return keep


_PLAIN = (bool, int, float, str, type(None))


def _model_key(model: nn.Module) -> int:
    """What guards="state" stops checking at each step, checked instead when a decoder is built or loaded
    (a millisecond or two for a small model): every module's type, training flag, parameters (by
    identity: a re-tied or replaced weight), hooks, and plain attribute values (a memory's
    `surprise_threshold` or `write`, set between generations); and torch's global module hooks."""
    parts: list = [
        len(nn.modules.module._global_forward_hooks),
        len(nn.modules.module._global_forward_pre_hooks),
    ]
    for m in model.modules():
        d = m.__dict__
        plain = [
            (k, v)  # public settings (private ones are caches, such as a rotary's tables)
            for k, v in d.items()
            if k[0] != "_"
            and (isinstance(v, _PLAIN) or (type(v) is tuple and all(isinstance(x, _PLAIN) for x in v)))
        ]
        hooks = len(m._forward_hooks) + len(m._forward_pre_hooks)
        parts += (type(m), *plain, hooks, *map(id, d["_parameters"].values()))
    return hash(tuple(parts))


# ------------------------------------------------------------------------------------------ decoder
class StaticDecoder:
    """Single-token decoding of `model` from `state` through fixed buffers (this module's docstring).

    state: the model's state after at least one token (e.g. from `prefill`); batch size B is fixed.
    mode: "eager", "compile" (`torch.compile(dynamic=False)`, CPU or CUDA) or "cuda_graph" (CUDA).
    compile_backend: `torch.compile`'s backend ("inductor" generates fused code; "aot_eager" traces the
        same graph without code generation, for a quick check of the tracing).
    mm: "pointwise" (default): inductor writes the one-token matmuls (batch 1) into its generated code as a
        multiply and a sum instead of calling BLAS for each; "blas": BLAS calls.
    guards: "full" (default): torch.compile checks all of its guards before each step; "state": only those
        on tensors, torch's global state and the decoder's own objects (about a tenth of them), the model's
        modules fingerprinted (`_model_key`) when the decoder is built or loaded instead, and a step that
        does not trace to one graph compiled with every guard. Changes to the model between two steps are
        not seen.
    `step(tokens (B, 1))` returns the next-token logits (B, vocab) and advances the state; `state()`
    returns it as a `TitansState` (copies), equal to what the eager steps would have returned.
    """

    def __init__(
        self,
        model: nn.Module,
        state: TitansState,
        mode: str = "compile",
        *,
        compile_backend: str = "inductor",
        compile_options: dict | None = None,
        guards: str = "full",
        mm: str = "pointwise",
    ):
        if mode not in MODES:
            raise ValueError(f"StaticDecoder: mode must be one of {MODES}, got {mode!r}")
        if guards not in GUARDS:
            raise ValueError(f"StaticDecoder: guards must be one of {GUARDS}, got {guards!r}")
        if mm not in MMS:
            raise ValueError(f"StaticDecoder: mm must be one of {MMS}, got {mm!r}")
        if not isinstance(state, TitansState) or state.position < 1:
            raise ValueError(
                "StaticDecoder: give the state after at least one token (prefill the prompt first)"
            )
        like = next(model.parameters())
        if mode == "cuda_graph" and like.device.type != "cuda":
            raise ValueError(
                f"StaticDecoder: mode 'cuda_graph' needs a CUDA model, this one is on {like.device}"
            )
        check_static_decoding(model, "StaticDecoder")
        model.check_state(state)
        self.model, self.mode, self.compile_backend = model, mode, compile_backend
        self.compile_options, self.guards, self.mm = compile_options, guards, mm
        self.batch = _state_batch(state)
        self.layers = [
            _make_layer(b, s, self.batch, state.position, like) for b, s in zip(model.blocks, state.layers)
        ]
        self.position = state.position
        self.version = 0  # moves on with every step and load: a holder of an older version holds no state
        self._model_key = _model_key(model) if guards == "state" and mode == "compile" else None
        self.pos = torch.tensor(state.position, dtype=torch.int64, device=like.device)
        self._steps: dict[tuple[bool, bool], Callable[[Tensor], Tensor]] = {}
        self._graphs: dict[tuple[bool, bool], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._token = torch.zeros(self.batch, 1, dtype=torch.int64, device=like.device)
        self._memories = [layer.memory for layer in self.layers if layer.memory is not None]
        if len({m.offset for m in self._memories}) > 1:  # one chunk phase for the whole step
            raise ValueError("StaticDecoder: the state's memories are at different positions")
        self._segment = model.config.segment_len if any(layer.segment_weights for layer in self.layers) else 0

    def load(self, state: TitansState) -> None:
        """Continue from another state of the same model and batch size, written into the same buffers
        (so the compiled steps and captured graphs stay valid)."""
        if not isinstance(state, TitansState) or state.position < 1:
            raise ValueError(
                "StaticDecoder: give the state after at least one token (prefill the prompt first)"
            )
        other = StaticDecoder(self.model, state, mode="eager")
        if other.batch != self.batch:
            raise ValueError(
                f"StaticDecoder.load: the state has batch {other.batch}, this decoder {self.batch}"
            )
        offsets = [m.offset for m in self._memories], [m.offset for m in other._memories]
        if offsets[0] != offsets[1]:  # the offsets are constants of the steps
            raise ValueError("StaticDecoder.load: the state's memory positions are offset differently")
        for layer, new in zip(self.layers, other.layers):
            for buf, src in zip(_layer_buffers(layer), _layer_buffers(new)):
                if buf.dtype != src.dtype:  # copy_ would round a float32 state into bf16 buffers
                    raise ValueError(
                        f"StaticDecoder.load: the state holds {src.dtype} where this decoder holds "
                        f"{buf.dtype} (streamed under another autocast): build a decoder for it"
                    )
        for layer, new in zip(self.layers, other.layers):
            for buf, src in zip(_layer_buffers(layer), _layer_buffers(new)):
                buf.copy_(src)
            if layer.memory is not None:
                layer.memory.rows0 = new.memory.rows0
        self.position = state.position
        self.version += 1
        self.pos.fill_(state.position)
        if self._model_key is not None and _model_key(self.model) != self._model_key:
            self._model_key, self._steps = _model_key(self.model), {}  # the model changed: compile anew

    def _phase(self) -> tuple[bool, bool]:
        """(the token completes a memory chunk, it completes a MAC segment), at the current position."""
        write = any(m.completes(self.position) for m in self._memories)
        seg = bool(self._segment) and self.position % self._segment == self._segment - 1
        return write, seg

    def _forward(self, tokens: Tensor, write: bool, new_segment: bool) -> Tensor:
        """The step's math: tokens (B, 1) -> logits (B, vocab); buffers and position updated in place."""
        model = self.model
        x = model.embed(tokens)
        for layer in self.layers:
            x = _block_step(layer, x, self.pos, write, new_segment)
        self.pos.add_(1)
        return model.head(model.norm(x))[:, -1]

    def _step_fn(self, phase: tuple[bool, bool], guards: str | None = None) -> Callable[[Tensor], Tensor]:
        fn = self._steps.get(phase)
        if fn is None:
            guards = guards or self.guards

            def fn(tokens: Tensor, _phase=phase) -> Tensor:
                return self._forward(tokens, *_phase)

            if self.mode == "compile":
                # torch.compile keeps its cache, and its limit of 8 entries, per code object: each phase of
                # each model gets a code of its own (shared by the model's decoders), so phases, models and
                # thread counts never crowd a model's steps out into eager fallbacks; with guards="state",
                # one per setting of the model's modules too (`_model_key`: its steps no longer check them)
                key = (phase, self.compile_backend, repr(self.compile_options), guards, self.mm)
                key += (self._model_key if guards == "state" else None,)
                codes = _pool(self.model).codes
                code = codes.setdefault(key, fn.__code__.replace(co_name=f"decode_step_{len(codes)}"))
                fn = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
                options = dict(self.compile_options or {})
                if self.mm == "pointwise" and self.compile_backend == "inductor":
                    # one-token matmuls (m = 1) as a multiply and a sum, fused into the generated code
                    fusion = dict(options.get("post_grad_fusion_options") or {})
                    options["post_grad_fusion_options"] = {**fusion, "decompose_mm_pass": {}}
                if guards == "state":
                    options["guard_filter_fn"] = _state_guards
                fn = torch.compile(
                    fn,
                    dynamic=False,
                    backend=self.compile_backend,
                    options=options or None,
                    # guards="state": one graph or none. After a graph break torch.compile would compile the
                    # function it broke in as a frame of its own, shared by every decoder and model, and
                    # with its guards filtered too it would run one model's constants for another's
                    fullgraph=guards == "state",
                )
            self._steps[phase] = fn
        return fn

    @torch.no_grad()
    def step(self, tokens: Tensor, *, check_ids: bool = True) -> Tensor:
        """tokens (B, 1) of integer ids -> logits of the next token (B, vocab); the state moves one token on.

        In "eager" and "compile" mode, ids outside [0, vocab) are refused (ValueError, one host sync per
        step, as `TitansLM.forward` checks) unless `check_ids` is False: the caller vouches for them (ids
        drawn from the model's own logits, as `generate` does). "cuda_graph" mode never checks them (a host
        sync per step would undo what the graphs save): its caller passes ids in [0, vocab), an id outside
        reads outside the embedding (garbage logits, or a device-side assert that ends the process's CUDA
        use).
        """
        if not isinstance(tokens, Tensor) or tokens.shape != (self.batch, 1):
            shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"StaticDecoder.step: tokens must be ({self.batch}, 1), got {shape}")
        check_token_dtype(tokens, "StaticDecoder.step")  # .long() would truncate a float id
        if check_ids and self.mode != "cuda_graph":
            check_token_ids(tokens, self.model.config.vocab_size, "StaticDecoder.step")
        phase = self._phase()
        if self.mode == "cuda_graph":
            logits = self._replay(phase, tokens)
        else:
            try:
                logits = self._step_fn(phase)(tokens.long())
            except torch._dynamo.exc.Unsupported:  # guards="state" and a graph break: traced, nothing run
                self._steps.pop(phase)
                logits = self._step_fn(phase, guards="full")(tokens.long())
        self.position += 1
        self.version += 1
        return logits

    def check_finite(self) -> None:
        """Refuse a state that holds a NaN or inf (ValueError, worded as `NeuralMemory`'s own check): the
        steps skip the eager layers' per-call check (a host sync per token), so a caller checks once at the
        end of a run of steps."""
        checked = [w for m in self._memories if m.mem.check_finite for w in m.weights]
        if not all(bool(torch.isfinite(w).all()) for w in checked):
            raise ValueError(
                "StaticDecoder: the memory's weights hold a non-finite value: it would turn every later "
                "output non-finite (inside a model, it usually means the parameters have diverged)"
            )

    def _replay(self, phase: tuple[bool, bool], tokens: Tensor) -> Tensor:
        """Run the phase's step as a captured CUDA graph (captured on first use)."""
        graph = self._graphs.get(phase)
        if graph is None:
            graph = self._capture(phase)
        self._token.copy_(tokens)
        graph[0].replay()
        return graph[1].clone()

    def _capture(self, phase: tuple[bool, bool]) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        # warm-up runs (lazy inits, kernel selection) on a side stream change the buffers: restore them
        buffers = [self.pos] + [t for layer in self.layers for t in _layer_buffers(layer)]
        saved = [t.clone() for t in buffers]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(self._token, *phase)
        torch.cuda.current_stream().wait_stream(stream)
        for t, s in zip(buffers, saved):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._forward(self._token, *phase)
        self._graphs[phase] = (graph, out)
        return graph, out

    def state(self) -> TitansState:
        """The state after every token stepped so far, as the eager steps build it (copies)."""
        layers = []
        p = self.position
        for layer in self.layers:
            block = layer.block
            if isinstance(block, MACBlock):
                memory = layer.memory.export(p)
                # unchanged since the segment began (a frozen memory, no write yet): the eager state holds
                # the memory's weights themselves, one tensor saved once
                seg = tuple(
                    w if torch.equal(s, w) else s.clone()
                    for s, w in zip(layer.segment_weights, memory.weights)
                )
                layers.append(MACState(memory, seg, layer.attn.export(p)))
            elif isinstance(block, MAGBlock):
                layers.append(MAGState(layer.attn.export(p), layer.memory.export(p)))
            elif isinstance(block, MALBlock):
                layers.append(MALState(layer.attn.export(p), layer.memory.export(p)))
            elif isinstance(block, MemoryBlock):
                layers.append(layer.memory.export(p))
            else:
                layers.append(layer.attn.export(p))
        return TitansState(layers, p, self.model.config_dict)


_pool_lock = threading.Lock()


class DecoderPool(dict):
    """Decoders kept on a model (a plain attribute, not in its state dict): free lists by key, and `codes`,
    the code object of each compiled phase. A copy or a pickle of the model gets an empty pool: a decoder
    holds its model's blocks and steps compiled for them (a deep-copied one would step the original), and
    its buffers are no part of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.codes: dict[tuple, types.CodeType] = {}

    def __deepcopy__(self, memo) -> DecoderPool:
        return DecoderPool()

    def __reduce__(self):
        return (DecoderPool, ())


@contextmanager
def checkout(
    model: nn.Module, state: TitansState, mode: str = "compile", guards: str = "full"
) -> Iterator[StaticDecoder]:
    """A `StaticDecoder` of `model` loaded with `state`, the caller's alone until the block ends.

    Decoders are kept on the model, a free list per (batch size, mode, device, dtype, guards, the state's
    dtypes: autocast's in a state streamed under autocast): a block takes one (or builds one when all are
    taken: concurrent callers, e.g. a server's worker threads, each get their own buffers) and gives it back
    at its end. The compiled steps are shared by every decoder of a model
    (torch.compile's cache is per code, its guards pass for any decoder of the same shapes), so a new
    decoder compiles nothing; a CUDA graph is captured per decoder. `guards`: `StaticDecoder`'s."""
    like = next(model.parameters())
    # and the state's dtypes: a decoder's buffers take them (autocast's, for a state streamed under autocast)
    key = (_state_batch(state), mode, like.device, like.dtype, guards, state_dtypes(state))
    with _pool_lock:
        free = _pool(model).setdefault(key, [])
        decoder = free.pop() if free else None
    if decoder is None:
        decoder = StaticDecoder(model, state, mode, guards=guards)
    else:
        decoder.load(state)
    try:
        yield decoder
    finally:
        with _pool_lock:
            free.append(decoder)


def _pool(model: nn.Module) -> DecoderPool:
    return model.__dict__.setdefault("_static_decoders", DecoderPool())  # a plain attribute


def check_static_decoding(model: nn.Module, who: str) -> None:
    """Refuse a model whose state no fixed buffers hold, before any work (``StaticDecoder`` would refuse
    it only once built, after the prompt was read): full attention, and a block without a static step."""
    other = next((b for b in model.blocks if type(b) not in _STATIC_BLOCKS), None)
    if other is not None:
        raise ValueError(
            f"{who}: variant {model.config.variant!r}'s block {type(other).__name__} has no static decoding "
            "step (the compiled decoder steps only the built-in blocks): decode it without compiling"
        )
    if model.config.spec.quadratic:
        raise ValueError(
            f"{who}: full causal attention (variant {model.config.variant!r}) has a KV cache that grows with "
            "the context; only windowed attention decodes with fixed buffers: decode it without compiling"
        )


def decode_cycle(model: nn.Module) -> int:
    """Tokens after which the phases repeat (the lcm of the memories' chunk sizes and, in MAC, the
    segment length): decoding this many consecutive tokens runs every step the decoder has."""
    sizes = [m.chunk_size for m in model.modules() if isinstance(m, NeuralMemory)]
    if model.config.spec.segmented:
        sizes.append(model.config.segment_len)
    return math.lcm(*sizes) if sizes else 1


def _layer_buffers(layer: _Layer) -> list[Tensor]:
    out = [t for part in layer.parts() for t in part.buffers()]
    return out + list(layer.segment_weights or [])


def state_dtypes(state: TitansState) -> tuple[str, ...]:
    """The dtypes of a state's tensors, sorted (a decoder's buffers take them)."""
    dtypes: set[str] = set()
    for layer in state.layers:
        map_tensors(layer, lambda t: dtypes.add(str(t.dtype)) or t)
    return tuple(sorted(dtypes))


def _state_batch(state: TitansState) -> int:
    sizes: set[int] = set()
    for layer in state.layers:
        map_tensors(layer, lambda t: sizes.add(t.shape[0]) or t)
    if len(sizes) != 1:
        raise ValueError(f"StaticDecoder: the state's tensors have batch sizes {sorted(sizes)}")
    return sizes.pop()


__all__ = [
    "MODES",
    "DecoderPool",
    "StaticDecoder",
    "check_static_decoding",
    "checkout",
    "decode_cycle",
    "state_dtypes",
]
