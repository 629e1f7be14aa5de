"""`TitansLM`: a causal language model built from Titans blocks.

    logits, state = model(tokens, state=None)     tokens: (B, T) int64 -> logits: (B, T, vocab)

Feeding a sequence in pieces and threading `state` gives the logits of one pass over the whole sequence,
at a cost per token that does not grow with context for the memory and sliding-window variants.

`model.gradient_checkpointing = True` (the attribute `transformers` sets;
`TrainConfig.gradient_checkpointing`) keeps, while training, only each block's input for the backward pass
and recomputes the block's forward there: activation memory of one block at a time, for one more forward
of the blocks.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from titans.layers.memory import MemoryState, MemoryStats, NeuralMemory
from titans.layers.norm import RMSNorm
from titans.layers.residual import is_residual_output
from titans.layers.state_tree import map_tensors
from titans.models import streaming
from titans.models.blocks import IdentityInitGate
from titans.models.config import TitansConfig
from titans.models.ids import check_token_dtype, check_token_ids
from titans.models.state import TitansState, config_differences
from titans.models.variants import make_block

# A CPU stream this long warns (once per process) if subnormal floats are not flushed to zero.
SUBNORMAL_WARNING_POSITION = 1 << 15
_warned_subnormals = False


def subnormals_flushed() -> bool:
    """Whether this thread flushes subnormal floats to zero (`torch.set_flush_denormal(True)`)."""
    return torch.tensor(1e-40).mul(1.0).item() == 0.0


def _warn_if_subnormals_kept(device: torch.device, position: int) -> None:
    """Memory weights that get no writes decay into subnormal floats, which x86 CPUs process many times
    slower: without flushing, a long stream slows down as it goes. The `titans` commands flush them."""
    global _warned_subnormals
    if device.type != "cpu" or position < SUBNORMAL_WARNING_POSITION or _warned_subnormals:
        return
    _warned_subnormals = True
    if not subnormals_flushed():
        warnings.warn(
            f"TitansLM: a CPU stream passed {position:,} tokens with subnormal floats kept. Memory weights "
            "that get no writes decay into subnormals, which slow the stream down as it goes (3.9x by 200K "
            "tokens for tiny MAC). Call torch.set_flush_denormal(True) at the start of the program, before "
            "any other torch work.",
            RuntimeWarning,
            stacklevel=3,
        )


@dataclass
class LMOutput:
    """What `TitansLM.forward_with_stats` returns: logits (B, T, vocab), the new state, and the stats of
    every memory call (per memory layer, per MAC segment piece)."""

    logits: Tensor
    state: TitansState
    stats: list[MemoryStats]

    @property
    def write_rate(self) -> float:
        """The fraction of the memory's (layer, row, head, token) entries written in this call (NaN without
        a memory); per layer and head: `titans.models.monitor.memory_report`."""
        written = [s.written for s in self.stats if s.written is not None and s.written.numel()]
        if not written:
            return float("nan")
        return sum(int(w.sum()) for w in written) / sum(w.numel() for w in written)


class TitansLM(nn.Module):
    def __init__(self, config: TitansConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(make_block(config, i) for i in range(config.depth))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        # recompute each block's forward in the backward pass (while training with gradients), keeping only
        # the blocks' inputs: the name and meaning `transformers` gives it (its
        # `gradient_checkpointing_enable` sets it on every module that has it)
        self.gradient_checkpointing = False

    def reset_parameters(self) -> None:
        """GPT-style init: N(0, init_std) for embeddings and projections, the projections into the residual
        stream (marked by their layers, `titans.layers.residual`) scaled by 1 / sqrt(2 depth).

        The neural memory's gate biases and initial weights keep their own initialisation, and MAC's
        identity-initialised output gate its zeros.
        """
        std = self.config.init_std
        memory_gates = {id(m.to_gates) for m in self.modules() if isinstance(m, NeuralMemory)}
        for module in self.modules():
            if isinstance(module, nn.Linear) and id(module) not in memory_gates:
                scale = (2 * self.config.depth) ** -0.5 if is_residual_output(module) else 1.0
                nn.init.normal_(module.weight, std=std * scale)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
        for module in self.modules():  # modules whose own init is part of their definition
            if isinstance(module, IdentityInitGate):
                module.reset_parameters()

    def compile_blocks(self, **options) -> None:
        """Compile each block's forward with `torch.compile` (`options` are its arguments), in place:
        regional compilation, as torchtitan does. Blocks of one type share their compiled code, so a model
        compiles about as fast as one block; parameter names and checkpoints are unchanged. The memory's
        Triton kernels are custom ops the compiled code calls as they are, with the work around them fused
        (on GPUs the many small element-wise kernels of MAC's segment loop)."""
        for block in self.blocks:
            block.compile(**options)

    def _checkpointed(self, block: nn.Module, x: Tensor, state, stats: list[MemoryStats] | None):
        """block(x, state, stats) with its activations recomputed in the backward pass: by torch's
        non-reentrant checkpoint (gradients reach x, the parameters and the incoming state's tensors; the
        outputs, the new state's included, are the plain call's), or by the function `transformers` set
        (its `activation_checkpointing_enable` options). `stats` gets the forward's entries once, not the
        recomputation's."""
        # a block draws no random numbers: no RNG state to save and restore (nor read in a CUDA graph capture)
        checkpoint = getattr(self, "_gradient_checkpointing_func", None) or functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False, preserve_rng_state=False
        )
        ran = []

        def run(x: Tensor, state):
            local = None if stats is None else []
            out = block(x, state, local)
            if stats is not None and not ran:
                stats.extend(local)
            ran.append(True)
            return out

        return checkpoint(run, x, state)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.embed.weight.numel()
        return n

    @property
    def config_dict(self) -> Mapping:
        """`config.to_dict()`, built once and read-only: every returned state carries this one mapping (one
        state per decoded token), so no state may change it under the others."""
        if getattr(self, "_config_dict", None) is None:
            self._config_dict = MappingProxyType(self.config.to_dict())
        return self._config_dict

    def __getstate__(self) -> dict:
        """Pickled (or deep-copied) without the `config_dict` view, which does not pickle and is rebuilt
        when next read: a model that has run pickles as a fresh one does (the server's worker processes get
        the model so)."""
        state = dict(super().__getstate__())
        state.pop("_config_dict", None)
        return state

    def check_state(self, state: TitansState, batch_size: int | None = None) -> None:
        """Refuse a state from a model with another configuration, naming the fields that differ, or (given
        `batch_size`) one for another number of sequences."""
        if not isinstance(state, TitansState):
            raise TypeError(f"TitansLM: state must be a TitansState, got {type(state).__name__}")
        mine = self.config_dict
        if state.config is not None and state.config is not mine:
            # fields that change neither the state's layout nor the outputs are left out (name, init_std,
            # memory_backend, ...: `titans.models.state.STATE_NEUTRAL_FIELDS`)
            diff = config_differences(mine, state.config)
            if diff:
                detail = ", ".join(
                    f"{k}: state {state.config.get(k)!r} vs model {mine.get(k)!r}" for k in diff
                )
                raise ValueError(f"TitansLM: state belongs to a model with another config ({detail})")
        if len(state.layers) != len(self.blocks):
            raise ValueError(
                f"TitansLM: state has {len(state.layers)} layers, this model has {len(self.blocks)}"
            )
        for block, layer in zip(self.blocks, state.layers):
            # the memory's weights are in its parameters' dtype (under autocast too); MAC reads them before
            # its memory's own check would run. (The device is checked when the state is used: a state may
            # be loaded onto another device than the model's, to be looked at.)
            memory = getattr(block, "memory", None)
            held = layer if isinstance(layer, MemoryState) else getattr(layer, "memory", None)  # LMM: itself
            if memory is None or held is None or not held.weights:
                continue
            got, like = held.weights[0], memory.init_weights[0]
            if got.dtype != like.dtype:
                raise ValueError(
                    f"TitansLM: the state's memory weights are {got.dtype}, this model's {like.dtype}: cast "
                    f"the state to the model's dtype (titans.inference.map_state) or the model to the state's"
                )
        if batch_size is not None:
            sizes: set[int] = set()  # every state tensor is batch-first
            map_tensors(state.layers, lambda t: sizes.add(t.shape[0]) or t)
            if sizes - {batch_size}:
                got = " and ".join(str(n) for n in sorted(sizes))
                raise ValueError(
                    f"TitansLM: the state is for batch size {got}, the tokens have batch size {batch_size}: "
                    "continue each batch of sequences with its own state"
                )

    def generate(self, prompt: Tensor, max_new_tokens: int, **kwargs) -> Tensor:
        """Sample continuations of a batch of prompts (B, T); see `titans.models.streaming.generate` (also
        `titans.inference.generate`)."""
        return streaming.generate(self, prompt, max_new_tokens, **kwargs)

    def forward(
        self,
        tokens: Tensor,
        state: TitansState | None = None,
        last_only: bool = False,
    ) -> tuple[Tensor, TitansState]:
        """tokens (B, T) -> (logits (B, T, vocab), state). ``last_only``: logits of the last position only,
        (B, 1, vocab), which spares the output head on the rest (prefill). For the memory's stats as well,
        use `forward_with_stats`."""
        out = self._forward(tokens, state, None, last_only)
        return out.logits, out.state

    def forward_with_stats(
        self, tokens: Tensor, state: TitansState | None = None, last_only: bool = False
    ) -> LMOutput:
        """`forward`, with the `MemoryStats` of every memory call (per memory layer, per MAC segment
        piece): tokens (B, T) -> LMOutput(logits, state, stats)."""
        return self._forward(tokens, state, [], last_only)

    def _forward(
        self, tokens: Tensor, state: TitansState | None, stats: list[MemoryStats] | None, last_only: bool
    ) -> LMOutput:
        if not isinstance(tokens, Tensor) or tokens.dim() != 2:
            shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"TitansLM: tokens must be a (batch, seq) tensor, got {shape}")
        if not tokens.shape[0]:  # the memory's state has a row per sequence: none to keep
            raise ValueError(
                f"TitansLM: tokens must hold at least one sequence, got shape {tuple(tokens.shape)}"
            )
        check_token_dtype(tokens)
        # (a host sync; skipped while a CUDA graph is captured, whose caller checks each batch instead)
        if not (tokens.is_cuda and torch.cuda.is_current_stream_capturing()):
            check_token_ids(tokens, self.config.vocab_size)
        if state is not None:
            self.check_state(state, tokens.shape[0])
        layer_states = state.layers if state is not None else [None] * len(self.blocks)
        x = self.embed(tokens.long())
        new_states = []
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block, s in zip(self.blocks, layer_states):
            x, s = self._checkpointed(block, x, s, stats) if recompute else block(x, s, stats)
            new_states.append(s)
        if last_only:
            x = x[:, -1:]
        logits = self.head(self.norm(x))
        position = (state.position if state is not None else 0) + tokens.shape[1]
        _warn_if_subnormals_kept(tokens.device, position)
        return LMOutput(logits, TitansState(new_states, position, self.config_dict), stats)


__all__ = [
    "LMOutput",
    "TitansLM",
    "TitansState",
    "subnormals_flushed",
]
