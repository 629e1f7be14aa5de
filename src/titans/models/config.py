"""`TitansConfig`: everything that defines a Titans language model, as data (JSON file round trip)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from titans.layers.attention import PERSISTENT_ROPE
from titans.models.variants import VARIANT_SPECS, Variant
from titans.ops.memory import ACTIVATIONS, RULE_PRESETS, TRITON_DEPTHS, fits_fast_path, resolve_rule
from titans.validation import check_bounds, did_you_mean, field_help, option

VARIANTS = tuple(VARIANT_SPECS)
MEMORY_VARIANTS = tuple(name for name, spec in VARIANT_SPECS.items() if spec.memory)


def read_json_object(path: str | Path, owner: str) -> dict[str, Any]:
    """The JSON object in a config file, with errors that name the file and the config class."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{owner}: no config file at {str(path)!r}")
    try:  # bytes: json detects UTF-8 / 16 / 32 and a byte-order mark, whatever the locale
        data = json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError (a file in another encoding)
        raise ValueError(f"{owner}: {str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{owner}: {str(path)!r} must hold a JSON object")
    return data


MAC_GATES = ("norm", "open")
FORGET_TARGETS = ("zero", "init")
# memory options and the value that turns each off; the Triton kernels run none of them, and the memory
# rules other than "titans" do not run TITANS_RULE_ONLY
OPTION_OFF = {"memory_surprise_threshold": None, "memory_max_norm": None, "memory_forget_to": "zero"}
TITANS_RULE_ONLY = ("memory_max_norm", "memory_forget_to")


@dataclass
class TitansConfig:
    """A Titans causal LM (docs/design.md, "The variants"). The core fields come first; all have defaults.

    variant: "mac" (memory as context), "mag" (memory as gate), "mal" (memory as layer), "lmm" (memory
        alone), or the baselines "transformer" (full causal attention) and "swa" (sliding window).
    depth: number of residual blocks. heads: attention heads. segment_len: MAC segment length.
    window: sliding-window size (mag, mal, swa, and non-memory layers). chunk_size: memory chunk size.
    persistent_tokens: learned tokens prepended to every attention.
    memory_layers: indices of the blocks that carry a neural memory (None: all); the other blocks of a
        memory variant use sliding-window attention (window `window`, or `segment_len` for mac). The
        variants without a memory (transformer, swa) take it and build no memory, as they do with every
        memory_* field, so one override fits every config of a comparison (`titans train --compare`).

    Every field is an `option`: its one-line help (`FIELD_HELP`, `titans train --list-fields`) and its
    bounds (checked on construction) live in the field's metadata. A field ``memory_<arg>`` is the
    `NeuralMemory` argument ``<arg>`` (`memory_kwargs`), unless its metadata names another argument, or
    none (``memory_arg``).
    """

    variant: str = option("mac", help=f"model variant: {', '.join(VARIANTS)}")
    vocab_size: int = option(256, help="vocabulary size (training: the tokenizer's unless set larger)", min=1)
    dim: int = option(256, help="model width", min=1)
    depth: int = option(4, help="number of residual blocks", min=1)
    heads: int = option(4, help="attention heads", min=1)
    head_dim: int | None = option(None, help="attention head width (null: dim / heads)", min=1)
    mlp_mult: float = option(
        4.0, help="SwiGLU width as a multiple of dim (2/3 of it, for a plain MLP's parameters)", above=0
    )
    segment_len: int = option(128, help="MAC segment length (attention span of a MAC block)", min=1)
    window: int = option(128, help="sliding-window size (mag, mal, swa and the blocks without memory)", min=1)
    chunk_size: int = option(16, help="tokens per memory update chunk", min=1, memory_arg="chunk_size")
    persistent_tokens: int = option(4, help="learned tokens prepended to every attention", min=0)
    memory_layers: list[int] | None = option(
        None, help="indices of the blocks that carry a neural memory (null: all)", memory_arg=None
    )
    # neural memory
    memory_heads: int | None = option(None, help="memory heads (null: the attention heads)", min=1)
    memory_head_dim: int | None = option(None, help="memory head width (null: dim / memory heads)", min=1)
    memory_depth: int = option(2, help="layers of the memory MLP (L_M)", min=1)
    memory_expansion: float = option(
        2.0, help="hidden width of a deep memory MLP as a multiple of its head width", above=0
    )
    memory_activation: str = option("silu", help="activation of the memory MLP")
    memory_conv_kernel: int = option(
        4, help="causal depthwise convolution width on queries, keys and values (0: none)", min=0
    )
    memory_momentum: bool = option(True, help="surprise with momentum (eta); false: the plain gradient")
    memory_forgetting: bool = option(True, help="forgetting gate (alpha) on the memory weights")
    # what forgetting pulls the memory's weights toward (NeuralMemory.forget_to): "zero" (the paper's
    # W_t = (1 - alpha) W_{t-1} + S_t) or "init", the learned initial weights W_0 (W - W_0 follows the
    # paper's recurrence, and a memory left unwritten returns to W_0 instead of fading to nothing)
    memory_forget_to: str = option(
        "zero",
        help="what forgetting pulls the memory weights toward: zero (the paper) or init (the "
        "learned initial weights)",
    )
    # inner learning rate: bound and initial value. Larger values (e.g. 1.0 / 0.1) make the outer
    # gradient through the memory grow exponentially with the number of chunks (docs/evaluations.md)
    memory_max_lr: float = option(0.03, help="upper bound of the memory's inner learning rate theta", above=0)
    memory_theta_init: float = option(
        0.01, help="initial inner learning rate theta, in (0, memory_max_lr)", above=0
    )
    # momentum decay eta and forgetting alpha at initialisation (through the gate biases). A small alpha
    # (e.g. 1e-5) keeps a write for about 1/alpha tokens, which retrieval past the training length needs
    memory_eta_init: float = option(0.9, help="initial momentum decay eta, in (0, 1)", above=0, below=1)
    memory_alpha_init: float = option(
        0.01, help="initial forgetting alpha, in (0, 1) (small: writes are kept longer)", above=0, below=1
    )
    memory_surprise_clip: float | None = option(
        1.0, help="each token's inner gradient is rescaled to at most this norm (null: no clip)", above=0
    )
    memory_residual: bool = option(False, help="the memory computes k + MLP(k) instead of MLP(k)")
    # False: a frozen memory, read and never written (no test-time learning, no forgetting): an ablation twin
    memory_write: bool = option(True, help="false: read-only memory, no test-time learning (an ablation)")
    # training memory: keep the memory's state every this many chunks and recompute the rest in the
    # backward pass (NeuralMemory.checkpoint_every; None: keep every chunk's). Same outputs and gradients
    memory_checkpoint_every: int | None = option(
        None, help="keep the memory state every this many chunks, recompute the rest (null: keep all)", min=1
    )
    # the memory's update rule (docs/design.md, "Memory rules"): a preset name (`RULE_PRESETS`), a parts
    # dict or a MemoryRule object (stored as its preset name or parts dict). Typed Any: the command line
    # takes a name or a JSON object
    memory_rule: Any = option(
        "titans",
        help=f"memory update rule: {', '.join(RULE_PRESETS)}, "
        "or a parts dict (bias, retention, window, optimizer)",
    )
    # the memory's chunk loop: "auto" (Triton kernels on CUDA where they cover the config, else torch),
    # "triton" or "torch" (NeuralMemory.backend)
    memory_backend: str = option(
        "auto",
        help="the memory's chunk loop: auto (Triton kernels on CUDA where covered, else torch), "
        "triton, torch",
    )
    # surprise-gated writes (NeuralMemory.surprise_threshold): a token whose surprise is below this is not
    # written (None: every token is). Monitoring: memory utilisation is ||W|| / memory_monitor_max_norm
    # (None: memory_max_norm's bound, if any)
    memory_surprise_threshold: float | None = option(
        None,
        help="surprise-gated writes: tokens whose surprise is below this are not written (null: all are)",
        min=0,
    )
    memory_monitor_max_norm: float | None = option(
        None,
        help="monitoring: memory utilisation is ||W|| / this (null: memory_max_norm; neither: not reported)",
        above=0,
        memory_arg=None,
    )
    # a bound on the memory's weights (NeuralMemory.max_norm): at every chunk boundary each memory-MLP
    # layer's W is rescaled to Frobenius norm <= this (None: no bound). Also the monitoring's default
    # max_norm where memory_monitor_max_norm is None (`utilisation_max_norm`)
    memory_max_norm: float | None = option(
        None,
        help="bound on the memory's weights: at every chunk boundary each memory layer's ||W|| is "
        "rescaled to at most this (null: no bound)",
        above=0,
    )
    # The MAC block (docs/design.md, "The MAC block"). mac_norm_memory_tokens: the retrieved memory tokens h
    # enter the attention RMS-normalised, in the scale of the normed block input beside them. mac_gate: the
    # output o = y * gate(M(y)) is "norm", W (norm(y) * sigmoid(norm(M(y)))) as MAG combines its branches,
    # or "open", y * 2 sigmoid(W norm(M(y))) with W zero-initialised (the identity on y at first). The
    # defaults recall best through the memory; open + normalised tokens model language best at small scale
    mac_norm_memory_tokens: bool = option(
        False, help="MAC: RMS-normalise the retrieved memory tokens before attention"
    )
    mac_gate: str = option("norm", help=f"MAC output gate: {', '.join(MAC_GATES)}")
    # mac_norm_memory_input: the attention output y is RMS-normalised (learned weight) before MAC writes it
    # into the memory and reads it back. Unnormalised, y sits at the scale of the attention's small output
    # projection, and the memory's keys and values at initialisation are its conv bias alone, the same for
    # every token (docs/design.md, "The MAC block")
    mac_norm_memory_input: bool = option(
        True, help="MAC: RMS-normalise the attention output before the memory writes it"
    )
    # mac_memory_residual: MAC's memory writes (and reads back for its gate) x + y, the normed block input
    # plus the attention output, instead of y alone. At initialisation the attention spreads over its
    # segment, so y changes little from token to token: keys and queries built from it carry little of the
    # local context that retrieval matches on (docs/design.md, "The memory's write input")
    mac_memory_residual: bool = option(
        True, help="MAC: the memory writes x + y (block input plus attention output), not y alone"
    )
    # Departures from the paper, each with the paper's form as an option (docs/design.md, "Departures from
    # the paper"). attn_output_gate: every attention normalises its output per head and gates it with
    # sigmoid(x W) before the output projection. persistent_to_memory: MAG and MAL prepend the persistent
    # tokens to the memory's input as well (the memory reads them at the start of every sequence).
    # mal_attn_persistent: MAL's sliding-window attention attends to the persistent tokens (False: the
    # paper's MAL, whose persistent tokens go to the memory only)
    attn_output_gate: bool = option(
        False,
        help="every attention normalises its output per head and gates it by the input "
        "(the paper's output gate)",
    )
    persistent_to_memory: bool = option(
        False, help="MAG and MAL: the persistent tokens are prepended to the memory's input too"
    )
    mal_attn_persistent: bool = option(
        True, help="MAL: the sliding-window attention attends to the persistent tokens"
    )
    # persistent_rope: how the sliding-window / full attention's queries score the persistent tokens,
    # which have no position: "absolute", rotated at the query's absolute position as for the sequence's
    # keys (the scores then change with position, past the training length too), or "none", unrotated
    # (the same scores at every position). MAC's segment attention uses segment-local positions and is
    # not affected (docs/long_context.md, "Persistent tokens and position")
    persistent_rope: str = option(
        "absolute",
        help="how attention queries score the persistent tokens: absolute (rotated at the query's "
        "position) or none (unrotated: the same at every position)",
    )
    # attention and the rest
    qk_norm: bool = option(True, help="RMS-normalise queries and keys")
    rope_base: float = option(10000.0, help="rotary position embedding base", above=1)
    tie_embeddings: bool = option(True, help="the output head shares the token embedding")
    norm_eps: float = option(1e-6, help="epsilon of the RMS norms", above=0)
    init_std: float = option(0.02, help="standard deviation of the initial weights", min=0)
    name: str = option("custom", help="preset name (informational)", compare=False)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(
                f"TitansConfig.variant must be one of {VARIANTS}, got {self.variant!r}"
                + did_you_mean(self.variant, VARIANTS)
            )
        check_bounds(self)
        if self.head_dim is None and self.dim % self.heads:
            raise ValueError(
                f"TitansConfig.heads={self.heads} does not divide dim={self.dim}; set head_dim explicitly"
            )
        if self.spec.segmented and self.segment_len % self.chunk_size:
            raise ValueError(
                f"TitansConfig.chunk_size={self.chunk_size} must divide segment_len={self.segment_len} for "
                f"{self.variant} (the memory is written chunk by chunk inside each segment)"
            )
        if self.mlp_hidden < 1:
            raise ValueError(
                f"TitansConfig.mlp_mult={self.mlp_mult} gives an MLP of width 0 at dim={self.dim} (the "
                "SwiGLU is mlp_mult * dim * 2/3 wide): mlp_mult * dim must be at least 1.5"
            )
        if self.memory_layers is not None:
            layers = self.memory_layers
            listed = isinstance(layers, (list, tuple))
            if not listed or any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
                raise ValueError(f"TitansConfig.memory_layers must list block numbers, got {layers!r}")
            self.memory_layers = list(layers)
            bad = [i for i in self.memory_layers if not 0 <= i < self.depth]
            if bad:
                raise ValueError(f"TitansConfig.memory_layers {bad} out of range for depth={self.depth}")
        if self.persistent_rope not in PERSISTENT_ROPE:
            raise ValueError(
                f"TitansConfig.persistent_rope must be one of {PERSISTENT_ROPE}, got {self.persistent_rope!r}"
            )
        if self.mac_gate not in MAC_GATES:
            raise ValueError(f"TitansConfig.mac_gate must be one of {MAC_GATES}, got {self.mac_gate!r}")
        if self.memory_theta_init >= self.memory_max_lr:  # theta = max_lr * sigmoid(.) starts below max_lr
            raise ValueError(
                f"TitansConfig.memory_theta_init={self.memory_theta_init} must be below memory_max_lr="
                f"{self.memory_max_lr}"
            )
        memory_heads = self.memory_heads or self.heads
        if self.memory_head_dim is None and self.dim < memory_heads:
            raise ValueError(
                f"TitansConfig.memory_heads={memory_heads} leaves no width per head at dim={self.dim}; set "
                "memory_head_dim or fewer memory_heads"
            )
        if self.memory_head_dim is None and self.dim % memory_heads:  # as the attention's heads
            raise ValueError(
                f"TitansConfig.memory_heads={memory_heads} does not divide dim={self.dim}; set "
                "memory_head_dim explicitly"
            )
        memory_width = self.memory_head_dim or self.dim // memory_heads
        if self.memory_depth > 1 and self.memory_expansion * memory_width < 1:
            raise ValueError(
                f"TitansConfig.memory_expansion={self.memory_expansion} gives the memory MLP a hidden width "
                f"of 0 at a head width of {memory_width}: memory_expansion * head width must be at least 1"
            )
        try:
            rule = resolve_rule(self.memory_rule)
            self.memory_rule = rule.to_config()
        except (TypeError, ValueError) as e:
            raise ValueError(f"TitansConfig.memory_rule: {e}") from e
        if self.memory_backend not in ("auto", "triton", "torch"):
            raise ValueError(
                "TitansConfig.memory_backend must be 'auto', 'triton' or 'torch', "
                f"got {self.memory_backend!r}"
            )
        if self.memory_activation not in ACTIVATIONS:
            raise ValueError(
                f"TitansConfig.memory_activation must be one of {ACTIVATIONS}, got "
                f"{self.memory_activation!r}" + did_you_mean(self.memory_activation, ACTIVATIONS)
            )
        if self.memory_forget_to not in FORGET_TARGETS:
            raise ValueError(
                f"TitansConfig.memory_forget_to must be one of {FORGET_TARGETS}, got "
                f"{self.memory_forget_to!r}"
            )
        for name in TITANS_RULE_ONLY:  # options of the "titans" rule's op alone
            val = getattr(self, name)
            if val != OPTION_OFF[name] and self.memory_rule != "titans":
                raise ValueError(
                    f"TitansConfig.{name}={val!r} is not covered by memory_rule={self.memory_rule!r} (only "
                    "'titans')"
                )
        if self.memory_checkpoint_every is not None and not fits_fast_path(rule):  # refused by the layer
            raise ValueError(
                f"TitansConfig.memory_checkpoint_every applies to the rules on the fast path, not to "
                f"memory_rule={self.memory_rule!r}: leave it null"
            )
        if self.memory_backend == "triton":  # the kernels run the default rule, every token written
            if self.memory_rule != "titans":
                raise ValueError(
                    f"TitansConfig.memory_backend='triton' runs memory_rule='titans' only, got memory_rule="
                    f"{self.memory_rule!r}: use memory_backend='auto' or 'torch'"
                )
            if self.memory_depth not in TRITON_DEPTHS:
                covers = " and ".join(map(str, TRITON_DEPTHS))
                raise ValueError(
                    f"TitansConfig.memory_backend='triton' covers memory_depth {covers}, got memory_depth="
                    f"{self.memory_depth}: use memory_backend='auto' or 'torch'"
                )
            for name in ("memory_surprise_threshold", *TITANS_RULE_ONLY):
                val = getattr(self, name)
                if val != OPTION_OFF[name]:
                    raise ValueError(
                        f"TitansConfig.memory_backend='triton' does not cover {name}={val!r}: use "
                        "memory_backend='auto' or 'torch'"
                    )

    # ------------------------------------------------------------------------------------- derived
    @property
    def spec(self) -> Variant:
        """The variant's entry in the registry (`titans.models.variants`)."""
        return VARIANT_SPECS[self.variant]

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.dim // self.heads

    @property
    def mlp_hidden(self) -> int:
        """SwiGLU width: 2/3 of mlp_mult * dim (same parameters as a plain MLP), rounded up to 8."""
        return -(-int(self.mlp_mult * self.dim * 2 / 3) // 8) * 8

    @property
    def utilisation_max_norm(self) -> float | None:
        """The ||W|| that monitoring counts as full (utilisation = ||W|| / this): memory_monitor_max_norm,
        else the weights' bound memory_max_norm (None: neither, no utilisation reported)."""
        if self.memory_monitor_max_norm is not None:
            return self.memory_monitor_max_norm
        return self.memory_max_norm

    def memory_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of this config's `NeuralMemory` (besides ``dim``): every field
        ``memory_<arg>`` as ``<arg>``, or as the argument its metadata names (``memory_arg``; None: not an
        argument). ``heads`` / ``head_dim`` left null follow the attention's heads and dim / heads."""
        kwargs: dict[str, Any] = {}
        for f in fields(self):
            arg = f.metadata.get(
                "memory_arg", f.name.removeprefix("memory_") if f.name.startswith("memory_") else None
            )
            if arg is not None:
                kwargs[arg] = getattr(self, f.name)
        kwargs["heads"] = heads = self.memory_heads or self.heads
        kwargs["head_dim"] = self.memory_head_dim or self.dim // heads
        return kwargs

    def has_memory(self, layer: int) -> bool:
        if not self.spec.memory:
            return False
        return self.memory_layers is None or layer in self.memory_layers

    # ------------------------------------------------------------------------------------ file i/o
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TitansConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"TitansConfig: unknown field(s) {unknown}")
        return cls(**data)

    @classmethod
    def from_saved_dict(cls, data: dict[str, Any]) -> TitansConfig:
        """A config as saved with a model (a complete `to_dict()`). A field the saved dict lacks was added
        after the model was saved: it takes the value that computes what that model computed
        (`SAVED_WITHOUT`), not today's default, so old checkpoints load and behave as they were trained."""
        return cls.from_dict({**{k: v for k, v in SAVED_WITHOUT.items() if k not in data}, **data})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> TitansConfig:
        return cls.from_dict(read_json_object(path, "TitansConfig"))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> TitansConfig:
        """A named size (see PRESETS) with any field overridden, e.g. preset("tiny", variant="mag")."""
        if name not in PRESETS:
            raise ValueError(
                f"TitansConfig: unknown preset {name!r}; choose from {sorted(PRESETS)}"
                + did_you_mean(name, PRESETS)
            )
        return cls(**{**PRESETS[name], "name": name, **overrides})


# Fields whose default changed the model's computation when they were added, and the value that keeps the
# computation of a model saved before them (`TitansConfig.from_saved_dict`).
SAVED_WITHOUT: dict[str, Any] = {"mac_norm_memory_input": False, "mac_memory_residual": False}

# One line per field, for listings (`titans train --list-fields` shows them as model.<field>).
FIELD_HELP: dict[str, str] = field_help(TitansConfig)


# Paper scales use a 32K vocabulary (Llama-2 style) and are sized for the default variant, mac (the
# baselines at the same preset are smaller: `titans presets` prints every count). Small presets train on
# 2 CPU cores in minutes.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        dim=128,
        depth=2,
        heads=4,
        segment_len=64,
        window=64,
        chunk_size=16,
        persistent_tokens=4,
        memory_expansion=2.0,
    ),
    "small": dict(dim=256, depth=4, heads=4, segment_len=128, window=128, chunk_size=16, persistent_tokens=4),
    "base": dict(dim=384, depth=6, heads=6, segment_len=256, window=256, chunk_size=32, persistent_tokens=8),
    "170M": dict(
        vocab_size=32000,
        dim=768,
        depth=12,
        heads=12,
        segment_len=512,
        window=512,
        chunk_size=64,
        persistent_tokens=16,
    ),
    "340M": dict(
        vocab_size=32000,
        dim=1024,
        depth=15,
        heads=16,
        segment_len=512,
        window=512,
        chunk_size=64,
        persistent_tokens=16,
    ),
    "400M": dict(
        vocab_size=32000,
        dim=1024,
        depth=18,
        heads=16,
        segment_len=512,
        window=512,
        chunk_size=64,
        persistent_tokens=16,
    ),
    "760M": dict(
        vocab_size=32000,
        dim=1536,
        depth=16,
        heads=16,
        head_dim=96,
        segment_len=512,
        window=512,
        chunk_size=64,
        persistent_tokens=16,
    ),
}
