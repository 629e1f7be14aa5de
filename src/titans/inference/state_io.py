"""Saving, loading and mapping a `TitansState`: the names of `titans.models.state`, where the state and
its file format (described there) live, under their inference-API home."""

from titans.models.state import (
    FORMAT_VERSION,
    STATE_TYPES,
    StateFileError,
    expand_state,
    load_state,
    map_state,
    read_state_header,
    register_state_type,
    save_state,
    select_rows,
    state_batch_size,
    state_from_bytes,
    state_nbytes,
    state_tensors,
    state_to_bytes,
)

__all__ = [
    "FORMAT_VERSION",
    "STATE_TYPES",
    "StateFileError",
    "expand_state",
    "load_state",
    "map_state",
    "read_state_header",
    "register_state_type",
    "save_state",
    "select_rows",
    "state_batch_size",
    "state_from_bytes",
    "state_nbytes",
    "state_tensors",
    "state_to_bytes",
]
