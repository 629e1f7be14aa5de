"""Memory rules: the neural memory's update as four composable parts (docs/design.md, "Memory rules").

MIRAS (Behrouz et al., arXiv 2504.13173) describes a recurrent memory by its architecture, its attentional
bias (the inner loss), its retention (how old content is kept) and its learning algorithm; ATLAS (arXiv
2505.23735) adds the window of the objective (the Omega rule) and Muon as the inner optimiser. A
`MemoryRule` is those choices as data, each part a class that carries its own maths (`Bias`, `Retention`,
`Optimizer`: a new part is one class, registered under its kind where it is defined; a preset is one line
of `RULE_PRESETS`):

    bias       L2Bias()                    ||M(k) - v||^2                     (Titans)
               LpBias(p)                   sum_i |M(k)_i - v_i|^p             (Moneta)
               HuberBias()                 per coordinate e^2 inside a learned per-token delta_t,
                                           2 delta_t |e| - delta_t^2 outside  (Yaad)
    retention  DecayRetention()            W = A, A_t = (1 - alpha_t) A_{t-1} + ...        (Titans)
               LqRetention(q)              W = A / ||A||_q^(q-2)                            (Moneta)
               KLRetention()               W = softmax(A) over each row: the memory lives on
                                           the simplex, A its logits                        (Memora)
    window     Window(1)                   token t's objective is its own loss             (Titans)
               Window(c)                   sum_{i=t-c+1..t} gamma_i loss_i, gamma_i a
                                           learned per-token gate in (0, 1)                (Omega rule)
    optimizer  MomentumSGD(momentum)       S_t = eta_t S_{t-1} - theta_t u_t, A_t = keep_t A_{t-1} + S_t
               Muon(steps)                 S_t = eta_t S_{t-1} - u_t, A_t = keep_t A_{t-1} + theta_t NS(S_t)

Everything is in the chunked form of `titans.ops.memory.chunk`: every token's gradient is taken at the weights
of its chunk's start. The bias changes only the per-token output error (dL/dM(k) = phi(M(k) - v)); the
retention only the map A -> W through which the memory is read and differentiated (the update is
linear in A, so the chunk's closed form is unchanged); the window only the write coefficients (a banded
combination of the per-token gradients, the window reaching c - 1 tokens back across the chunk boundary:
those tokens' gradients are re-taken at the current chunk's start weights, so every term of a token's
objective is evaluated at one point); Muon orthogonalises the chunk-end momentum once per chunk and
applies it with the chunk's summed (decayed) learning rates, NS(S_t) ~ NS(S_b) inside a chunk (exact at
chunk_size 1).

The "titans" rule, and every rule with Titans's retention, window and optimiser (any bias: "yaad"), runs
on the custom-autograd fast path of `titans.ops.memory.chunk`, the bias threaded in as its error map (forward
phi(e), backward phi'(e)); the others run on `memory_rule_chunked_autograd` here: the same chunked matmul
form, differentiated by torch autograd.

Retention gates MIRAS defines that do not fit the chunked form and are not offered: elastic net (its
soft-threshold of the accumulated state is not linear in the chunk's gradients, so the closed form over a
chunk does not hold), and the l_q retention's general f-divergence / Bregman variants beyond KL.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, is_dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from titans.ops.memory.chunk import neural_memory_chunked
from titans.ops.memory.common import (
    act_backward,
    check_threshold,
    chunk_coefficients,
    clip_scale,
    layers_forward,
    segsum,
    suffix_sum,
    write_mask,
)
from titans.validation import check_int

# ----------------------------------------------------------------------------------------------- parts


def _check_number(where: str, name: str, value, *, minimum: float, strict: bool = False) -> None:
    """Raise a ValueError naming `where` (the part) and `name` (its field) unless `value` is a finite int or
    float (not a bool) >= `minimum` (> `minimum` where `strict`)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (number and (value > minimum if strict else value >= minimum)):
        bound = f"{'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"{where}: {name} must be a number {bound} (finite, not a bool), got {value!r}")


@dataclass(frozen=True)
class GateSpec:
    """A per-token, per-head gate a rule part learns beyond theta, eta and alpha: the layer projects the
    input to one logit per head, `activation` maps it to the gate, and the projection's bias starts at
    `init` (the logit of the gate's initial value)."""

    name: str
    activation: Callable[[Tensor], Tensor]
    init: float


class RulePart:
    """A part of a `MemoryRule` that carries its own maths. Each slot (`Bias`, `Retention`, `Optimizer`)
    names the methods its parts define; a part registers its kind where it is defined,

        @dataclass(frozen=True)
        class MyBias(Bias, kind="mine"):
            ...

    and a class that does not define every method of its slot is refused there (TypeError), so no part
    runs another part's maths. A rule takes registered parts only (`MemoryRule`)."""

    slot: ClassVar[str] = ""
    kind: ClassVar[str] = ""
    methods: ClassVar[tuple[str, ...]] = ()
    together: ClassVar[tuple[str, ...]] = ()  # methods a part takes from one class (a map and its backward)
    registry: ClassVar[dict[str, type[RulePart]]] = {}
    # runs on the custom-autograd fast path of `chunk.py` (with the other parts' consent, `fits_fast_path`)
    fast_path: ClassVar[bool] = False

    def __init_subclass__(cls, kind: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if kind is None:
            if RulePart in cls.__bases__:  # a slot: its own registry
                cls.registry = {}
            return
        slot = next((base for base in cls.__mro__[1:] if RulePart in base.__bases__), None)
        if slot is None:
            raise TypeError(f"rule part {cls.__name__}: derive it from Bias, Retention or Optimizer")
        missing = [m for m in slot.methods if getattr(cls, m) is getattr(slot, m)]
        if missing:
            raise TypeError(
                f"{slot.slot} part {cls.__name__} (kind {kind!r}) does not define {', '.join(missing)}: "
                f"every {slot.slot} defines {', '.join(slot.methods)}"
            )
        # methods that are one piece of maths come from one class: a part derived from LpBias that wrote
        # error_map alone would run LpBias's gradient for it on the fast path
        owners = {m: next(b for b in cls.__mro__ if m in b.__dict__) for m in slot.together}
        if len(set(owners.values())) > 1:
            raise TypeError(
                f"{slot.slot} part {cls.__name__} (kind {kind!r}) takes "
                + ", ".join(f"{m} from {b.__name__}" for m, b in owners.items())
                + f": define {' and '.join(slot.together)} together"
            )
        # a property of the slot (Optimizer.uses_momentum) written as a method would be read as always true
        # (a field or a plain value is fine)
        for m in slot.methods:
            if isinstance(slot.__dict__.get(m), property) and callable(getattr(cls, m)):
                raise TypeError(
                    f"{slot.slot} part {cls.__name__} (kind {kind!r}): {m} must be a property (@property), "
                    "as the slot's is"
                )
        # the fast path computes its own maths and calls none of a part's methods but the bias's: a part
        # derived from one that runs there, with a method of its own (read, update, ...), runs there only
        # if it says so
        if "fast_path" not in cls.__dict__:
            consent = next(b for b in cls.__mro__ if "fast_path" in b.__dict__)
            if consent.fast_path and any(getattr(cls, m) is not getattr(consent, m) for m in slot.methods):
                cls.fast_path = False
        old = slot.registry.get(kind)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(
                f"{slot.slot} kind {kind!r} is taken by {slot.registry[kind].__name__}; {cls.__name__} needs "
                "another"
            )
        cls.kind = kind
        slot.registry[kind] = cls  # a class defined again (a notebook cell run twice) replaces itself

    def gates(self) -> tuple[GateSpec, ...]:
        """The part's learned per-token gate, if any (at most one). Only a bias's reaches its maths (as
        `aux`); `MemoryRule` refuses a retention or optimiser that declares one."""
        return ()


class Bias(RulePart):
    """The attentional bias: the inner loss L(M(k), v), seen through its error map dL/dM(k) = phi(e) of the
    output error e = M(k) - v. Its gate, if any, comes to every method as `aux` (..., n), one per token."""

    slot = "bias"
    methods = ("error_map", "grad")
    together = ("error_map", "grad")

    def error_map(self, e: Tensor, aux: Tensor | None) -> Tensor:
        """phi(e) for e (..., n, d), differentiable by autograd in e and aux (the autograd path)."""
        raise NotImplementedError

    def value(self, e: Tensor, aux: Tensor | None) -> Tensor:
        """phi(e) on the fast path (its backward is `grad`)."""
        return self.error_map(e, aux)

    def grad(self, g: Tensor, e: Tensor, aux: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """(dL/de, dL/daux) for dL/dphi = g: the error map's backward on the fast path."""
        raise NotImplementedError

    def fast_error(self) -> Bias | None:
        """What the fast path takes as its error map (`neural_memory_chunked(error=...)`): this part, or
        None for the path's own 2 e."""
        return self


class Retention(RulePart):
    """The retention: the map A -> W = g(A) through which the memory is read and differentiated (the state
    A is updated linearly, so the chunk's closed form holds)."""

    slot = "retention"
    methods = ("read",)

    def read(self, a: Tensor) -> Tensor:
        """W = g(A) for a (..., d_in, d_out)."""
        raise NotImplementedError


class Optimizer(RulePart):
    """The inner optimiser: how a chunk's combined gradients enter the momentum S and the state A.

    With gamma, beta the closed form's per-token coefficients (`chunk_coefficients`) times each token's
    clip and write factors, a chunk moves S_b = E_b S_0 - sum_t c_S,t u_t (c_S from
    `momentum_coefficients`) and A by `update`."""

    slot = "optimizer"
    methods = ("uses_momentum", "momentum_coefficients", "update")

    @property
    def uses_momentum(self) -> bool:
        """Whether the momentum decay eta is learned (False: eta = 0)."""
        raise NotImplementedError

    def momentum_coefficients(self, beta: Tensor, log_eta: Tensor) -> Tensor:
        """The per-token coefficients of S's write (N, n), given the closed form's beta = theta_t E_b / E_t
        and the chunk's log(eta) (N, n)."""
        raise NotImplementedError

    def update(
        self,
        a_state: Tensor,
        s_state: Tensor,
        s_new: Tensor,
        inputs: Tensor,
        deltas: Tensor,
        c_w: Tensor,
        theta: Tensor,
        log_keep: Tensor,
        decay: Tensor,
        carry: Tensor,
    ) -> Tensor:
        """A at the chunk's end, per layer: a_state, s_state (N, d_in, d_out) at its start, s_new at its end;
        the per-token gradients' factors inputs (N, m, d_in) and deltas (N, m, d_out) with their weights
        c_w (N, m) (sum_t c_w,t u_t = inputs^T (c_w deltas)); the chunk's theta, log(1 - alpha) (N, n) and
        the closed form's A_b (`decay`) and S_0 carry (`carry`) (N,)."""
        raise NotImplementedError


@dataclass(frozen=True)
class L2Bias(Bias, kind="l2"):
    """||M(k) - v||^2: the error map is phi(e) = 2 e (Titans)."""

    def error_map(self, e: Tensor, aux: Tensor | None) -> Tensor:
        return 2 * e

    def grad(self, g: Tensor, e: Tensor, aux: Tensor | None) -> tuple[Tensor, None]:
        return 2 * g, None

    def fast_error(self) -> Bias | None:
        # the fast path's own l2 error map; a subclass's own maths go through its methods
        return None if type(self) is L2Bias else self


@dataclass(frozen=True)
class LpBias(Bias, kind="lp"):
    """sum_i |e_i|^p, phi(e) = p sign(e) |e|^(p-1) (Moneta). For p < 2 the power's derivative is unbounded
    at e = 0, so there |e| is smoothed to sqrt(e^2 + eps^2): phi(e) = p e (e^2 + eps^2)^((p-2)/2)."""

    p: float = 3.0
    eps: float = 1e-3

    def __post_init__(self) -> None:
        _check_number("LpBias", "p", self.p, minimum=1)
        _check_number("LpBias", "eps", self.eps, minimum=0, strict=True)

    def error_map(self, e: Tensor, aux: Tensor | None) -> Tensor:
        if self.p == 2:
            return 2 * e
        return _LpError.apply(e, float(self.p), float(self.eps))

    def grad(self, g: Tensor, e: Tensor, aux: Tensor | None) -> tuple[Tensor, None]:
        """(g * phi'(e), None): the error map's backward (no per-token input)."""
        return g * _lp_derivative(e, float(self.p), float(self.eps)), None


@dataclass(frozen=True)
class HuberBias(Bias, kind="huber"):
    """Per coordinate e^2 for |e| <= delta_t, 2 delta_t |e| - delta_t^2 beyond (Yaad): phi(e) = 2
    clamp(e, -delta_t, delta_t). delta_t = softplus(x_t w + b) per token and head, learned; its bias starts
    at `delta_init`."""

    delta_init: float = 1.0

    def __post_init__(self) -> None:
        _check_number("HuberBias", "delta_init", self.delta_init, minimum=0, strict=True)

    def gates(self) -> tuple[GateSpec, ...]:
        # softplus^-1(delta_init); above 20 as x + log(1 - e^-x), since expm1 overflows past ~709
        x = self.delta_init
        init = math.log(math.expm1(x)) if x < 20 else x + math.log(-math.expm1(-x))
        return (GateSpec("delta", F.softplus, init),)

    def error_map(self, e: Tensor, aux: Tensor) -> Tensor:
        """phi(e) = 2 clamp(e, -delta, delta), delta = aux (..., n) per token."""
        d = aux.unsqueeze(-1)
        # differentiable in delta where clamped (the outer gradient reaches the delta projection)
        return 2 * torch.minimum(torch.maximum(e, -d), d)

    def grad(self, g: Tensor, e: Tensor, aux: Tensor) -> tuple[Tensor, Tensor]:
        """(dL/de, dL/ddelta) for dL/dphi = g: 2 g inside |e| <= delta (the boundary counts as inside),
        else 2 g sign(e) summed over the token's coordinates for delta."""
        inside = e.abs() <= aux.unsqueeze(-1)
        g2 = 2 * g
        return g2 * inside, torch.where(inside, 0.0, g2 * e.sign()).sum(-1)


@dataclass(frozen=True)
class DecayRetention(Retention, kind="decay"):
    """W = A, kept by the forgetting gate: A_t = (1 - alpha_t) A_{t-1} + ... (Titans)."""

    fast_path = True

    def read(self, a: Tensor) -> Tensor:
        return a


@dataclass(frozen=True)
class LqRetention(Retention, kind="lq"):
    """W = A / ||A||_q^(q-2) per memory layer and head (Moneta); q = 2 is `DecayRetention`."""

    q: float = 4.0

    def __post_init__(self) -> None:
        _check_number("LqRetention", "q", self.q, minimum=2)

    def read(self, a: Tensor) -> Tensor:
        if self.q == 2:
            return a
        q = self.q
        norm = a.abs().pow(q).sum((-1, -2), keepdim=True).pow(1 / q)
        return a / norm.clamp_min(1e-12).pow(q - 2)


@dataclass(frozen=True)
class KLRetention(Retention, kind="kl"):
    """W = scale * softmax(A) along each row's d_out entries (Memora): the KL-regularised update
    W_t = softmax(alpha_t log W_{t-1} - eta_t grad) is linear in the logits A (softmax ignores the row's
    log-normaliser), so the decay and the chunk's closed form act on A. scale 1 is the paper's simplex;
    the entries stay positive either way, so the memory cannot flip a sign."""

    scale: float = 1.0

    def __post_init__(self) -> None:
        _check_number("KLRetention", "scale", self.scale, minimum=0, strict=True)

    def read(self, a: Tensor) -> Tensor:
        return self.scale * torch.softmax(a, dim=-1)


@dataclass(frozen=True)
class Window:
    """The objective's window c: token t minimises sum_{i=t-c+1..t} gamma_i loss_i (Omega rule, ATLAS);
    c = 1 is Titans (no gate). gamma_i = sigmoid(x_i w + b), learned, its bias starting at `gate_init`."""

    size: int = 1
    gate_init: float = 0.9

    def __post_init__(self) -> None:
        check_int("Window: size", self.size)
        number = isinstance(self.gate_init, (int, float)) and not isinstance(self.gate_init, bool)
        if not (number and 0 < self.gate_init < 1):
            raise ValueError(f"Window: gate_init must be a number in (0, 1), got {self.gate_init!r}")

    def gates(self) -> tuple[GateSpec, ...]:
        if self.size == 1:
            return ()
        p = self.gate_init
        return (GateSpec("omega", torch.sigmoid, math.log(p) - math.log1p(-p)),)

    def matrix(self, omega: Tensor | None, n: int, m: int) -> Tensor | None:
        """(..., n, m): entry [t, i] is the weight of context row i (the chunk's n tokens are its last n
        rows) in token t's objective: omega_i inside the window i in (t + m - n - size, t + m - n], else
        0. None for size 1 (the identity)."""
        if self.size == 1:
            return None
        t = torch.arange(n, device=omega.device).unsqueeze(-1) + (m - n)
        i = torch.arange(m, device=omega.device)
        band = (i <= t) & (i > t - self.size)
        return omega.unsqueeze(-2) * band.to(omega.dtype)


@dataclass(frozen=True)
class MomentumSGD(Optimizer, kind="sgd"):
    """Gradient descent with momentum (Titans); momentum=False is plain gradient descent (MIRAS's GD)."""

    momentum: bool = True
    fast_path = True

    def __post_init__(self) -> None:
        if not isinstance(self.momentum, bool):
            raise ValueError(f"MomentumSGD: momentum must be a bool (True or False), got {self.momentum!r}")

    @property
    def uses_momentum(self) -> bool:
        return self.momentum

    def momentum_coefficients(self, beta: Tensor, log_eta: Tensor) -> Tensor:
        return beta

    def update(self, a_state, s_state, s_new, inputs, deltas, c_w, theta, log_keep, decay, carry) -> Tensor:
        """A_b = A_b' A_0 + c S_0 - sum_t gamma_t u_t."""
        return (
            decay[:, None, None] * a_state
            + carry[:, None, None] * s_state
            - inputs.transpose(1, 2) @ (c_w.unsqueeze(-1) * deltas)
        )


@dataclass(frozen=True)
class Muon(Optimizer, kind="muon"):
    """Muon (ATLAS): the momentum S_t = eta_t S_{t-1} - u_t, orthogonalised by `steps` Newton-Schulz
    iterations, is the step: A_t = keep_t A_{t-1} + theta_t NS(S_t). Once per chunk (see the module)."""

    steps: int = 5

    def __post_init__(self) -> None:
        check_int("Muon: steps", self.steps)

    @property
    def uses_momentum(self) -> bool:
        return True

    def momentum_coefficients(self, beta: Tensor, log_eta: Tensor) -> Tensor:
        # S_b = E_b S_0 - sum_t (E_b / E_t) s_t u_t: beta without theta
        return segsum(log_eta)[..., -1, 1:].exp()

    def update(self, a_state, s_state, s_new, inputs, deltas, c_w, theta, log_keep, decay, carry) -> Tensor:
        """A_b = A_b' A_0 + (sum_t theta_t A_b / A_t) NS(S_b)."""
        lr = (theta * suffix_sum(log_keep)[..., 1:].exp()).sum(-1)
        return decay[:, None, None] * a_state + lr[:, None, None] * newton_schulz(s_new, self.steps)


# the registered kinds of each slot, by name (filled as the parts above are defined)
BIASES = Bias.registry
RETENTIONS = Retention.registry
OPTIMIZERS = Optimizer.registry
SLOTS: dict[str, type[RulePart]] = {"bias": Bias, "retention": Retention, "optimizer": Optimizer}


@dataclass(frozen=True)
class MemoryRule:
    """The memory's update rule as its four parts (module docstring). `MemoryRule()` is Titans."""

    bias: Bias = L2Bias()
    retention: Retention = DecayRetention()
    window: Window = Window()
    optimizer: Optimizer = MomentumSGD()

    def __post_init__(self) -> None:
        for name, slot in SLOTS.items():
            part = getattr(self, name)
            if type(part) not in slot.registry.values():
                raise TypeError(
                    f"MemoryRule: {name} must be one of {[k.__name__ for k in slot.registry.values()]}, "
                    f"got {type(part).__name__}"
                )
            # the decorator runs after the class is registered (__init_subclass__), so it is checked here:
            # a part's fields are its configuration (to_dict, equality, the config's JSON)
            if not is_dataclass(part):
                raise TypeError(
                    f"MemoryRule: {name} part {type(part).__name__} is not a dataclass; declare it with "
                    "@dataclass(frozen=True)"
                )
            # a rule is hashed and compared by its parts' fields: a mutable part would make it unhashable
            if not type(part).__dataclass_params__.frozen:
                raise TypeError(
                    f"MemoryRule: {name} part {type(part).__name__} is a dataclass without frozen=True; "
                    "declare it with @dataclass(frozen=True)"
                )
        if type(self.window) is not Window:  # not an extension slot: a config saves and rebuilds a Window
            raise TypeError(f"MemoryRule: window must be a Window, got {type(self.window).__name__}")
        for name in ("window", *SLOTS):
            if len(getattr(self, name).gates()) > 1:
                raise ValueError(f"MemoryRule: the {name} part learns at most one gate")
        # only the window's gate (Window.matrix) and the bias's (aux) reach their part's maths: a retention's
        # read(A) and an optimiser's update take no per-token input, so a gate there would be learned from
        # nothing (zero gradient)
        for name in ("retention", "optimizer"):
            part = getattr(self, name)
            specs = part.gates()
            if specs:
                raise ValueError(
                    f"MemoryRule: the {name} part {type(part).__name__} declares a gate ({specs[0].name!r}), "
                    f"but a {name} part's methods take no per-token gate, so it would never be used; only "
                    "the bias (as aux) and the window take a learned gate"
                )

    @property
    def is_titans(self) -> bool:
        """Exactly today's Titans update (runs on the custom-autograd fast path). A window of size 1 has no
        gate, so its `gate_init` is not compared."""
        return self._canonical() == RULE_PRESETS["titans"]

    def _canonical(self) -> MemoryRule:
        """This rule with the fields that do not change its maths at their defaults: a size-1 window's
        `gate_init` (no gate is created at size 1)."""
        if self.window.size == 1 and self.window != Window():
            return replace(self, window=Window())
        return self

    @property
    def gate_specs(self) -> tuple[GateSpec, ...]:
        """The per-token, per-head gates this rule learns beyond theta, eta, alpha, in channel order (the
        window's, the bias's, the retention's, the optimizer's)."""
        return tuple(g for name in _GATE_ORDER for g in getattr(self, name).gates())

    @property
    def extra_gates(self) -> tuple[str, ...]:
        """The names of `gate_specs`, in channel order."""
        return tuple(g.name for g in self.gate_specs)

    def gate_of(self, part: str, extra: Tensor) -> Tensor | None:
        """The channel of part `part`'s ("window", "bias", ...) gate in extra (..., e), the rule's extra gates
        in channel order: (...) or None where the part has no gate."""
        start = 0
        for name in _GATE_ORDER:
            count = len(getattr(self, name).gates())
            if name == part:
                return extra[..., start] if count else None
            start += count
        raise ValueError(f"MemoryRule: no part {part!r}; the parts are {list(_GATE_ORDER)}")

    @property
    def uses_momentum(self) -> bool:
        return self.optimizer.uses_momentum

    def to_dict(self) -> dict:
        """The parts as plain data (JSON): {"bias": {"kind": "lp", "p": 3.0}, ...}."""
        out = {}
        for name in SLOTS:
            part = getattr(self, name)
            out[name] = {"kind": part.kind, **{f.name: v for f, v in _init_fields(part)}}
        out["window"] = asdict(self.window)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> MemoryRule:
        """The inverse of `to_dict`; a missing part is Titans's."""
        if not isinstance(data, dict):
            raise TypeError(f"MemoryRule.from_dict: expected a dict, got {type(data).__name__}")
        unknown = sorted(set(data) - {"bias", "retention", "window", "optimizer"})
        if unknown:
            raise ValueError(f"MemoryRule: unknown part(s) {unknown}")
        for name in sorted(data):
            if not isinstance(data[name], dict):
                raise TypeError(
                    f"MemoryRule.from_dict: {name} must be a dict of the part's fields (as to_dict writes "
                    f"it), got {type(data[name]).__name__}"
                )
        parts = {}
        for name, slot in SLOTS.items():
            if name in data:
                spec = dict(data[name])
                kind = spec.pop("kind", None)
                if kind not in slot.registry:
                    raise ValueError(
                        f"MemoryRule: {name} kind must be one of {sorted(slot.registry)}, got {kind!r} (a "
                        "part defined outside titans registers its kind when its module is imported: import "
                        "it before building or loading the model)"
                    )
                parts[name] = slot.registry[kind](**spec)
        if "window" in data:
            parts["window"] = Window(**data["window"])
        return cls(**parts)

    def to_config(self) -> str | dict:
        """What a config stores: the preset's name where the rule is one (up to a size-1 window's
        `gate_init`, which has no effect), else the parts."""
        canonical = self._canonical()
        for name, rule in RULE_PRESETS.items():
            if rule == canonical:
                return name
        return self.to_dict()


_GATE_ORDER = ("window", "bias", "retention", "optimizer")


def _init_fields(part):
    return [(f, getattr(part, f.name)) for f in fields(part) if f.init]


# The published models (docs/design.md, "Memory rules", says where each is simplified).
RULE_PRESETS: dict[str, MemoryRule] = {
    "titans": MemoryRule(),
    # Moneta: l_3 bias, l_4 retention, plain gradient descent
    "moneta": MemoryRule(LpBias(3.0), LqRetention(4.0), Window(1), MomentumSGD(momentum=False)),
    # Yaad: Huber bias with a data-dependent delta, the decay (l_2) retention, plain gradient descent
    "yaad": MemoryRule(HuberBias(), DecayRetention(), Window(1), MomentumSGD(momentum=False)),
    # Memora: l_2 bias, KL retention (a softmax-constrained memory), plain gradient descent
    "memora": MemoryRule(L2Bias(), KLRetention(), Window(1), MomentumSGD(momentum=False)),
    # ATLAS: l_2 bias, decay retention, the Omega rule over the last 4 tokens, Muon
    "atlas": MemoryRule(L2Bias(), DecayRetention(), Window(4), Muon()),
}


def resolve_rule(rule: str | dict | MemoryRule | None) -> MemoryRule:
    """A `MemoryRule` from a preset name, a parts dict (`MemoryRule.to_dict`), or a rule (None: Titans)."""
    if rule is None:
        return RULE_PRESETS["titans"]
    if isinstance(rule, MemoryRule):
        return rule
    if isinstance(rule, str):
        if rule not in RULE_PRESETS:
            raise ValueError(f"memory rule: unknown preset {rule!r}; choose from {sorted(RULE_PRESETS)}")
        return RULE_PRESETS[rule]
    if isinstance(rule, dict):
        return MemoryRule.from_dict(rule)
    raise TypeError(f"memory rule must be a preset name, a dict or a MemoryRule, got {type(rule).__name__}")


# --------------------------------------------------------------------------------------- the parts' maths


class _LpError(torch.autograd.Function):
    """phi(e) = p sign(e) |e|^(p-1) (p >= 2) or p e (e^2 + eps^2)^((p-2)/2) (p < 2), with its derivative
    written out: autograd through pow/abs gives 0 * inf = nan at e = 0 for 2 < p < 3, and the wrong value
    0 for p = 2."""

    @staticmethod
    def forward(ctx, e: Tensor, p: float, eps: float) -> Tensor:
        ctx.save_for_backward(e)
        ctx.p, ctx.eps = p, eps
        if p >= 2:
            return p * e.sign() * e.abs().pow(p - 1)
        return p * e * (e.square() + eps * eps).pow((p - 2) / 2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        (e,) = ctx.saved_tensors
        return g * _lp_derivative(e, ctx.p, ctx.eps), None, None


def _lp_derivative(e: Tensor, p: float, eps: float) -> Tensor:
    """phi'(e) of the l_p error map: p (p - 1) |e|^(p-2) (0^0 = 1 gives phi'(0) = 2 at p = 2), or below
    p = 2 the smoothed p (e^2 + eps^2)^((p-4)/2) ((p - 1) e^2 + eps^2)."""
    if p >= 2:
        return p * (p - 1) * e.abs().pow(p - 2)
    s = e.square() + eps * eps
    return p * s.pow((p - 4) / 2) * ((p - 1) * e.square() + eps * eps)


def newton_schulz(x: Tensor, steps: int) -> Tensor:
    """The orthogonal factor of x (..., m, n) (U V^T of its SVD), approximately: x / ||x||_F, then `steps`
    quintic Newton-Schulz iterations X <- a X + (b A + c A^2) X, A = X X^T, on the wide orientation."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = x.shape[-2] > x.shape[-1]
    y = x.transpose(-1, -2) if tall else x
    y = y / (torch.linalg.matrix_norm(y).clamp_min(1e-7)[..., None, None])
    for _ in range(steps):
        g = y @ y.transpose(-1, -2)
        y = a * y + (b * g + c * (g @ g)) @ y
    return y.transpose(-1, -2) if tall else y


# ------------------------------------------------------------------------------------------- the chunk op


def _chunk(rule, activation, residual, clip, threshold, n, q, k, v, extra, gates, states, write):
    """One chunk (or a trailing partial chunk: write=False). Rows: k, v, extra (N, m, .) are the m >= n
    context rows whose last n are the chunk's tokens; q (N, n, d); gates (N, n, 3) theta, log_eta,
    log_keep of the chunk's tokens; states: per layer (A, S), each (N, d_in, d_out). threshold: a token
    whose surprise is below it adds no gradient (None: every token does).
    Returns y (N, n, d), surprise (N, n), new states."""
    m = k.shape[1]
    ws = [rule.retention.read(a) for a, _ in states]
    out_all, hs, zs = layers_forward(torch.cat([k, q], 1), ws, activation, residual)
    err = rule.bias.error_map(out_all[:, :m] - v, rule.gate_of("bias", extra))
    # the inner backprop at the key rows: per layer input a_l (N, m, d_in) and error delta_l (N, m, d_out)
    deltas = [err]
    for i in range(len(ws) - 1, 0, -1):
        e = deltas[0] @ ws[i].transpose(-1, -2)
        deltas.insert(0, act_backward(e, zs[i - 1][:, :m], activation))
    inputs = [h[:, :m] for h in hs]
    win = rule.window.matrix(rule.gate_of("window", extra), n, m)  # (N, n, m) or None
    if win is None:
        sq = sum(a.square().sum(-1) * d.square().sum(-1) for a, d in zip(inputs, deltas))[:, m - n :]
    else:
        # ||sum_i w_ti a_i^T d_i||_F^2 = sum_ij w_ti w_tj (a_i . a_j)(d_i . d_j), per layer
        gram = sum((a @ a.transpose(1, 2)) * (d @ d.transpose(1, 2)) for a, d in zip(inputs, deltas))
        sq = ((win @ gram) * win).sum(-1)
    norm = sq.clamp_min(1e-30).sqrt()
    y = out_all[:, m:]
    if not write:
        return y, norm, states
    scale = clip_scale(norm, clip) if clip is not None else torch.ones_like(norm)
    if threshold is not None:  # surprise-gated write: a 0/1 factor on each token's (windowed) gradient
        scale = scale * write_mask(norm, threshold).to(scale.dtype)
    theta, log_eta, log_keep = gates.unbind(-1)
    gamma, beta, decay, carry, mom_decay = chunk_coefficients(theta, log_eta, log_keep)
    beta = rule.optimizer.momentum_coefficients(beta, log_eta)
    c_w, c_s = gamma * scale, beta * scale  # (N, n): per token's combined gradient
    if win is not None:  # -> per context row's gradient
        c_w, c_s = ((c.unsqueeze(-2) @ win).squeeze(-2) for c in (c_w, c_s))
    else:
        c_w, c_s = (F.pad(c, (m - n, 0)) for c in (c_w, c_s))
    new_states = []
    for (a_state, s_state), a, d in zip(states, inputs, deltas):
        s_new = mom_decay[:, None, None] * s_state - a.transpose(1, 2) @ (c_s.unsqueeze(-1) * d)
        a_new = rule.optimizer.update(a_state, s_state, s_new, a, d, c_w, theta, log_keep, decay, carry)
        new_states.append((a_new, s_new))
    return y, norm, new_states


def fits_fast_path(rule: MemoryRule) -> bool:
    """Whether `rule` runs on the custom-autograd fast path (`neural_memory_chunked` with the bias's error
    map): the decay retention, window 1 and (momentum) SGD, any bias."""
    return rule.retention.fast_path and rule.window.size == 1 and rule.optimizer.fast_path


def memory_rule_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gates: Tensor,
    weights: tuple[Tensor, ...],
    momentum: tuple[Tensor, ...],
    *,
    rule: MemoryRule,
    chunk_size: int,
    history: int = 0,
    activation: str = "silu",
    residual: bool = False,
    surprise_clip: float | None = None,
    checkpoint_every: int | None = None,
    surprise_threshold: float | None = None,
) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...], Tensor]:
    """Read and write a memory with `rule` (contract of `memory_rule_chunked_autograd`). Rules that fit
    (`fits_fast_path`: the biases with the Titans retention, window and optimiser) run on the fast path
    of `titans.ops.memory.chunk` with the bias's error map; the others on `memory_rule_chunked_autograd`.
    checkpoint_every: as `neural_memory_chunked`'s, on the fast path only."""
    check_int("memory_rule_chunked: chunk_size", chunk_size)
    check_history(history, k)
    # no row left to read (history = every row): the autograd op returns the state as it came, the fast
    # path's op has no zero-length form
    if not fits_fast_path(rule) or history == k.shape[2]:
        return memory_rule_chunked_autograd(
            q,
            k,
            v,
            gates,
            weights,
            momentum,
            rule=rule,
            chunk_size=chunk_size,
            history=history,
            activation=activation,
            residual=residual,
            surprise_clip=surprise_clip,
            surprise_threshold=surprise_threshold,
        )
    check_gates(rule, k, gates)
    q, k, v, gates = (x[:, :, history:] for x in (q, k, v, gates))
    return neural_memory_chunked(
        q,
        k,
        v,
        gates[..., 0],
        gates[..., 1],
        gates[..., 2],
        weights,
        momentum,
        chunk_size=chunk_size,
        activation=activation,
        residual=residual,
        surprise_clip=surprise_clip,
        checkpoint_every=checkpoint_every,
        surprise_threshold=surprise_threshold,
        error=rule.bias.fast_error(),
        error_aux=rule.gate_of("bias", gates[..., 3:]),
    )


def check_history(history: int, k: Tensor, caller: str = "memory_rule_chunked") -> None:
    """history counts context rows at the start of k (B, H, rows, d): 0 <= history <= rows."""
    rows = k.shape[2] if k.dim() == 4 else None
    ok = isinstance(history, int) and not isinstance(history, bool) and history >= 0
    if not ok or (rows is not None and history > rows):
        bound = f"[0, {rows}] (the rows given)" if rows is not None else ">= 0"
        raise ValueError(f"{caller}: history must be an integer in {bound}, got {history!r}")


def check_gates(rule: MemoryRule, k: Tensor, gates: Tensor) -> None:
    """gates (B, H, rows, 3 + e) beside k (B, H, rows, d): the Titans gates, then the rule's e extra gates."""
    if gates.shape[:3] != k.shape[:3] or gates.shape[-1] != 3 + len(rule.extra_gates):
        raise ValueError(
            f"memory_rule_chunked: gates must be (B, H, T, {3 + len(rule.extra_gates)}) for this rule, "
            f"got {tuple(gates.shape)}"
        )


def _rows(x: Tensor, ranges: list[tuple[int, int]]) -> list[Tensor]:
    """x (N, T, ...) rows a .. b - 1 for each (a, b) of ranges (a < b). x is cut once with split() at every
    range's ends and each range joined from its pieces: slicing x per range would backpropagate one
    zero-filled gradient of x's full size per range (O(T^2 / chunk) over a sequence), split one cat."""
    points = sorted({0, x.shape[1], *(p for r in ranges for p in r)})
    pieces = x.split([b - a for a, b in zip(points, points[1:])], dim=1)
    index = {p: i for i, p in enumerate(points)}  # a dict, not bisect: torch.compile traces it
    out = []
    for a, b in ranges:
        parts = pieces[index[a] : index[b]]
        out.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
    return out


def memory_rule_chunked_autograd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gates: Tensor,
    weights: tuple[Tensor, ...],
    momentum: tuple[Tensor, ...],
    *,
    rule: MemoryRule,
    chunk_size: int,
    history: int = 0,
    activation: str = "silu",
    residual: bool = False,
    surprise_clip: float | None = None,
    surprise_threshold: float | None = None,
) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...], Tensor]:
    """Read and write a memory with `rule` over a sequence, chunk by chunk (the chunked form; torch autograd).

    q, k, v: (B, H, h + T, d), the first h = `history` rows context only: tokens already written whose
    keys, values and gates the window of the first chunk reaches back to (their queries are ignored).
    gates: (B, H, h + T, 3 + e): theta, log(eta), log(1 - alpha), then `rule.extra_gates`.
    weights, momentum: per memory layer (B, H, d_in, d_out): the pre-retention state A (W = g(A)) and S.
    Returns y (B, H, T, d), weights, momentum after the last complete chunk, surprise (B, H, T): the norm of
    each token's (windowed) inner gradient. Shapes and chunking as
    `titans.ops.memory.chunk.neural_memory_chunked`.
    surprise_threshold: as `neural_memory_chunked`'s: a token whose surprise (its windowed gradient's norm,
    before clipping) is below it adds no gradient to S.
    """
    if torch.is_autocast_enabled(q.device.type):
        # as the Titans path: the memory runs in its state's dtype (its small increments need it)
        with torch.autocast(q.device.type, enabled=False):
            return memory_rule_chunked_autograd(
                q,
                k,
                v,
                gates,
                weights,
                momentum,
                rule=rule,
                chunk_size=chunk_size,
                history=history,
                activation=activation,
                residual=residual,
                surprise_clip=surprise_clip,
                surprise_threshold=surprise_threshold,
            )
    check_int("memory_rule_chunked: chunk_size", chunk_size)
    check_threshold("memory_rule_chunked: surprise_threshold", surprise_threshold)
    check_history(history, k)
    batch, heads, total, dim = k.shape
    check_gates(rule, k, gates)
    dtype = weights[0].dtype
    n_seq = batch * heads

    def flat(x: Tensor) -> Tensor:
        return x.reshape(n_seq, total, *x.shape[3:])

    q, k, v, g = flat(q.to(dtype)), flat(k.to(dtype)), flat(v.to(dtype)), flat(gates.to(dtype))
    states = [
        (w.reshape(n_seq, *w.shape[2:]), s.reshape(n_seq, *s.shape[2:])) for w, s in zip(weights, momentum)
    ]
    back = rule.window.size - 1
    starts = range(history, total, chunk_size)
    reads = [(start, min(start + chunk_size, total)) for start in starts]  # each chunk's rows
    windows = [(max(0, start - back), end) for start, end in reads]  # with the window's reach back
    ys, norms = [], []
    for (start, end), q_c, k_c, v_c, g_c, g_w in zip(
        reads, _rows(q, reads), _rows(k, windows), _rows(v, windows), _rows(g, reads), _rows(g, windows)
    ):
        y, norm, states = _chunk(
            rule,
            activation,
            residual,
            surprise_clip,
            surprise_threshold,
            end - start,
            q_c,
            k_c,
            v_c,
            g_w[..., 3:],
            g_c[..., :3],
            states,
            write=end - start == chunk_size,
        )
        ys.append(y)
        norms.append(norm)
    if ys:
        y = torch.cat(ys, 1)
        norm = torch.cat(norms, 1)
    else:
        y = q.new_zeros(n_seq, 0, dim)
        norm = q.new_zeros(n_seq, 0)
    seq = total - history
    w_out = tuple(a.reshape(batch, heads, *a.shape[1:]) for a, _ in states)
    s_out = tuple(s.reshape(batch, heads, *s.shape[1:]) for _, s in states)
    return y.reshape(batch, heads, seq, dim), w_out, s_out, norm.reshape(batch, heads, seq)


def newton_schulz_flops(d_in: int, d_out: int, steps: int) -> int:
    """Multiply-adds of one `newton_schulz` on a (d_in, d_out) matrix (for the cost estimate in docs)."""
    m, n = sorted((d_in, d_out))
    return steps * (m * m * n + m * m * m + m * m * n)


__all__ = [
    "BIASES",
    "OPTIMIZERS",
    "RETENTIONS",
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
    "RULE_PRESETS",
    "Retention",
    "RulePart",
    "Window",
    "fits_fast_path",
    "memory_rule_chunked",
    "memory_rule_chunked_autograd",
    "newton_schulz",
    "newton_schulz_flops",
    "resolve_rule",
]
