"""Titans: sequence models with a neural long-term memory that keeps learning at test time."""

from titans.layers.memory import MemoryState, MemoryStats, NeuralMemory
from titans.models import PRESETS, VARIANTS, TitansConfig, TitansLM, TitansState

__version__ = "0.1.0"
__all__ = [
    "PRESETS",
    "VARIANTS",
    "MemoryState",
    "MemoryStats",
    "NeuralMemory",
    "TitansConfig",
    "TitansLM",
    "TitansState",
]
