"""Titans causal language models: configuration, the variant registry, blocks, the LM and its state."""

from titans.models.config import MEMORY_VARIANTS, PRESETS, VARIANTS, TitansConfig
from titans.models.lm import LMOutput, TitansLM
from titans.models.state import TitansState
from titans.models.variants import VARIANT_SPECS, Variant

__all__ = [
    "MEMORY_VARIANTS",
    "PRESETS",
    "VARIANTS",
    "VARIANT_SPECS",
    "LMOutput",
    "TitansConfig",
    "TitansLM",
    "TitansState",
    "Variant",
]
