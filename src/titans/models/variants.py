"""The registry of model variants: what each variant's blocks are, and every fact about a variant that code
elsewhere needs (docs/design.md, "The variants"). Code that depends on the variant asks its `Variant` here
rather than comparing names.

    spec = VARIANT_SPECS[config.variant]
    spec.memory, spec.quadratic, spec.streaming_unit(config), spec.make_block(config, layer)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from titans.layers.attention import AttentionState
from titans.layers.memory import MemoryState
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

if TYPE_CHECKING:  # the config validates against this registry
    from titans.models.config import TitansConfig


@dataclass(frozen=True)
class Variant:
    """One model variant.

    block: the block class of a layer with memory (memory variants) or of every layer (baselines).
    state_type: the streaming state of that block.
    window_field: the config field that sets the window of the variant's sliding-window attention blocks
        (the baseline's blocks, or a memory variant's blocks without memory; None: full attention).
    memory: the variant's blocks carry a neural memory (`TitansConfig.memory_layers` picks which).
    quadratic: its attention is full causal attention (time and KV cache grow with the context).
    attention: the memory block attends (and so has persistent tokens).
    segmented: the memory is written segment by segment (MAC): `chunk_size` must divide `segment_len`,
        and a stream is cut at multiples of both.
    legacy_states: other names a state file may give this block's state (same fields), read as
        `state_type`: a MAL layer's state is written as "MALState"; format-1 files may also name it
        "MAGState" (the fields of both are the same), and those load as MALState.
    """

    name: str
    block: type[Block]
    state_type: type
    window_field: str | None
    memory: bool
    quadratic: bool = False
    attention: bool = True
    segmented: bool = False
    legacy_states: tuple[str, ...] = ()

    def window(self, cfg: TitansConfig) -> int | None:
        return None if self.window_field is None else getattr(cfg, self.window_field)

    def make_block(self, cfg: TitansConfig, layer: int) -> Block:
        """The block of layer `layer` of a model with config `cfg`."""
        if not cfg.has_memory(layer):
            return AttentionBlock(cfg, self.window(cfg))
        return self.block(cfg)

    def streaming_unit(self, cfg: TitansConfig) -> int:
        """Tokens a stream is best cut at multiples of (chunk_size, and segment_len where segmented)."""
        return math.lcm(cfg.chunk_size, cfg.segment_len if self.segmented else 1)


VARIANT_SPECS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("mac", MACBlock, MACState, "segment_len", memory=True, segmented=True),
        Variant("mag", MAGBlock, MAGState, "window", memory=True),
        Variant("mal", MALBlock, MALState, "window", memory=True, legacy_states=("MAGState",)),
        Variant("lmm", MemoryBlock, MemoryState, "window", memory=True, attention=False),
        Variant("transformer", AttentionBlock, AttentionState, None, memory=False, quadratic=True),
        Variant("swa", AttentionBlock, AttentionState, "window", memory=False),
    )
}


def make_block(cfg: TitansConfig, layer: int) -> Block:
    return VARIANT_SPECS[cfg.variant].make_block(cfg, layer)


def upgrade_layer_states(layers: list, config: Mapping | None) -> list:
    """Per-layer states read from a state file, each in its block's state type: a layer state saved under
    one of its variant's `legacy_states` names becomes that variant's `state_type` (same fields)."""
    spec = VARIANT_SPECS.get(config.get("variant")) if isinstance(config, Mapping) else None
    if spec is None or not spec.legacy_states:
        return layers
    return [
        spec.state_type(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)})
        if type(s).__name__ in spec.legacy_states
        else s
        for s in layers
    ]


__all__ = ["VARIANT_SPECS", "Variant", "make_block", "upgrade_layer_states"]
