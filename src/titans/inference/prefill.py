"""Chunked prefill: read a prompt of any length (a million tokens and beyond) piece by piece.

    logits, state = prefill(model, tokens, state=None, piece_len=None)

The functions live in `titans.models.streaming` (`TitansLM.generate` builds on them); this module is
their home in the inference API.
"""

from titans.models.streaming import default_piece_len, iter_pieces, prefill

__all__ = ["default_piece_len", "iter_pieces", "prefill"]
