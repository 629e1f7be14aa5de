"""Titans: sequence models with a neural long-term memory that keeps learning at test time."""

__version__ = "0.1.0"

try:  # the layers land one by one; keep the package importable while they do
    from titans.layers.memory import MemoryState, NeuralMemory
except ImportError:  # pragma: no cover
    pass

__all__ = ["MemoryState", "NeuralMemory"]
