"""`TrainConfig`: one training run as data — a JSON file plus command-line overrides.

    cfg = TrainConfig.from_file("configs/main.json", overrides={"steps": 100, "model.dim": 128})

Overrides use dotted keys for the model (``model.dim=128`` overrides one `TitansConfig` field of the
preset). Unknown keys are errors that name them. The defaults train a small MAC (preset "tiny", ~0.7M
parameters) on the Python standard library with the byte tokenizer, on CPU, out of the box. Precision:
``dtype="auto"`` is bf16 autocast on CUDA (the loss in float32) and float32 on CPU.

Resuming: fields in ``RESUMABLE_CHANGES`` may differ between a run and its resume; any other difference
is refused, naming the field (``TrainConfig.resume_mismatches``).

Optimizer (paper §5.1): AdamW, peak lr 4e-4, linear warmup then cosine decay to ``min_lr_ratio * lr``,
weight decay 0.1, gradient clipping at 1.0. Weight decay applies to the weight matrices of linear and
convolution layers only; never to embeddings (and the head tied to them), norms, biases, gate scalars,
persistent-memory tokens or the memory's learned initial weights W_0 (decaying W_0 would pull the memory
toward an empty start for no modelling reason).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from titans.models.config import PRESETS, VARIANTS, TitansConfig, read_json_object

DTYPES = ("auto", "float32", "bfloat16")

# Fields that may change between a run and its resume: they do not change what is learned from which data
# (logging, budgets, where to write). `steps`/`tokens` may grow to extend a run (the cosine schedule is then
# recomputed for the new total from the resumed step on). Every other field must match the checkpoint.
RESUMABLE_CHANGES = frozenset(
    {
        "steps", "tokens", "time_budget_min", "log_every", "eval_every", "ckpt_every", "keep_last", "run_dir",
        "device", "dtype", "threads", "grad_accum", "progress", "tensorboard", "cache_dir", "eval_windows",
        "eval_batch_size", "sample_tokens", "sample_prompt", "sample_temperature", "sample_top_k", "plot",
        "cuda_graphs",
    }
)  # fmt: skip


@dataclass
class TrainConfig:
    """Everything that defines a training run. ``batch_size`` is the global batch (all ranks together);
    ``steps`` is the number of optimizer steps, or ``tokens`` a token budget that sets it."""

    # model
    preset: str = "tiny"
    variant: str = "mac"
    model: dict[str, Any] = field(default_factory=dict)  # TitansConfig field overrides
    # data
    data: str = "builtin:stdlib"
    tokenizer: str = "bytes"
    text_field: str = "text"
    heldout_fraction: float = 0.01
    cache_dir: str | None = None
    seq_len: int = 256
    batch_size: int = 16
    grad_accum: int = 1  # micro-batches per rank per step (same global batch, less memory)
    # length of the run
    steps: int = 1000
    tokens: int | None = None  # token budget; when set, steps = ceil(tokens / (batch_size * seq_len))
    time_budget_min: float | None = None  # stop cleanly (with a checkpoint) after this many minutes
    # optimizer (AdamW, cosine with warmup)
    lr: float = 4e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    # runtime
    seed: int = 0
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, float32 on CPU
    fsdp: bool = False
    # replay each micro-step (forward, loss, backward) as one CUDA graph: one process on one GPU; the memory
    # variants' many small kernels then cost no per-launch CPU time (training/cuda_graphs.py)
    cuda_graphs: bool = False
    threads: int | None = None  # torch CPU threads of this process (None: torch's default, one per core)
    # bookkeeping
    run_dir: str = "runs/main"
    log_every: int = 10
    eval_every: int = 200
    eval_windows: int = 32
    eval_batch_size: int = 8
    ckpt_every: int = 500
    keep_last: int = 3
    progress: bool = True
    tensorboard: bool = True
    plot: bool = True
    # sample printed at the end of training (0: none)
    sample_tokens: int = 200
    sample_prompt: str = "def "
    sample_temperature: float = 0.8
    sample_top_k: int | None = 40

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(
                f"TrainConfig.preset: unknown preset {self.preset!r}; choose from {sorted(PRESETS)}"
            )
        if self.variant not in VARIANTS:
            raise ValueError(f"TrainConfig.variant must be one of {VARIANTS}, got {self.variant!r}")
        if not isinstance(self.model, dict):
            raise ValueError(
                f"TrainConfig.model must be a dict of TitansConfig overrides, got {self.model!r}"
            )
        known = {f.name for f in fields(TitansConfig)}
        unknown = sorted(set(self.model) - known)
        if unknown:
            raise ValueError(f"TrainConfig.model: unknown TitansConfig field(s) {unknown}")
        if "variant" in self.model:
            raise ValueError("TrainConfig.model: set the variant with the top-level 'variant' field")
        positive = ("seq_len", "batch_size", "grad_accum", "steps", "log_every", "eval_every", "ckpt_every",
                    "keep_last", "eval_windows", "eval_batch_size")  # fmt: skip
        for name in positive:
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {val!r}")
        if self.tokens is not None and (not isinstance(self.tokens, int) or self.tokens < 1):
            raise ValueError(f"TrainConfig.tokens must be a positive integer or null, got {self.tokens!r}")
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"TrainConfig.grad_accum={self.grad_accum} must divide batch_size={self.batch_size}"
            )
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            raise ValueError(f"TrainConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.weight_decay < 0:
            raise ValueError(f"TrainConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"TrainConfig.grad_clip must be > 0 or null, got {self.grad_clip}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"TrainConfig.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if self.time_budget_min is not None and not self.time_budget_min > 0:
            raise ValueError(f"TrainConfig.time_budget_min must be > 0 or null, got {self.time_budget_min}")
        if self.dtype not in DTYPES:
            raise ValueError(f"TrainConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"TrainConfig.cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        if self.cuda_graphs and self.fsdp:
            raise ValueError("TrainConfig.cuda_graphs: not with fsdp (its collectives run outside the graph)")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"TrainConfig.threads must be a positive integer or null, got {self.threads!r}")
        if self.sample_tokens < 0:
            raise ValueError(f"TrainConfig.sample_tokens must be >= 0, got {self.sample_tokens}")

    # ------------------------------------------------------------------------------------- derived
    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run (from the token budget when one is set)."""
        if self.tokens is not None:
            return math.ceil(self.tokens / (self.batch_size * self.seq_len))
        return self.steps

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def model_config(self, vocab_size: int) -> TitansConfig:
        """The preset with the variant and overrides applied; the vocabulary follows the tokenizer unless
        the overrides set a larger one (e.g. padded to a multiple of 64)."""
        overrides = dict(self.model)
        vocab = int(overrides.pop("vocab_size", vocab_size))
        if vocab < vocab_size:
            raise ValueError(
                f"TrainConfig.model.vocab_size={vocab} is smaller than the tokenizer's vocabulary "
                f"({vocab_size})"
            )
        return TitansConfig.preset(self.preset, variant=self.variant, vocab_size=vocab, **overrides)

    def resume_mismatches(self, saved: dict[str, Any]) -> list[str]:
        """Fields (``model.X`` for model overrides) that differ from a checkpoint's config and matter."""
        mine = self.to_dict()
        diff = [k for k in set(mine) | set(saved) if k not in RESUMABLE_CHANGES | {"model"}
                and mine.get(k) != saved.get(k)]  # fmt: skip
        mine_model, saved_model = mine["model"], saved.get("model") or {}
        diff += [f"model.{k}" for k in set(mine_model) | set(saved_model)
                 if mine_model.get(k) != saved_model.get(k)]  # fmt: skip
        return sorted(diff)

    # ------------------------------------------------------------------------------------ file i/o
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        if not isinstance(data, dict):
            raise ValueError(f"TrainConfig: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"TrainConfig: unknown field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_file(
        cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None
    ) -> TrainConfig:
        """Defaults, then the JSON file (if any), then ``overrides`` ({"key": v, "model.field": v})."""
        data: dict[str, Any] = {}
        if path is not None:
            data = read_json_object(path, "TrainConfig")
            data.pop("_comment", None)  # configs may carry a human note
            unknown = sorted(set(data) - {f.name for f in fields(cls)})
            if unknown:
                raise ValueError(f"TrainConfig: unknown field(s) {unknown} in {str(path)!r}")
        return cls.from_dict(apply_overrides(data, overrides or {}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``data`` with ``overrides`` applied; ``model.X`` keys go into the model overrides."""
    out = dict(data)
    out["model"] = dict(out.get("model") or {})
    known = {f.name for f in fields(TrainConfig)}
    model_fields = {f.name for f in fields(TitansConfig)}
    for key, value in overrides.items():
        if key.startswith("model."):
            name = key[len("model.") :]
            if name not in model_fields:
                raise ValueError(f"unknown override {key!r}: TitansConfig has no field {name!r}")
            out["model"][name] = value
        elif key in known:
            out[key] = value
        else:
            raise ValueError(f"unknown override {key!r}; known fields: {sorted(known)} (or model.<field>)")
    return out


def parse_set(items: list[str]) -> dict[str, Any]:
    """``["steps=100", "model.dim=64", "data=foo.txt"]`` -> {key: value}; values are JSON when they parse
    as JSON (numbers, true/false/null, lists), else strings."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects key=value, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key.strip()] = value
    return out
