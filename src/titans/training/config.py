"""`TrainConfig`: one training run as data — a JSON file plus command-line overrides.

    cfg = TrainConfig.from_file("configs/main.json", overrides={"steps": 100, "model.dim": 128})

Overrides use dotted keys for the model (``model.dim=128`` overrides one `TitansConfig` field of the
preset). Unknown keys are errors that name them. Every value is checked against its field's declared type
(``titans.training.fields``): ``--set`` text is parsed as that type (``parse_set``), JSON values must
already have it; ``titans train --list-fields`` prints every field with its type, default and meaning.

The defaults train a small MAC (preset "tiny", ~0.7M parameters) on the Python standard library with the
byte tokenizer, on CPU, out of the box. Precision:
``dtype="auto"`` is bf16 autocast on CUDA (the loss in float32) and float32 on CPU; on CUDA ``tf32`` (on by
default) lets float32 matrix products use TF32 tensor cores, the memory kernels' dots among them.

Resuming: fields in ``RESUMABLE_CHANGES`` may differ between a run and its resume; any other difference
is refused, naming the field (``TrainConfig.resume_mismatches``). The model is compared as the resulting
`TitansConfig` (preset, variant and ``model`` overrides applied), not as the overrides that produced it.

Optimizer (paper §5.1): AdamW, peak lr 4e-4, linear warmup then a cosine decay toward
``min_lr_ratio * lr`` (reached at step ``total_steps``, one past the last step:
``titans.training.optim.lr_factor``), weight decay 0.1, gradient clipping at 1.0. Weight decay applies to
the weight matrices of linear and convolution layers only; never to embeddings (and the head tied to
them), norms, biases, gate scalars, persistent-memory tokens or the memory's learned initial weights W_0
(decaying W_0 would pull the memory toward an empty start for no modelling reason).
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, Field, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from titans._fs import write_text_atomic
from titans.data.loader import check_curriculum
from titans.data.tokenizers import TOKENIZER_HELP
from titans.models.config import FIELD_HELP as MODEL_FIELD_HELP
from titans.models.config import PRESETS, VARIANTS, TitansConfig, read_json_object
from titans.runtime.loading import DEFAULT_TOKENIZER
from titans.runtime.sampling import SAMPLING
from titans.training.fields import check_field_value, describe_fields, parse_field_text
from titans.validation import check_bounds, did_you_mean, field_help, option

# What --data and --tokenizer accept: the one text that `titans train --help` and `--list-fields` show.
DATA_HELP = (
    "text source: builtin:stdlib, builtin:prose, a file, folder, glob, .jsonl, hf:NAME[:CONFIG][:SPLIT], "
    "fasta:PATH or fasta:builtin (DNA)"
)
# Default sample prompts, the first one the tokenizer can encode: code for text tokenizers (the default
# data is Python source), bases for the DNA alphabet.
SAMPLE_PROMPTS = ("def ", "ACGT")

DTYPES = ("auto", "float32", "bfloat16")


def autocast_dtype_for(dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype a `TrainConfig.dtype` means on ``device``: bf16 for "bfloat16", and for "auto"
    on CUDA; none (float32) otherwise. The trainer trains, and `titans eval ppl` scores, by this rule."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


# Fields that may change between a run and its resume: they do not change what is learned from which data
# (logging, budgets, where to write). `steps`/`tokens` may grow to extend a run (the cosine schedule is then
# recomputed for the new total from the resumed step on). `fsdp` may switch on or off (the steps are the
# same; the trainer converts the optimizer state between the forms the two save). Every other field must
# match the checkpoint.
RESUMABLE_CHANGES = frozenset(
    {
        "steps", "tokens", "time_budget_min", "log_every", "eval_every", "ckpt_every", "keep_last", "run_dir",
        "device", "dtype", "threads", "grad_accum", "progress", "tensorboard", "cache_dir", "eval_windows",
        "eval_batch_size", "sample_tokens", "sample_prompt", "sample_temperature", "sample_top_k", "plot",
        "cuda_graphs", "compile", "tf32", "gradient_checkpointing", "fsdp",
    }
)  # fmt: skip


@dataclass
class TrainConfig:
    """Everything that defines a training run. ``batch_size`` is the global batch (all ranks together);
    ``steps`` is the number of optimizer steps, or ``tokens`` a token budget that sets it."""

    # model
    preset: str = option("tiny", help=f"model size preset: {', '.join(PRESETS)}")
    variant: str = option("mac", help=f"model variant: {', '.join(VARIANTS)}")
    model: dict[str, Any] = option(
        factory=dict,
        help="TitansConfig field overrides of the preset ({field: value}; --set model.<field>=...)",
    )
    # data
    data: str = option("builtin:stdlib", help=DATA_HELP)
    tokenizer: str = option(DEFAULT_TOKENIZER, help=TOKENIZER_HELP)
    text_field: str = option("text", help="the text field of .jsonl records and Hugging Face datasets")
    heldout_fraction: float = option(
        0.01, help="share of the documents held out for evaluation, in (0, 1)", above=0, below=1
    )
    cache_dir: str | None = option(
        None, help="where tokenized data is cached (null: the default cache folder)"
    )
    seq_len: int = option(256, help="training sequence length, tokens", min=1)
    batch_size: int = option(
        16, help="global batch, sequences per optimizer step (all ranks together)", min=1
    )
    grad_accum: int = option(
        1, help="micro-batches per rank per step (the same global batch in less memory)", min=1
    )
    # carry the model's state (the memory, attention caches) from each step's windows to the next step's,
    # which continue them in the stream, detached at the window boundary (truncated backprop through time;
    # `StreamBatches`): the model trains on memories that have read far more than seq_len tokens. The
    # state starts fresh every carry_reset_every visits of a lane (None: when a row reaches the end of its
    # lane). carry_groups: lanes per row, visited in turn (step s reads group s % carry_groups), so that
    # consecutive steps draw on different stretches of the stream; the trainer keeps a state per group
    carry_state: bool = option(
        False,
        help="carry the state (memory, caches) across consecutive windows of each row's stream, "
        "detached at window boundaries (truncated backprop through time)",
    )
    carry_reset_every: int | None = option(
        None,
        help="with carry_state: start from a fresh state every this many visits of a lane "
        "(null: at the end of each row's lane of the stream)",
        min=1,
    )
    carry_groups: int = option(
        1,
        help="with carry_state: lanes per row, visited in turn (consecutive steps read different "
        "stretches of the stream; one carried state per group)",
        min=1,
    )
    # a length curriculum: from step curriculum_steps[i] on, training windows of curriculum_seq_lens[i]
    # tokens, batch_size * seq_len // curriculum_seq_lens[i] of them (the tokens per step unchanged;
    # `CurriculumBatches`); held-out evaluation stays at seq_len
    curriculum_steps: list[int] = option(
        factory=list,
        help="steps at which the training window length changes (length curriculum; with "
        "curriculum_seq_lens)",
    )
    curriculum_seq_lens: list[int] = option(
        factory=list,
        help="the training window length from each of curriculum_steps on; the rows per step shrink so "
        "that a step holds batch_size * seq_len tokens",
    )
    # length of the run
    steps: int = option(1000, help="optimizer steps of the run", min=1)
    tokens: int | None = option(
        None, help="token budget; when set, steps = ceil(tokens / (batch_size * seq_len))", min=1
    )
    time_budget_min: float | None = option(
        None, help="stop cleanly, with a checkpoint, after this many minutes (--resume continues)", above=0
    )
    # optimizer (AdamW, cosine with warmup)
    lr: float = option(4e-4, help="peak learning rate (AdamW)", above=0)
    min_lr_ratio: float = option(
        0.1,
        help="the cosine schedule decays toward min_lr_ratio * lr, reached at step total_steps (one past "
        "the last step)",
        min=0,
        max=1,
    )
    warmup_steps: int = option(100, help="linear warm-up steps", min=0)
    weight_decay: float = option(
        0.1, help="AdamW weight decay of weight matrices (not embeddings, norms, biases, gates)", min=0
    )
    beta1: float = option(0.9, help="AdamW beta1, in [0, 1)", min=0, below=1)
    beta2: float = option(0.95, help="AdamW beta2, in [0, 1)", min=0, below=1)
    eps: float = option(1e-8, help="AdamW epsilon, > 0", above=0)
    grad_clip: float | None = option(1.0, help="gradient norm clipping (null: none)", above=0)
    # runtime
    seed: int = option(
        0, help="seed of the initial weights, the batch order and the sample", min=0, max=2**32 - 1
    )
    device: str = option("auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    dtype: str = option("auto", help=f"{', '.join(DTYPES)} (auto: bf16 autocast on CUDA, float32 on CPU)")
    # the memory runs in float32 under autocast; its Triton kernels' dots follow torch's TF32 flag, and in
    # full float32 they run without tensor cores (ops/memory/triton_chunk.py)
    tf32: bool = option(
        True, help="on CUDA, float32 matrix products (the memory kernels' too) use TF32 tensor cores"
    )
    fsdp: bool = option(False, help="shard the model with FSDP2 (under torchrun)")
    # replay each micro-step (forward, loss, backward) as one CUDA graph: one process on one GPU; the memory
    # variants' many small kernels then cost no per-launch CPU time (training/cuda_graphs.py)
    cuda_graphs: bool = option(False, help="replay each micro-step as a CUDA graph (one process, one GPU)")
    # regional torch.compile (`TitansLM.compile_blocks`): the first step compiles, for a minute or more
    compile: bool = option(False, help="compile each block with torch.compile (faster steps on GPUs)")
    # activation checkpointing (`TitansLM.gradient_checkpointing`): the same gradients, recomputed
    gradient_checkpointing: bool = option(
        False, help="recompute each block's forward in the backward pass (activations of one block kept)"
    )
    threads: int | None = option(
        None, help="torch CPU threads of this process (null: torch's default)", min=1
    )
    # bookkeeping
    run_dir: str = option("runs/main", help="where checkpoints, metrics, plots and the report go")
    log_every: int = option(
        10, help="log the training loss every this many steps (and at each checkpoint, if between)", min=1
    )
    eval_every: int = option(
        200, help="evaluate on held-out windows every this many steps (and at the end)", min=1
    )
    eval_windows: int = option(32, help="held-out windows per evaluation", min=1)
    eval_batch_size: int = option(8, help="held-out windows per forward pass", min=1)
    ckpt_every: int = option(500, help="checkpoint every this many steps (and at the end)", min=1)
    keep_last: int = option(3, help="checkpoints kept (older ones are deleted)", min=1)
    progress: bool = option(True, help="show a progress bar")
    tensorboard: bool = option(
        True, help="write TensorBoard logs to run_dir/tb (needs the tensorboard package)"
    )
    plot: bool = option(True, help="draw run_dir/loss.png at the end (needs matplotlib)")
    # sample printed at the end of training (0: none)
    sample_tokens: int = option(
        200, help="tokens of the sample printed at the end of training (0: none)", min=0
    )
    sample_prompt: str | None = option(
        None,
        help=f"prompt of that sample (null: the first of {list(SAMPLE_PROMPTS)} the tokenizer encodes); one "
        "the tokenizer cannot encode is refused before training",
    )
    sample_temperature: float = option(
        SAMPLING.temperature, help="sampling temperature of that sample (0: greedy)", min=0
    )
    sample_top_k: int | None = option(
        SAMPLING.top_k, help="sample from the k most likely tokens (null: all)", min=1
    )

    def __post_init__(self) -> None:
        for f in fields(self):  # the declared types first: the checks below compare numbers
            setattr(self, f.name, check_field_value(TrainConfig, f.name, getattr(self, f.name)))
        if self.preset not in PRESETS:
            raise ValueError(
                f"TrainConfig.preset: unknown preset {self.preset!r}; choose from {sorted(PRESETS)}"
                + did_you_mean(self.preset, PRESETS)
            )
        if self.variant not in VARIANTS:
            raise ValueError(
                f"TrainConfig.variant must be one of {VARIANTS}, got {self.variant!r}"
                + did_you_mean(self.variant, VARIANTS)
            )
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
        if "name" in self.model:  # the preset's name, which `TitansConfig.preset` sets itself
            raise ValueError(
                "TrainConfig.model: 'name' is the preset's name: choose it with the 'preset' field"
            )
        self.model = {
            k: check_field_value(TitansConfig, k, v, label=f"TrainConfig.model.{k}")
            for k, v in self.model.items()
        }
        check_bounds(self)
        if self.cache_dir is not None and not self.cache_dir.strip():  # "" / " ": a folder in the cwd
            raise ValueError("TrainConfig.cache_dir: an empty path; give a folder, or null for the default")
        if not self.run_dir.strip():  # "" would be the current folder: a run's files written among the user's
            raise ValueError("TrainConfig.run_dir: an empty path; give a folder (. for the current folder)")
        if self.carry_reset_every is not None and not self.carry_state:
            raise ValueError("TrainConfig.carry_reset_every applies with carry_state: true only")
        if self.carry_groups > 1 and not self.carry_state:
            raise ValueError("TrainConfig.carry_groups applies with carry_state: true only")
        if self.carry_state and self.cuda_graphs:
            raise ValueError("TrainConfig.cuda_graphs: not with carry_state (a graph replays a fresh state)")
        check_curriculum(self.batch_size, self.seq_len, self.curriculum_steps, self.curriculum_seq_lens)
        if self.curriculum_steps and self.carry_state:
            raise ValueError("TrainConfig.curriculum_steps: not with carry_state (lanes have one length)")
        if self.curriculum_steps and self.cuda_graphs:
            raise ValueError("TrainConfig.curriculum_steps: not with cuda_graphs (a graph has one shape)")
        for n in self.curriculum_seq_lens:
            rows = self.batch_size * self.seq_len // n
            if rows % self.grad_accum:
                raise ValueError(
                    f"TrainConfig.grad_accum={self.grad_accum} must divide the {rows} rows of a step with "
                    f"windows of {n} tokens"
                )
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"TrainConfig.grad_accum={self.grad_accum} must divide batch_size={self.batch_size}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"TrainConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"TrainConfig.cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        if self.cuda_graphs and self.fsdp:
            raise ValueError("TrainConfig.cuda_graphs: not with fsdp (its collectives run outside the graph)")

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
        """Fields that differ from a checkpoint's training config and matter. The model's fields
        (``preset``, ``variant``, ``model``) are left out: what matters is the model they make, which the
        trainer compares as a whole (``model_mismatches``)."""
        mine = self.to_dict()
        skip = RESUMABLE_CHANGES | MODEL_FIELDS
        # a field the checkpoint lacks was added since, with a default that trains as before
        added = {f.name: _default(f) for f in fields(self) if f.name in ADDED_FIELDS}
        saved = {**added, **saved}
        return sorted(k for k in set(mine) | set(saved) if k not in skip and mine.get(k) != saved.get(k))

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
        """Defaults, then the JSON file (if any), then ``overrides`` ({"key": v, "model.field": v}). A
        ``steps`` override replaces the file's ``tokens`` budget too (a token budget sets the steps)."""
        data: dict[str, Any] = {}
        if path is not None:
            data = read_json_object(path, "TrainConfig")
            data.pop("_comment", None)  # configs may carry a human note
            unknown = sorted(set(data) - {f.name for f in fields(cls)})
            if unknown:
                raise ValueError(f"TrainConfig: unknown field(s) {unknown} in {str(path)!r}")
        overrides = overrides or {}
        if "steps" in overrides and "tokens" not in overrides:  # a later budget replaces the file's one
            data.pop("tokens", None)
        return cls.from_dict(apply_overrides(data, overrides))

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")  # never half-written


def _default(f: Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


# TrainConfig fields added after runs were saved without them; their defaults train as those runs did
ADDED_FIELDS = frozenset(
    {"carry_state", "carry_reset_every", "carry_groups", "curriculum_steps", "curriculum_seq_lens"}
)

# TrainConfig fields that only say which model to build: compared on resume through the model they make
MODEL_FIELDS = frozenset({"preset", "variant", "model"})


def model_mismatches(mine: TitansConfig, saved: dict[str, Any]) -> list[str]:
    """``model.X: checkpoint A, now B`` for every field in which ``mine`` differs from a checkpoint's model
    config (a dict; fields added to TitansConfig since it was written take the values that compute what
    the saved model computed: `TitansConfig.from_saved_dict`)."""
    theirs = TitansConfig.from_saved_dict(saved).to_dict()
    ours = mine.to_dict()
    return [
        f"model.{k}: checkpoint {theirs[k]!r}, now {ours[k]!r}"
        for k in ours
        if k != "name" and ours[k] != theirs[k]
    ]


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``data`` with ``overrides`` applied; ``model.X`` keys go into the model overrides."""
    out = dict(data)
    model = out.get("model")
    model = {} if model is None else model  # null: no overrides; [] / false / "" are refused below
    if not isinstance(model, dict):
        raise ValueError(f"TrainConfig.model must be a JSON object of TitansConfig fields, got {model!r}")
    out["model"] = dict(model)
    known = {f.name for f in fields(TrainConfig)}
    model_fields = {f.name for f in fields(TitansConfig)}
    for key, value in overrides.items():
        if key.startswith("model."):
            name = key[len("model.") :]
            if name not in model_fields:
                raise ValueError(
                    f"unknown override {key!r}: TitansConfig has no field {name!r}"
                    + did_you_mean(name, model_fields)
                )
            out["model"][name] = value
        elif key in known:
            out[key] = value
        else:
            raise ValueError(
                f"unknown override {key!r}{did_you_mean(key, known)} known fields: {sorted(known)} (or "
                "model.<field>)"
            )
    return out


def parse_set(items: list[str], *, model_only: bool = False) -> dict[str, Any]:
    """``["steps=100", "model.dim=64", "data=a.txt"]`` -> {"steps": 100, "model.dim": 64, "data": "a.txt"}.

    Each value is parsed as its field's declared type (``titans.training.fields``: ``null`` for None where
    the field allows it, true/false for a bool, a JSON or comma-separated list for a list); a value that
    does not fit is refused naming the field, its type and the value. ``model_only``: the keys are
    `TitansConfig` fields without the ``model.`` prefix (``titans eval --set``).
    """
    known = {f.name for f in fields(TrainConfig)}
    model_fields = {f.name for f in fields(TitansConfig)} - {"variant", "name"}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        name = key[len("model.") :] if key.startswith("model.") and not model_only else key
        if model_only or key.startswith("model."):
            if name not in model_fields:
                hint = "no such TitansConfig field"
                if name == "variant":
                    hint = "set the variant with --variant"
                elif model_only and name.startswith("model.") and name[6:] in model_fields:
                    hint = f"write --set {name[6:]}=... here (no model. prefix)"
                if hint == "no such TitansConfig field":
                    prefix = "" if model_only else "model."
                    hint += did_you_mean(key, [prefix + f for f in model_fields])
                raise ValueError(
                    f"--set {key}: {hint} (`titans train --list-fields` lists the model.<field> ones)"
                )
            out[key] = parse_field_text(TitansConfig, name, raw, label=f"--set {key}")
        elif key in known:
            out[key] = parse_field_text(TrainConfig, key, raw, label=f"--set {key}")
        else:
            hint = did_you_mean(key, known) or did_you_mean(key, model_fields).replace("'", "'model.", 1)
            raise ValueError(
                f"--set {key}: no such TrainConfig field{hint} (`titans train --list-fields` lists them, "
                "and the model.<field> ones)"
            )
    return out


# One line per field for `titans train --list-fields`.
FIELD_HELP: dict[str, str] = field_help(TrainConfig)


def sample_prompt_for(prompt: str | None, tokenizer: Any) -> str:
    """The prompt of the end-of-training sample: `prompt` (TrainConfig.sample_prompt), checked against the
    tokenizer, or for None the first of SAMPLE_PROMPTS the tokenizer can encode ('' when none: the sample
    then starts from the first held-out token). `tokenizer`: a `titans.data.tokenizers.Tokenizer`."""
    if prompt is None:
        for candidate in SAMPLE_PROMPTS:
            try:
                if tokenizer.encode(candidate):
                    return candidate
            except ValueError:
                continue
        return ""
    try:
        tokenizer.encode(prompt)
    except ValueError as e:
        raise ValueError(
            f"TrainConfig.sample_prompt {prompt!r} cannot be encoded by tokenizer {tokenizer.name!r}: {e}"
        ) from None
    return prompt


def field_listing() -> str:
    """Every field ``titans train --set`` accepts: name, type, default, meaning (`--list-fields`)."""
    rows = describe_fields(TrainConfig, FIELD_HELP, skip=("model",))
    model_rows = describe_fields(TitansConfig, MODEL_FIELD_HELP, prefix="model.", skip=("variant", "name"))
    width = [max(len(r[i]) for r in rows + model_rows) for i in range(3)]

    def line(r: tuple[str, str, str, str]) -> str:
        return f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]:<{width[2]}}  {r[3]}"

    head = (
        "# titans train --set KEY=VALUE (or the same keys in a --config JSON file): "
        "name, type, default, meaning\n"
        "# values are parsed as the field's type; null sets an optional field to None"
    )
    model_head = (
        "# model fields (also `titans eval ... --set FIELD=VALUE` without the model. prefix): "
        "defaults before the preset's own values (`titans presets`)"
    )
    return "\n".join([head, *map(line, rows), "", model_head, *map(line, model_rows)])
