"""Inference: learning at test time in practice.

- `prefill(model, tokens, state=None, piece_len=None)`: read a prompt of any length (or a stream of pieces)
  with memory bounded by the state.
- `generate(model, prompt, max_new_tokens, ...)`: sampling / greedy decoding through the streaming state;
  `on_token` and `IncrementalDecoder` stream the text as it is generated.
- `save_state(state, path)` / `load_state(path)` / `map_state(state, fn)`: the state as a value to keep.
- `memory_report(model, stats, state)` / `prefill_with_report(model, tokens, state)`: the memory's monitoring
  numbers (surprise, write rate, ||W|| against a max norm, gates) per layer and head.
- `MemorySession(model, ...)`: one reader's memory in operation: read, generate, freeze, rollback, a guard
  against harmful writes, and bytes to persist it (`titans.inference.session`).
"""

from titans.inference.generation import IncrementalDecoder, decode_step, generate, sample_next
from titans.inference.session import MemorySession, ReadResult, SessionEvent, SessionFormatError, SnapshotInfo
from titans.models.monitor import MemoryMonitor, MemoryReport, memory_report, prefill_with_report
from titans.models.state import (
    StateFileError,
    cat_rows,
    expand_state,
    load_state,
    map_state,
    read_state_header,
    save_state,
    select_rows,
    state_batch_size,
    state_nbytes,
    state_tensors,
)
from titans.models.streaming import default_piece_len, iter_pieces, prefill

__all__ = [
    "IncrementalDecoder",
    "MemoryMonitor",
    "MemoryReport",
    "MemorySession",
    "ReadResult",
    "SessionEvent",
    "SessionFormatError",
    "SnapshotInfo",
    "StateFileError",
    "cat_rows",
    "decode_step",
    "default_piece_len",
    "expand_state",
    "generate",
    "iter_pieces",
    "load_state",
    "map_state",
    "memory_report",
    "prefill",
    "prefill_with_report",
    "read_state_header",
    "sample_next",
    "save_state",
    "select_rows",
    "state_batch_size",
    "state_nbytes",
    "state_tensors",
]
