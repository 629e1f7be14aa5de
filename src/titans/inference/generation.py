"""Autoregressive generation through the streaming state.

    out = generate(model, prompt, max_new_tokens=50, temperature=0.8, top_k=50)    # (B, T + n)

The prompt is read with chunked prefill, then each new token goes through the model alone, threading the
state: the cost per token is constant for the memory and sliding-window variants (the memory learns from
the generated tokens too, exactly as it would had they been in the prompt).

Batches: all prompts of a batch have the same length (Titans states are per-row streams at one
position; there is no padding). Generate rows of different lengths in separate calls.

The decoding loop lives in `titans.models.streaming` (`TitansLM.generate` is the same call).
"""

from __future__ import annotations

from titans.models.streaming import decode_step, generate, sample_next

__all__ = ["decode_step", "generate", "sample_next"]
