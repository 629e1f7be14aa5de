"""`TitansHFConfig`: a `transformers` config that carries a `TitansConfig` (model_type "titans")."""

from __future__ import annotations

from typing import Any

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers < 5 spells it PretrainedConfig
    from transformers import PretrainedConfig as PreTrainedConfig

from titans.models.config import TitansConfig


class TitansHFConfig(PreTrainedConfig):
    """The `TitansConfig` dict under `titans`, mirrored into the standard attribute names
    (vocab_size, hidden_size, num_hidden_layers, num_attention_heads, tie_word_embeddings).

    Build with `TitansHFConfig(titans=TitansConfig(...).to_dict(), eos_token_id=...)` or
    `TitansHFConfig.from_titans(cfg)`.
    """

    model_type = "titans"

    def __init__(self, titans: dict[str, Any] | None = None, **kwargs: Any):
        cfg = TitansConfig.from_saved_dict(dict(titans)) if titans is not None else TitansConfig()
        self.titans = cfg.to_dict()
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.dim
        self.num_hidden_layers = cfg.depth
        self.num_attention_heads = cfg.heads
        kwargs["tie_word_embeddings"] = cfg.tie_embeddings
        # derived values come from `titans`; a stale copy in a saved config.json must not override them
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            kwargs.pop(key, None)
        super().__init__(**kwargs)

    @classmethod
    def from_titans(cls, config: TitansConfig, **kwargs: Any) -> TitansHFConfig:
        return cls(titans=config.to_dict(), **kwargs)

    def to_titans(self) -> TitansConfig:
        return TitansConfig.from_dict(dict(self.titans))


__all__ = ["TitansHFConfig"]
