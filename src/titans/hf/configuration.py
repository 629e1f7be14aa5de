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
        self.titans = cfg.to_dict()  # and the mirrored names (the setter)
        kwargs["tie_word_embeddings"] = cfg.tie_embeddings
        # derived values come from `titans`; a stale copy in a saved config.json must not override them
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            kwargs.pop(key, None)
        super().__init__(**kwargs)

    # the standard names mirrored from `titans` (the model is built from `titans` alone)
    MIRRORS = {
        "vocab_size": "vocab_size",
        "hidden_size": "dim",
        "num_hidden_layers": "depth",
        "num_attention_heads": "heads",
        "tie_word_embeddings": "tie_embeddings",
    }

    @property
    def titans(self) -> dict[str, Any]:
        """The `TitansConfig` dict the model is built from; setting it sets the mirrored names too."""
        return self.__dict__["titans"]

    @titans.setter
    def titans(self, value: dict[str, Any]) -> None:
        self.__dict__["titans"] = value  # in __dict__: transformers serialises the config from it
        for name, field in self.MIRRORS.items():
            if field in value:
                setattr(self, name, value[field])

    def check_mirrors(self) -> None:
        """Refuse a mirrored name set to a value `titans` does not hold (``from_pretrained(path,
        num_hidden_layers=1)``, ``config.vocab_size = 500``): the model is built from `titans`, so it was
        ignored and the config then misdescribed the model."""
        for name, field in self.MIRRORS.items():
            value, want = getattr(self, name, None), self.titans.get(field)
            if value is not None and value != want:
                raise ValueError(
                    f"TitansHFConfig: {name}={value!r} disagrees with titans[{field!r}]={want!r}; the model "
                    f"is built from config.titans: for {value!r}, set a new dict, config.titans = "
                    f"{{**config.titans, {field!r}: {value!r}}} (the mirrored names follow it), or for "
                    f"{want!r} set {name} = {want!r}"
                )

    @classmethod
    def from_titans(cls, config: TitansConfig, **kwargs: Any) -> TitansHFConfig:
        return cls(titans=config.to_dict(), **kwargs)

    def to_titans(self) -> TitansConfig:
        return TitansConfig.from_dict(dict(self.titans))


__all__ = ["TitansHFConfig"]
