"""`NeuralMemory`: the Titans long-term memory as a sequence layer (docs/design.md, "The memory").

    y, state = mem(x, state)          x, y: (batch, seq, dim)

Per head, a small network M(.; W) (a matrix for depth 1, an MLP for depth >= 2) is trained while the
sequence is read: each chunk of `chunk_size` tokens is written with momentum and forgetting, and every
token reads the weights at the start of its chunk (read-before-write, so outputs are causal). The
returned `MemoryState` lets a later call continue the same sequences exactly where this one stopped.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titans.layers.norm import RMSNorm
from titans.layers.residual import residual_output
from titans.layers.state_tree import StateTree, register_state_type
from titans.ops.conv import causal_conv_silu
from titans.ops.memory import (
    ACTIVATIONS,
    MemoryRule,
    bound_weights,
    check_max_norm,
    check_threshold,
    dot_precision,
    fits_fast_path,
    memory_forward,
    neural_memory,
    resolve_rule,
    triton_reason,
    write_mask,
)
from titans.ops.norms import l2_normalize, rms_norm
from titans.validation import check_bool, check_int

log = logging.getLogger(__name__)
BACKENDS = ("auto", "triton", "torch")
_logged_choices: set[tuple[str, str]] = set()


@register_state_type
@dataclass
class MemoryState(StateTree):
    """Everything needed to continue the same sequences in a later call.

    weights, momentum: per memory layer (B, H, d_in, d_out), at the last chunk boundary.
    pending_k, pending_v: (B, H, r, d) keys/values of the r < chunk_size tokens read since that boundary
        but not yet written (they are written when their chunk completes).
    pending_gates: (B, H, r, 3 + e) their (theta, log_eta, log_keep) and the rule's e extra gates.
        With a windowed rule (window c > 1) the pending rows start with the last c - 1 written tokens
        (zero rows with a zero window gate at the sequence start), the window's reach into the past.
    conv_tail: (B, kernel - 1, 3 * H * d) the last pre-convolution projections (None without conv).
    position: tokens consumed so far.
    """

    weights: tuple[Tensor, ...]
    momentum: tuple[Tensor, ...]
    pending_k: Tensor
    pending_v: Tensor
    pending_gates: Tensor
    conv_tail: Tensor | None
    position: int


@dataclass
class MemoryStats:
    """Per-token monitoring values, each (B, H, T): surprise ||u_t|| and the gates, and `written` (bool):
    whether the token's gradient enters the memory (False below the surprise threshold, and everywhere in
    a frozen memory). A token of a trailing partial chunk is written when its chunk completes, at the
    weights its surprise was measured at."""

    surprise: Tensor
    theta: Tensor
    eta: Tensor
    alpha: Tensor
    written: Tensor | None = None

    @property
    def write_rate(self) -> float:
        """The fraction of (row, head, token) entries written: 1.0 where `written` is None (every entry
        written), NaN for a call with no tokens (as `LMOutput.write_rate`)."""
        if self.written is None or not self.written.numel():
            return 1.0 if self.written is None else float("nan")
        return int(self.written.sum()) / self.written.numel()


@dataclass
class MemoryOutput:
    """What `NeuralMemory.forward_with_stats` returns: output (B, T, dim), the new state, the call's stats."""

    output: Tensor
    state: MemoryState
    stats: MemoryStats

    @property
    def write_rate(self) -> float:
        """The fraction of this call's tokens (over rows and heads) the memory writes."""
        return self.stats.write_rate


def _stats(surprise: Tensor, gates: Tensor, written: Tensor) -> MemoryStats:
    """MemoryStats from the surprise (B, H, T), the gates (B, H, T, 3) of `NeuralMemory.gates` and the write
    decisions (B, H, T)."""
    return MemoryStats(
        surprise,
        theta=gates[..., 0],
        eta=gates[..., 1].exp(),
        alpha=-torch.expm1(gates[..., 2]),
        written=written,
    )


def _own_rows(t: Tensor, start: int, fresh: bool) -> Tensor:
    """t[:, :, start:] (the pending rows a state keeps) in a tensor of their own: a slice would keep the
    whole call's keys, values or gates alive in the state (and q, k, v share one tensor). `fresh`: t is a
    concatenation made for this call, so all of it (start 0) is kept as it is. A copy is differentiable:
    gradients reach the rows as through the slice."""
    if fresh and start == 0:
        return t
    return t[:, :, start:].clone(memory_format=torch.contiguous_format)


def _logit(p: float) -> float:
    return math.log(p) - math.log1p(-p)


class NeuralMemory(nn.Module):
    """The neural long-term memory (LMM) as a standalone sequence layer.

    Args:
        dim: model width of the input and output.
        heads: independent memories, each on its own `head_dim`-wide slice of q/k/v.
        head_dim: width of one head's keys and values (default dim // heads).
        depth: memory depth L_M: 1 = linear (matrix) memory, >= 2 = MLP.
        expansion: MLP hidden width = expansion * head_dim (depth >= 2).
        chunk_size: tokens per parallel chunk (1 = the exact per-token recurrence).
        activation: memory MLP nonlinearity, one of "silu", "gelu", "relu".
        conv_kernel: causal depthwise conv on q/k/v (0 turns it off).
        qk_norm: l2-normalise queries and keys.
        momentum: data-dependent surprise decay eta (False: eta = 0, no momentum).
        forgetting: data-dependent weight decay alpha (False: alpha = 0, no forgetting).
        forget_to: what forgetting pulls the weights toward: "zero" (the paper: W_t = (1 - alpha_t) W_{t-1}
            + S_t) or "init", the learned initial weights W_0 (W_t = (1 - alpha_t) W_{t-1} + alpha_t W_0 +
            S_t: W - W_0 follows the paper's recurrence). With "zero", a trained model that reads far past
            its training length forgets W_0 itself, which its outputs were trained on (docs/design.md,
            "Forgetting toward the initial weights"); with "init" an unwritten memory returns to W_0. The
            "titans" rule on the torch loop only.
        max_lr: theta_t = max_lr * sigmoid(.) bounds the inner learning rate. The defaults (0.03, theta
            starting at 0.01) keep outer training stable over long sequences: with theta ~0.1 and more,
            the inner dynamics turn chaotic and the outer gradient grows exponentially with the chunks.
        theta_init, eta_init, alpha_init: gate values at initialisation (via the gate biases).
        residual: memory computes k + MLP(k) instead of MLP(k) (a stabiliser for deep memories).
        surprise_clip: if set, each token's inner gradient is rescaled to at most this norm. On by default:
            it bounds every token's write, which keeps deep memories finite over very long streams
            (without it, gradients that grow with W feed back into W and diverge). None turns it off.
        surprise_threshold: surprise-gated writes: a token whose surprise ||u_t|| (its inner gradient's
            norm at its chunk-start weights, before clipping: the `surprise` the stats report) is below
            this adds no gradient to the momentum S; momentum decay and forgetting still apply. None
            (default) or 0 writes every token. `MemoryStats.written` reports the decisions.
        max_norm: a bound on the memory's weights, so that they stay in range on any length: at every chunk
            boundary, after the chunk's momentum and forgetting update, each memory-MLP layer's W_l (per
            batch row and head, the Frobenius norm of its (d_in, d_out) matrix) is multiplied by
            min(1, max_norm / ||W_l||), so ||W_l|| <= max_norm in every state and every chunk reads (and
            takes its surprise at) bounded weights; the initial state's W_0 (the learned init) is bounded
            the same way. This is the projection of W onto the ball ||W_l|| <= max_norm; as in projected
            gradient descent with momentum, the momentum S (the velocity) is not rescaled. A state passed
            in (e.g. from a memory without the bound) is used as it is until its next complete chunk.
            The rescale is per chunk, where the state is defined, so any split of a sequence into calls
            gives the outputs of one pass; the tokens of a trailing partial chunk are bounded with their
            chunk when a later call completes it. Gradients flow through the rescale. None (default): no
            bound. The "titans" rule only, on the torch loop (the Triton kernels do not cover it).
        output_gate: normalise the read and gate it with a linear function of x (paper §4.4).
        learned_init: W_0 is a learned parameter (False: fixed at its random init).
        write: False freezes the memory (an ablation twin with the same parameters): every token reads the
            state's weights, and nothing is written: weights and momentum come back bit-identical after any
            input (no learning, no forgetting, no momentum step). Its stats report theta 0, eta 1, alpha 0.
        impl: "chunked" (fast path) or "reference" (the per-token float64-grade loop, for tests).
        checkpoint_every: opt-in activation checkpointing of the chunked path in groups of this many chunks
            (training on very long sequences: O(T / checkpoint_every) saved states instead of O(T), for
            about one extra forward pass). None (default) keeps every chunk's state.
        rule: the update rule (`titans.ops.memory.MemoryRule`): a preset name of `RULE_PRESETS` ("titans",
            the default), a parts dict or a `MemoryRule`
            (`titans.ops.memory.memory_rule_chunked` says which run on the fast path; checkpoint_every applies
            to those). A rule's state `weights` are the pre-retention A (the memory reads W = g(A)).
        backend: the chunked path's chunk loop: "torch" (`ops/memory/chunk.py`), "triton" (the Triton
            kernels of `ops/memory/triton_chunk.py`: CUDA tensors, or CPU ones under TRITON_INTERPRET=1; an
            error where they do not cover the config) or "auto" (the kernels on CUDA where triton is installed
            and they cover the config, else torch; the choice is logged once).
    """

    def __init__(
        self,
        dim: int,
        heads: int = 4,
        head_dim: int | None = None,
        depth: int = 2,
        expansion: float = 4.0,
        chunk_size: int = 64,
        activation: str = "silu",
        conv_kernel: int = 4,
        qk_norm: bool = True,
        momentum: bool = True,
        forgetting: bool = True,
        forget_to: str = "zero",
        max_lr: float = 0.03,
        theta_init: float = 0.01,
        eta_init: float = 0.9,
        alpha_init: float = 0.01,
        residual: bool = False,
        surprise_clip: float | None = 1.0,
        output_gate: bool = True,
        learned_init: bool = True,
        write: bool = True,
        impl: str = "chunked",
        checkpoint_every: int | None = None,
        rule: str | dict | MemoryRule = "titans",
        backend: str = "auto",
        surprise_threshold: float | None = None,
        max_norm: float | None = None,
    ) -> None:
        super().__init__()
        for name, val in (("dim", dim), ("heads", heads), ("depth", depth), ("chunk_size", chunk_size)):
            check_int(f"NeuralMemory: {name}", val)
        if head_dim is None:
            if dim % heads:  # flooring would leave part of dim out of every head, without a word
                raise ValueError(f"NeuralMemory: heads={heads} does not divide dim={dim}; give head_dim")
            head_dim = dim // heads
        check_int("NeuralMemory: head_dim", head_dim)
        if activation not in ACTIVATIONS:
            raise ValueError(f"NeuralMemory: activation must be one of {ACTIVATIONS}, got {activation!r}")
        check_int("NeuralMemory: conv_kernel", conv_kernel, minimum=0)
        switches = dict(qk_norm=qk_norm, momentum=momentum, forgetting=forgetting, residual=residual)
        switches.update(output_gate=output_gate, learned_init=learned_init, write=write)
        for name, val in switches.items():
            check_bool(f"NeuralMemory: {name}", val)
        check_int("NeuralMemory: checkpoint_every", checkpoint_every, none_ok=True)
        check_threshold("NeuralMemory: surprise_threshold", surprise_threshold)
        max_norm = check_max_norm("NeuralMemory: max_norm", max_norm)  # as floats: numpy's too
        surprise_clip = check_max_norm("NeuralMemory: surprise_clip", surprise_clip)
        if isinstance(max_lr, bool) or not isinstance(max_lr, (int, float)) or not 0 < max_lr < math.inf:
            raise ValueError(f"NeuralMemory: max_lr must be a finite number > 0, got {max_lr!r}")
        if (
            isinstance(expansion, bool)
            or not isinstance(expansion, (int, float))
            or not 0 < expansion < math.inf
        ):
            raise ValueError(f"NeuralMemory: expansion must be a finite number > 0, got {expansion!r}")
        if forget_to not in ("zero", "init"):
            raise ValueError(f"NeuralMemory: forget_to must be 'zero' or 'init', got {forget_to!r}")
        if impl not in ("chunked", "reference"):
            raise ValueError(f"NeuralMemory: impl must be 'chunked' or 'reference', got {impl!r}")
        if backend not in BACKENDS:
            raise ValueError(f"NeuralMemory: backend must be one of {BACKENDS}, got {backend!r}")
        if not 0 < theta_init < max_lr:  # the gate is max_lr * sigmoid(.): its start inside (0, max_lr)
            raise ValueError(f"NeuralMemory: theta_init must lie in (0, max_lr={max_lr}), got {theta_init}")
        for name, val in (("eta_init", eta_init), ("alpha_init", alpha_init)):
            if not 0 < val < 1:
                raise ValueError(f"NeuralMemory: {name} must lie in (0, 1), got {val}")
        if depth > 1 and expansion * head_dim < 1:
            raise ValueError(f"NeuralMemory: expansion * head_dim must be >= 1, got {expansion * head_dim}")
        self.dim, self.heads, self.head_dim, self.depth = dim, heads, head_dim, depth
        self.chunk_size, self.activation, self.conv_kernel = chunk_size, activation, conv_kernel
        self.qk_norm, self.momentum, self.forgetting = qk_norm, momentum, forgetting
        self.max_lr, self.residual, self.surprise_clip, self.impl = max_lr, residual, surprise_clip, impl
        self.checkpoint_every = checkpoint_every
        self.write = write
        self.backend = backend
        self.surprise_threshold = surprise_threshold
        self.max_norm = max_norm
        self.forget_to = forget_to

        inner = heads * head_dim
        self.to_qkv = nn.Linear(dim, 3 * inner, bias=False)
        self.conv = nn.Conv1d(3 * inner, 3 * inner, conv_kernel, groups=3 * inner) if conv_kernel else None
        self.to_gates = nn.Linear(dim, 3 * heads)  # theta, eta, alpha logits per head
        with torch.no_grad():
            self.to_gates.weight.mul_(0.1)
            self.to_gates.bias.copy_(
                torch.tensor(
                    [_logit(theta_init / max_lr)] * heads
                    + [_logit(eta_init)] * heads
                    + [_logit(alpha_init)] * heads
                )
            )
        hidden = max(1, int(round(expansion * head_dim)))
        sizes = [head_dim] + [hidden] * (depth - 1) + [head_dim]
        init = [torch.randn(heads, sizes[i], sizes[i + 1]) / math.sqrt(sizes[i]) for i in range(depth)]
        self.init_weights = nn.ParameterList(nn.Parameter(w, requires_grad=learned_init) for w in init)
        self.norm = RMSNorm(head_dim) if output_gate else None
        self.to_gate = nn.Linear(dim, inner, bias=False) if output_gate else None
        self.to_out = residual_output(nn.Linear(inner, dim, bias=False))
        self.rule = resolve_rule(rule)
        if checkpoint_every is not None and not fits_fast_path(self.rule):  # the other rules cannot honour it
            raise ValueError(
                "NeuralMemory: checkpoint_every applies to the rules on the fast path (`titans.ops.memory."
                f"fits_fast_path`), not to the rule {self.rule.to_config()!r}: leave it unset"
            )
        self._check_titans_only_options()
        self._add_rule_gates()
        reason = self._triton_config_reason() if backend == "triton" else None
        if reason is not None:  # a choice of options, not of device: refused before any input
            raise ValueError(f"NeuralMemory(backend='triton'): {reason}; use backend='auto' or 'torch'")

    def _check_titans_only_options(self) -> None:
        """Refuse a weight bound or forgetting toward W_0 with a rule other than "titans" (its state is the
        pre-retention A, and its op has neither)."""
        options = (("max_norm", self.max_norm, None), ("forget_to", self.forget_to, "zero"))
        for name, value, default in options:
            if value != default and not self.rule.is_titans:
                raise ValueError(
                    f"NeuralMemory: {name}={value!r} is not covered by rule={self.rule.to_config()!r} "
                    "(only rule='titans')"
                )

    def _add_rule_gates(self) -> None:
        """The projection of the rule's extra per-token gates (Omega window weights, Huber deltas), if any;
        created last, so the other parameters' initialisation does not depend on the rule."""
        specs = self.rule.gate_specs
        self.to_rule_gates = nn.Linear(self.dim, len(specs) * self.heads) if specs else None
        if self.to_rule_gates is None:
            return
        init = [spec.init for spec in specs]
        with torch.no_grad():
            self.to_rule_gates.weight.mul_(0.1)
            self.to_rule_gates.bias.copy_(torch.tensor(init).repeat_interleave(self.heads))

    @property
    def _history(self) -> int:
        """Written tokens kept in the pending rows for the rule's window (c - 1; 0 on the Titans path)."""
        return 0 if self.rule.is_titans else self.rule.window.size - 1

    def _gate_channels(self) -> int:
        return 3 + len(self.rule.extra_gates)

    # ----------------------------------------------------------------------------------------- state
    def initial_state(self, batch_size: int, device=None, dtype=None) -> MemoryState:
        """The state every sequence starts from: W = W_0 (learned), S = 0, nothing pending."""
        device = device or self.to_qkv.weight.device
        dtype = dtype or self.to_qkv.weight.dtype
        weights = tuple(w.unsqueeze(0).expand(batch_size, *w.shape) for w in self._w0(device, dtype))
        momentum = tuple(torch.zeros_like(w) for w in weights)
        h, d = self.heads, self.head_dim
        tail = None
        if self.conv is not None:
            tail = torch.zeros(batch_size, self.conv_kernel - 1, 3 * h * d, device=device, dtype=dtype)
        # a windowed rule's history rows start as zeros whose window gate is 0: they add nothing
        r, channels = self._history, self._gate_channels()
        return MemoryState(
            weights=weights,
            momentum=momentum,
            pending_k=torch.zeros(batch_size, h, r, d, device=device, dtype=dtype),
            pending_v=torch.zeros(batch_size, h, r, d, device=device, dtype=dtype),
            pending_gates=torch.zeros(
                batch_size, h, r, channels, device=device, dtype=torch.promote_types(dtype, torch.float32)
            ),
            conv_tail=tail,
            position=0,
        )

    def check_state(self, state: MemoryState, batch_size: int) -> None:
        """Refuse a state that belongs to another configuration or batch, naming what differs."""
        if not isinstance(state, MemoryState):
            raise TypeError(f"NeuralMemory: state must be a MemoryState, got {type(state).__name__}")
        like = self.init_weights[0]
        held = state.weights[0] if state.weights else None
        # under autocast the parameters stay float32 and so does the state: a dtype the model runs in
        if held is not None and (held.device != like.device or held.dtype != like.dtype):
            raise TypeError(
                f"NeuralMemory: state weights are {held.dtype} on {held.device}, this memory's {like.dtype} "
                f"on {like.device}: stream with the same dtype and device (cast the state with the model)"
            )
        expected = [(batch_size, *w.shape) for w in self.init_weights]
        got = [tuple(w.shape) for w in state.weights]
        if got != expected:
            raise ValueError(
                f"NeuralMemory: state does not match this memory: its weight shapes are {got}, this memory "
                f"(batch {batch_size}, heads={self.heads}, head_dim={self.head_dim}, depth={self.depth}) "
                f"needs {expected}"
            )
        if not self._history <= state.pending_k.shape[2] < self.chunk_size + self._history:
            raise ValueError(
                f"NeuralMemory: state holds {state.pending_k.shape[2]} pending tokens, but this memory's "
                f"chunk_size is {self.chunk_size} (rule window history {self._history}): the state comes "
                "from a different chunk size or rule"
            )
        if state.pending_gates.shape[-1] != self._gate_channels():
            raise ValueError(
                f"NeuralMemory: state's pending gates have {state.pending_gates.shape[-1]} channels, this "
                f"memory's rule needs {self._gate_channels()}: the state comes from a different rule"
            )
        if (state.conv_tail is None) != (self.conv is None) or (
            state.conv_tail is not None and state.conv_tail.shape[1] != self.conv_kernel - 1
        ):
            raise ValueError("NeuralMemory: state's conv tail does not match this memory's conv_kernel")

    # ---------------------------------------------------------------------------------------- pieces
    def _check_input(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"NeuralMemory: input must be a tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"NeuralMemory: input must be (batch, seq, dim), got shape {tuple(x.shape)}")
        if not x.shape[0]:
            raise ValueError(
                f"NeuralMemory: input must hold at least one sequence, got shape {tuple(x.shape)}"
            )
        if x.shape[-1] != self.dim:
            raise ValueError(f"NeuralMemory: input's last dim is {x.shape[-1]}, expected dim={self.dim}")
        if not x.is_floating_point():
            raise TypeError(f"NeuralMemory: input must be floating point, got dtype {x.dtype}")
        dtype = self.to_qkv.weight.dtype
        # under autocast the projections cast their inputs themselves (and the memory runs in its state's
        # dtype): any floating input is fine there
        if x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"NeuralMemory: input dtype {x.dtype} does not match the memory's parameters ({dtype}): "
                f"cast the input (x.to({dtype})) or the memory (memory.to({x.dtype})), or run it under "
                "torch.autocast"
            )

    # Refuse non-finite inputs (one reduction and host sync per call). The trainer turns this off: a
    # diverged model shows in its loss, which it checks on every rank together, so no rank raises alone.
    check_finite: bool = True

    def _check_finite(self, x: Tensor, position: int) -> None:
        """Refuse a NaN or inf in x (B, T, dim): one would make the memory's weights, and so every later
        output, non-finite. One reduction and host sync per call; skipped while a CUDA graph is captured
        (no sync can run there)."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        if not torch.isfinite(x).all():
            b, t, c = (~torch.isfinite(x)).nonzero()[0].tolist()
            raise ValueError(
                f"NeuralMemory: input holds a non-finite value ({x[b, t, c].item()}) at batch {b}, position "
                f"{position + t} (channel {c}): it would turn the memory's weights and every later output "
                "non-finite (inside a model, it usually means the parameters have diverged)"
            )

    def project(self, x: Tensor, conv_tail: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """x (B, T, dim) -> q, k, v (B, H, T, d) and the new conv tail. conv_tail: (B, kernel - 1, 3 H d), the
        rows before x; None: zeros (the start of a sequence), as `initial_state` holds them."""
        qkv = self.to_qkv(x)
        b, t, _ = x.shape
        new_tail = None
        # q, k, v come out of one contiguous (3, B, H, T, d) tensor, so the memory op needs no copies of
        # its own and nothing pins the (B, T, 3 H d) activation; the conv writes that layout directly
        if self.conv is not None:
            keep = self.conv_kernel - 1
            tail = qkv.new_zeros(b, keep, qkv.shape[-1]) if conv_tail is None else conv_tail.to(qkv.dtype)
            # copies: a view would keep the whole input alive inside the returned state
            new_tail = qkv[:, t - keep :].clone() if t >= keep else torch.cat([tail[:, t:], qkv], dim=1)
            qkv = causal_conv_silu(qkv, self.conv.weight, self.conv.bias, tail, split=(3, self.heads))
            q, k, v = qkv
        else:
            q, k, v = F.silu(qkv).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).contiguous()
        if self.qk_norm:
            q, k = l2_normalize(q), l2_normalize(k)
        return q, k, v, new_tail

    def gates(self, x: Tensor) -> Tensor:
        """x (B, T, dim) -> (B, H, T, 3 + e): theta, log(eta), log(1 - alpha) per token and head, then the
        rule's e extra gates (`MemoryRule.extra_gates`: Omega window weight in (0, 1), Huber delta > 0)."""
        gates = self._core_gates(x)
        if self.to_rule_gates is None:
            return gates
        logits = self.to_rule_gates(x).to(gates.dtype).view(*x.shape[:2], -1, self.heads).permute(0, 3, 1, 2)
        extra = [spec.activation(logits[..., i]) for i, spec in enumerate(self.rule.gate_specs)]
        return torch.cat([gates, torch.stack(extra, -1)], -1)

    def _core_gates(self, x: Tensor) -> Tensor:
        """x (B, T, dim) -> (B, H, T, 3): theta, log(eta), log(1 - alpha) per token and head."""
        # gates in at least float32 (log-space products lose too much in bf16), in x's dtype where wider
        dtype = torch.promote_types(torch.promote_types(x.dtype, self.to_gates.weight.dtype), torch.float32)
        if not self.write:  # frozen (the state is never written): theta 0, eta 1, alpha 0
            return x.new_zeros(x.shape[0], self.heads, x.shape[1], 3, dtype=dtype)
        logits = self.to_gates(x).to(dtype).view(*x.shape[:2], 3, self.heads).permute(0, 3, 1, 2)
        # unbind(), not indexing: its backward is one stack, not a zero-filled (B, H, T, 3) tensor per gate
        theta_logit, eta_logit, alpha_logit = logits.unbind(-1)
        theta = self.max_lr * torch.sigmoid(theta_logit)
        if self.momentum and self.rule.uses_momentum:
            log_eta = F.logsigmoid(eta_logit)
        else:
            log_eta = torch.full_like(theta, float("-inf"))
        if self.forgetting:
            log_keep = F.logsigmoid(-alpha_logit)
        else:
            log_keep = torch.zeros_like(theta)
        return torch.stack([theta, log_eta, log_keep], dim=-1)

    def read(self, q: Tensor, weights: tuple[Tensor, ...]) -> Tensor:
        """M(q; W) with no update: q (B, H, n, d) -> (B, H, n, d). `weights` as in the state (for a rule
        with a retention map, the pre-retention A: the read is through W = g(A))."""
        if not self.rule.is_titans:
            weights = tuple(self.rule.retention.read(a) for a in weights)
        return memory_forward(q, weights, self.activation, self.residual)

    def combine_heads(self, y: Tensor, x: Tensor) -> Tensor:
        """Per-head read (B, H, T, d) -> output (B, T, dim): norm, gate by x, project."""
        return self.gated_output(y, self.output_gate(x))

    def output_gate(self, x: Tensor) -> Tensor | None:
        """x (B, T, dim) -> the gate of the output, (B, T, H * d) (None without `output_gate`)."""
        return None if self.to_gate is None else torch.sigmoid(self.to_gate(x))

    def gated_output(self, y: Tensor, gate: Tensor | None) -> Tensor:
        """`combine_heads` with the gate of `output_gate` computed already: (B, H, T, d) -> (B, T, dim)."""
        b, h, t, d = y.shape
        if self.norm is not None:
            y = rms_norm(y, self.norm.weight, self.norm.eps)
        y = y.transpose(1, 2).reshape(b, t, h * d)
        if gate is not None:
            y = y * gate
        return self.to_out(y)

    # --------------------------------------------------------------------------------------- forward
    def forward(self, x: Tensor, state: MemoryState | None = None) -> tuple[Tensor, MemoryState]:
        """Read and write the memory over x.

        x: (B, T, dim). Returns (y, state) with y: (B, T, dim). Passing the returned state to the next call
        continues the sequences exactly. For the per-token stats as well, use `forward_with_stats`.
        """
        out = self.forward_with_stats(x, state)
        return out.output, out.state

    def forward_with_stats(self, x: Tensor, state: MemoryState | None = None) -> MemoryOutput:
        """`forward`, with the per-token stats of the call: x (B, T, dim) -> MemoryOutput(output (B, T,
        dim), state, stats)."""
        out = self.forward_heads(x, state)
        return replace(out, output=self.combine_heads(out.output, x))

    def forward_heads(self, x: Tensor, state: MemoryState | None = None) -> MemoryOutput:
        """`forward_with_stats` up to the per-head reads: x (B, T, dim) -> MemoryOutput(output (B, H, T, d),
        state, stats); `combine_heads(output, x)` makes the layer's output of them."""
        self._check_input(x)
        batch, t = x.shape[:2]
        if state is None:  # in the parameters' dtype (a bf16 input under autocast must not make a bf16 state)
            state = self.initial_state(batch, x.device)
        else:
            self.check_state(state, batch)
        if t == 0:  # nothing to read or write: an empty output, the state as it was
            out = x.new_zeros(batch, self.heads, 0, self.head_dim)
            empty = x.new_zeros(batch, self.heads, 0, dtype=state.pending_gates.dtype)
            written = empty.bool()
            return MemoryOutput(out, state, MemoryStats(empty, empty, empty, empty, written))
        if self.check_finite:
            self._check_finite(x, state.position)
        q, k, v, conv_tail = self.project(x, state.conv_tail)
        gates = self.gates(x)
        y, new_state, stats = self.scan(q, k, v, gates, state)
        return MemoryOutput(y, replace(new_state, conv_tail=conv_tail), stats)

    def scan(
        self, q: Tensor, k: Tensor, v: Tensor, gates: Tensor, state: MemoryState
    ) -> tuple[Tensor, MemoryState, MemoryStats]:
        """Run the memory over projected q, k, v (B, H, T, d) and gates (B, H, T, 3) from `state`.

        Tokens left pending by the previous call are prepended so chunks stay aligned to absolute
        positions; their reads were already returned then, so only the new tokens' reads are returned.
        """
        if not self.write:
            return self._scan_frozen(q, k, v, gates, state)
        r = state.pending_k.shape[2]
        h = self._history  # the first h pending rows: written tokens, context for the rule's window
        t = q.shape[2]
        if r:
            k_all = torch.cat([state.pending_k.to(k.dtype), k], dim=2)
            v_all = torch.cat([state.pending_v.to(v.dtype), v], dim=2)
            g_all = torch.cat([state.pending_gates.to(gates.dtype), gates], dim=2)
            q_all = F.pad(q, (0, 0, r, 0))
        else:  # nothing pending (a fresh sequence, or a call that starts on a chunk boundary)
            k_all, v_all, g_all, q_all = k, v, gates, q
        y, weights, momentum, surprise = self._run_op(
            q_all, k_all, v_all, g_all, state, self.chunk_size, self.checkpoint_every, history=h
        )
        keep = (r - h + t) % self.chunk_size + h
        start, fresh = r + t - keep, r > 0  # fresh: k_all, v_all, g_all are this call's own concatenations
        new_state = MemoryState(
            weights=weights,
            momentum=momentum,
            pending_k=_own_rows(k_all, start, fresh),
            pending_v=_own_rows(v_all, start, fresh),
            pending_gates=_own_rows(g_all, start, fresh),
            conv_tail=state.conv_tail,
            position=state.position + t,
        )
        # y and surprise start at row h (the history rows are not read)
        surprise = surprise[:, :, r - h :]
        if self.surprise_threshold is None:
            written = torch.ones_like(surprise, dtype=torch.bool)
        else:  # the comparison the op makes, on the same values
            written = write_mask(surprise, self.surprise_threshold)
        stats = _stats(surprise, g_all[:, :, r:], written)
        return y[:, :, r - h :], new_state, stats

    def _run_op(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        gates: Tensor,
        state: MemoryState,
        chunk_size: int,
        checkpoint_every: int | None,
        history: int = 0,
    ) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...], Tensor]:
        """The memory op (`titans.ops.memory.neural_memory`, on the path `impl` and `backend` pick) over q, k,
        v (B, H, n, d) and gates (B, H, n, 3 + e) from the state's weights and momentum: y, weights,
        momentum, surprise (y and surprise for the rows after the first `history`, context-only rows of a
        windowed rule)."""
        if self.impl == "reference":
            backend = "reference"
        else:
            backend = "triton" if self._use_triton(q) else "torch"
        # refused at construction too; this catches a later assignment (with the same message as there)
        self._check_titans_only_options()
        return neural_memory(
            q,
            k,
            v,
            gates,
            state.weights,
            state.momentum,
            chunk_size=chunk_size,
            rule=self.rule,
            backend=backend,
            history=history,
            activation=self.activation,
            residual=self.residual,
            surprise_clip=self.surprise_clip,
            checkpoint_every=checkpoint_every,
            surprise_threshold=self.surprise_threshold,
            max_norm=self.max_norm,
            anchor=self._anchor(),
        )

    def _w0(self, device=None, dtype=None) -> tuple[Tensor, ...]:
        """The initial weights W_0 per layer (H, d_in, d_out), bounded where max_norm is set (W_0 is a state
        too, so the bound holds from the first chunk on)."""
        init = tuple(w.to(device, dtype) for w in self.init_weights)
        if self.max_norm is not None:
            init = tuple(bound_weights(w, self.max_norm) for w in init)
        return init

    def _anchor(self) -> tuple[Tensor, ...] | None:
        """What forgetting pulls the weights toward, per layer (H, d_in, d_out): W_0 with forget_to="init",
        else None (zero)."""
        if self.forget_to == "zero" or not self.write:
            return None
        return self._w0()

    def _triton_config_reason(self) -> str | None:
        """Why the Triton kernels cannot run this memory's options (None where they can): they run the
        default "titans" rule without a surprise threshold or a weight bound only, of depth 1 or 2 and
        width <= 256."""
        hidden = self.init_weights[0].shape[-1]
        reason = triton_reason(self.depth, self.head_dim, hidden, self.activation)
        if reason is not None:
            return reason
        if not self.rule.is_titans:
            return f"rule={self.rule.to_config()!r} is not covered by the kernels (only rule='titans')"
        if self.surprise_threshold is not None:
            return "surprise_threshold is not covered by the kernels"
        if self.max_norm is not None:
            return "max_norm is not covered by the kernels"
        if self.forget_to != "zero":
            return f"forget_to={self.forget_to!r} is not covered by the kernels"
        return None

    def _use_triton(self, q: Tensor) -> bool:
        """Whether the chunked path runs on the Triton kernels for q (B, H, n, d) (`backend`): "triton"
        raises where they cannot run, "auto" falls back to torch and logs its choice once."""
        if self.backend == "torch":
            return False
        hidden = self.init_weights[0].shape[-1]
        reason = triton_reason(self.depth, self.head_dim, hidden, self.activation, q.device)
        reason = self._triton_config_reason() or reason
        if self.backend == "triton":
            if reason is not None:
                raise ValueError(f"NeuralMemory(backend='triton'): the kernels cannot run here: {reason}")
            return True
        if reason is None and q.device.type != "cuda":
            reason = "not on CUDA (under the interpreter only backend='triton' runs the kernels)"
        choice = ("triton", "the kernels cover this config on CUDA") if reason is None else ("torch", reason)
        # logged from eager calls only: traced, the set's contents would become a guard of the compiled
        # code, and the first call's insertion would make the second call compile again
        if not torch.compiler.is_compiling() and choice not in _logged_choices:
            _logged_choices.add(choice)
            # on CUDA the choice is news (a fallback costs speed); off CUDA torch is the only path
            level = logging.INFO if q.device.type == "cuda" else logging.DEBUG
            note = ""
            if reason is None and dot_precision(q) == "ieee":  # exact float32: several times slower
                level = logging.WARNING
                note = "; float32 dots without tensor cores: set torch.backends.cuda.matmul.allow_tf32 = True"
            log.log(level, "NeuralMemory(backend='auto'): the %s chunk loop (%s%s)", *choice, note)
        return reason is None

    def _scan_frozen(
        self, q: Tensor, k: Tensor, v: Tensor, gates: Tensor, state: MemoryState
    ) -> tuple[Tensor, MemoryState, MemoryStats]:
        """`scan` of a read-only memory (write=False): every token reads the state's weights, and weights,
        momentum and pending tokens come back unchanged (the same tensors), whatever the input."""
        # one chunk longer than the call: all of it is read (with its surprise reported), none written
        y, _, _, surprise = self._run_op(q, k, v, gates, state, q.shape[2] + 1, None)
        new_state = replace(state, position=state.position + q.shape[2])
        stats = _stats(surprise, gates, torch.zeros_like(surprise, dtype=torch.bool))
        return y, new_state, stats

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, heads={self.heads}, head_dim={self.head_dim}, depth={self.depth}, "
            f"chunk_size={self.chunk_size}, momentum={self.momentum}, forgetting={self.forgetting}"
            + ("" if self.rule.is_titans else f", rule={self.rule.to_config()!r}")
            + ("" if self.max_norm is None else f", max_norm={self.max_norm}")
            + ("" if self.forget_to == "zero" else f", forget_to={self.forget_to!r}")
        )
