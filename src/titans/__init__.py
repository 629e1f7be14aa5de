"""Titans: sequence models with a neural long-term memory that keeps learning at test time."""

from titans.layers.memory import MemoryState, MemoryStats, NeuralMemory

__version__ = "0.1.0"
__all__ = ["MemoryState", "MemoryStats", "NeuralMemory"]
