"""Titans causal language models: configuration, blocks, and the LM."""

from titans.models.config import PRESETS, VARIANTS, TitansConfig
from titans.models.lm import TitansLM, TitansState

__all__ = ["PRESETS", "VARIANTS", "TitansConfig", "TitansLM", "TitansState"]
