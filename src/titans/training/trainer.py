"""The training loop: `Trainer(config).train()` -> `TrainResult`.

One optimizer step = one global batch (``TokenBatches`` step ``s``; under torchrun each rank takes its rows).
Every training sequence starts from a fresh memory state (``state=None``): the memory learns at test time
*within* a sequence, the outer parameters learn across sequences. With ``carry_state`` the rows of step
``s`` continue those of step ``s - 1`` in the stream (``StreamBatches``) and start from the state the
previous step ended with, detached (truncated backprop through time), so the model learns to use a memory
that has read far more than one window; checkpoints hold that state.

Checkpoints (``titans.runtime.checkpoint``; rank 0 writes) hold the model weights (safetensors), the
optimizer, the lr schedule, the data position and the RNG states, every ``ckpt_every`` steps, at the end,
when the wall-clock budget runs out and on SIGTERM / SIGINT (after the current step; see
``titans.training.signals``). Weights or optimizer state holding NaN or inf are never written.
``Trainer(config, resume=True)`` continues from the newest good checkpoint of ``run_dir`` exactly where it
stopped: the same batches, the same per-step losses and the same weights as a run that was never
interrupted. A resume whose config differs in a field that matters is refused, naming the field (see
``TrainConfig.resume_mismatches``).

The steps run on the package's one training loop (``titans.training.loop.TrainLoop``, which task training,
forecasting and DNA training use too): this trainer injects its step (micro-batches, DDP / FSDP, carried
state, CUDA graphs), its evaluation, its checkpoint and its memory statistics; the loop does the clipping,
the optimizer and schedule step, the non-finite check, the metrics, the progress bar, the time budget and
the stop signals.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from titans._fs import LOCK_FILE, lock_folder, write_text_atomic
from titans.data.loader import CurriculumBatches, EvalWindows, StreamBatches, TokenBatches
from titans.data.stream import load_token_streams
from titans.data.tokenizers import continuation_text, load_tokenizer
from titans.layers.memory import NeuralMemory
from titans.models.lm import TitansLM
from titans.models.monitor import memory_layers, memory_report
from titans.models.state import TitansState, cat_rows, select_rows, state_from_bytes, state_to_bytes
from titans.models.streaming import generate
from titans.runtime.checkpoint import (
    CHECKPOINTS,
    EVAL_CONTEXT_FILE,
    EVAL_PPL_FILE,
    CheckpointWriteError,
    capture_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from titans.runtime.device import set_cpu_threads, tf32
from titans.runtime.loading import (
    TOKENIZER_DIR,
    keep_tokenizer_copy,
    load_weights,
    tokenizer_fingerprint,
    tokenizer_record,
)
from titans.training import distributed as D
from titans.training.config import TrainConfig, autocast_dtype_for, model_mismatches, sample_prompt_for
from titans.training.cuda_graphs import GraphedMicroStep
from titans.training.loop import TrainLoop, optimizer_step
from titans.training.metrics import (
    METRICS_FILE,
    PLOT_FILE,
    TENSORBOARD_DIR,
    MetricsLogger,
    plot_losses,
    read_metrics,
    truncate_metrics,
)
from titans.training.optim import build_optimizer, build_scheduler
from titans.training.perplexity import PerplexityResult, autocast_context, evaluate_perplexity
from titans.training.signals import StopSignals, signal_name

log = logging.getLogger(__name__)
REPORT_FILE = "report.json"
CONFIG_FILE = "config.json"


@dataclass
class TrainResult:
    """What a training session did. ``train_loss``: mean loss of the last logged interval;
    ``tokens_per_s``: training throughput of this session (evaluation and checkpoint time excluded)."""

    step: int
    total_steps: int
    tokens: int
    num_parameters: int
    train_loss: float | None
    eval: PerplexityResult | None
    tokens_per_s: float
    train_time_s: float
    stopped_early: bool
    checkpoint: str | None
    sample: str | None = None
    # the signal that stopped the run ("SIGTERM", "SIGINT"); also one that came after its last step
    stopped_by: str | None = None
    step_losses: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("step_losses")
        return d


# what a run writes in its folder (all that `clear_run` deletes)
RUN_FILES = (CHECKPOINTS, TENSORBOARD_DIR, TOKENIZER_DIR, METRICS_FILE, PLOT_FILE, REPORT_FILE, CONFIG_FILE)


def _holds_a_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a training run: checkpoints, or the config.json a run writes first (a run
    stopped before its first checkpoint has only that, its metrics and its tokenizer copy)."""
    if list_checkpoints(run_dir):
        return True
    try:
        saved = json.loads((run_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(saved, dict):
        return False
    return isinstance(saved.get("model"), dict) and {"seq_len", "lr"} <= saved.keys()


def check_run_dir_files(run_dir: str | Path) -> None:
    """Refuse a run folder holding, under the names a run writes (`RUN_FILES`), files no run wrote: a
    project folder's config.json or tokenizer/ would be replaced (or deleted by --overwrite)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or _holds_a_run(run_dir):
        return
    taken = [name for name in RUN_FILES if os.path.lexists(run_dir / name)]
    if taken:
        raise FileExistsError(
            f"run_dir {str(run_dir)!r} holds {', '.join(taken)}, which no training run wrote there: a run "
            "would replace them; give another run_dir"
        )


def check_fresh_run_dir(run_dir: str | Path) -> None:
    """Refuse a run folder that holds an earlier run's checkpoints (FileExistsError saying what to pass)."""
    existing = list_checkpoints(run_dir)
    if existing:
        raise FileExistsError(
            f"run_dir {str(run_dir)!r} already holds checkpoints (newest {existing[-1].name}): "
            "pass --resume to continue that run, --overwrite to start it again, or another run_dir"
        )


def lock_run_dir(run_dir: Path):
    """The lock of a trainer that writes ``run_dir`` (`lock_folder`): a second trainer into a folder another
    one writes is refused (FileExistsError); it replaced the first run's metrics, config and report while
    both ran and exited 0, and removed the other's checkpoint staging."""
    return lock_folder(
        run_dir,
        f"run_dir {str(run_dir)!r} is in use: another training process writes it (it holds the lock "
        f"{LOCK_FILE!r} there); wait for that run to end, or give another run_dir",
    )


class Trainer:
    """Builds everything a run needs from a TrainConfig (model, data, optimizer, logging) and trains it."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        resume: bool = False,
        overwrite: bool = False,
        info: D.DistInfo | None = None,
    ):
        """``resume``: continue from the newest good checkpoint of ``run_dir`` (from scratch if none).
        ``overwrite``: first delete what an earlier run wrote in ``run_dir``. Neither: refuse a ``run_dir``
        that already holds checkpoints."""
        if resume and overwrite:
            raise ValueError("resume and overwrite contradict each other: choose one")
        self.config = cfg = config
        set_cpu_threads(cfg.threads, "TrainConfig.threads")
        self.info = info or D.init_distributed(cfg.device)
        self.device = self.info.device
        self.run_dir = Path(cfg.run_dir)
        rows = cfg.batch_size // self.info.world_size
        if cfg.batch_size % self.info.world_size or rows % cfg.grad_accum:
            raise ValueError(
                f"TrainConfig.batch_size={cfg.batch_size} must split into world_size={self.info.world_size} "
                f"ranks x grad_accum={cfg.grad_accum} equal micro-batches"
            )
        for n in cfg.curriculum_seq_lens:  # a length curriculum's phases split the same way
            phase_rows = cfg.batch_size * cfg.seq_len // n
            if phase_rows % (self.info.world_size * cfg.grad_accum):
                raise ValueError(
                    f"TrainConfig.curriculum_seq_lens: windows of {n} tokens make {phase_rows} rows a step, "
                    f"which do not split into world_size={self.info.world_size} ranks x grad_accum="
                    f"{cfg.grad_accum} equal micro-batches"
                )
        self.autocast_dtype = autocast_dtype_for(cfg.dtype, self.device)

        # --overwrite clears the earlier run only once all that the options name has loaded (below): a
        # command that fails on its own options (a mistyped data path) leaves that run as it was
        check_run_dir_files(self.run_dir)  # also under --resume and --overwrite (which deletes those names)
        checkpoint = None if overwrite else self._find_checkpoint(resume)
        torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        # a prompt the tokenizer cannot encode is refused now, not after the whole run
        self.sample_prompt = sample_prompt_for(cfg.sample_prompt, self.tokenizer) if cfg.sample_tokens else ""
        with D.main_first(self.info):  # rank 0 tokenizes and writes the cache; the others read it
            streams = load_token_streams(
                cfg.data,
                self.tokenizer,
                heldout_fraction=cfg.heldout_fraction,
                cache_dir=cfg.cache_dir,
                text_field=cfg.text_field,
            )
        _check_split_lengths(streams.train.n_tokens, streams.heldout.n_tokens, cfg)
        self.model_config = cfg.model_config(self.tokenizer.vocab_size)
        self.model = TitansLM(self.model_config)
        self.model.gradient_checkpointing = cfg.gradient_checkpointing
        for module in self.model.modules():  # divergence is caught collectively (the loss, checkpoints)
            if isinstance(module, NeuralMemory):
                module.check_finite = False
        # `checkpoint` comes from latest_checkpoint, which has just hashed its files
        saved = load_checkpoint(checkpoint, map_location="cpu", verified=True) if checkpoint else None
        if saved is not None:
            self._check_resumable(saved.config, checkpoint)
            load_weights(self.model, saved.model_state)
        self.model.to(self.device)
        if cfg.compile:
            self.model.compile_blocks()
        if cfg.cuda_graphs and (self.device.type != "cuda" or self.info.world_size > 1):
            where = f"{self.info.world_size} processes" if self.info.world_size > 1 else str(self.device)
            raise ValueError(
                f"TrainConfig.cuda_graphs needs one process on one CUDA device; this run has {where}"
            )
        self.graphed_step: GraphedMicroStep | None = None  # captured at the first step (cuda_graphs)
        self.engine = D.wrap_model(self.model, self.info, fsdp=cfg.fsdp, carried=cfg.carry_state)
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        if cfg.warmup_steps > cfg.total_steps and self.info.is_main:
            log.warning(
                "warmup_steps=%d is longer than the run's %d steps: the lr never reaches its peak %g "
                "(at most %.3g) and never decays",
                cfg.warmup_steps,
                cfg.total_steps,
                cfg.lr,
                cfg.lr * cfg.total_steps / cfg.warmup_steps,
            )
        shard = dict(seed=cfg.seed, rank=self.info.rank, world_size=self.info.world_size)
        if cfg.carry_state:
            self.batches: TokenBatches = StreamBatches(
                streams.train,
                batch_size=cfg.batch_size,
                seq_len=cfg.seq_len,
                reset_every=cfg.carry_reset_every,
                groups=cfg.carry_groups,
                **shard,
            )
        elif cfg.curriculum_steps:
            self.batches = CurriculumBatches(
                streams.train,
                batch_size=cfg.batch_size,
                seq_len=cfg.seq_len,
                steps=cfg.curriculum_steps,
                seq_lens=cfg.curriculum_seq_lens,
                **shard,
            )
        else:
            self.batches = TokenBatches(
                streams.train, batch_size=cfg.batch_size, seq_len=cfg.seq_len, **shard
            )
        # carry_state: per group of lanes, the state this rank's rows ended its last visit with (None: fresh)
        self.carried: list[TitansState | None] = [None] * cfg.carry_groups
        self.eval_windows = EvalWindows(
            streams.heldout,
            seq_len=cfg.seq_len,
            num_windows=cfg.eval_windows,
            batch_size=cfg.eval_batch_size,
            rank=self.info.rank,
            world_size=self.info.world_size,
        )
        self.step = 0
        self.step_losses: list[float] = []  # global loss of every step taken by this Trainer
        self.last_checkpoint: Path | None = checkpoint
        if saved is not None:
            self._load_trainer_state(saved.trainer_state)
            if self.info.is_main:
                print(f"resumed {self.run_dir} at step {self.step} from {checkpoint}", flush=True)
        if self.info.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        with self._writing():  # before anything in run_dir is cleared or written; `train` takes it again
            if not resume and not overwrite and self.info.is_main:
                check_fresh_run_dir(self.run_dir)  # again, locked: a run that ended meanwhile is kept
            if overwrite:
                if self.info.is_main:
                    clear_run(self.run_dir)
                D.barrier(self.info)  # no rank writes to run_dir before it is cleared
            if self.info.is_main:
                keep_tokenizer_copy(cfg.tokenizer, self.run_dir)
                cfg.save(self.run_dir / CONFIG_FILE)
                truncate_metrics(self.run_dir / METRICS_FILE, self.step)
            self.metrics = MetricsLogger(
                self.run_dir, enabled=self.info.is_main, tensorboard=cfg.tensorboard, resume_step=self.step
            )

    def _writing(self):
        """The lock on ``run_dir`` while this trainer writes it (`lock_run_dir`; the main rank's: the others
        write nothing there). A trainer built and not trained holds nothing."""
        return lock_run_dir(self.run_dir) if self.info.is_main else contextlib.nullcontext()

    def _check_run_dir_unchanged(self) -> None:
        """Refuse to train when another trainer wrote ``run_dir`` since this one was built (two built in
        one process for one folder): its config.json, metrics and newest checkpoint are not this run's."""
        newest, mine = latest_checkpoint(self.run_dir), self.last_checkpoint
        try:
            saved = json.loads((self.run_dir / CONFIG_FILE).read_text())
        except (OSError, ValueError):
            saved = None
        same_config = saved == json.loads(json.dumps(self.config.to_dict()))
        if not same_config or getattr(newest, "name", None) != getattr(mine, "name", None):
            raise FileExistsError(
                f"run_dir {str(self.run_dir)!r} was written by another trainer since this one was built (its "
                "config.json or newest checkpoint is not this run's): build the Trainer again"
            )

    # ---------------------------------------------------------------------------------------- resume
    def _find_checkpoint(self, resume: bool) -> Path | None:
        if not resume:
            check_fresh_run_dir(self.run_dir)
            return None
        found = latest_checkpoint(self.run_dir)  # skips damaged checkpoints (with a warning)
        if self.info.is_main:
            after = int(found.name.split("_")[-1]) if found is not None else -1
            damaged = [p.name for p in list_checkpoints(self.run_dir) if int(p.name.split("_")[-1]) > after]
            if damaged:  # latest_checkpoint has just found them damaged (its warnings say how)
                which = f"resuming from {found.name}" if found is not None else "starting from scratch"
                print(
                    f"titans: the newest checkpoints of {self.run_dir} are damaged ({', '.join(damaged)}); "
                    f"{which}. They stay where they are (nothing counts them toward keep_last) until the "
                    "run reaches their steps and replaces them",
                    flush=True,
                )
            elif found is None:
                print(f"no checkpoint in {self.run_dir}: starting from scratch", flush=True)
        return found

    def _check_resumable(self, saved: dict[str, Any], path: Path) -> None:
        if "train" not in saved or "model" not in saved:
            raise ValueError(f"cannot resume from {str(path)!r}: it was not written by the titans trainer")
        mine = self.config.to_dict()
        detail = [
            f"{k}: checkpoint {saved['train'].get(k)!r}, now {mine.get(k)!r}"
            for k in self.config.resume_mismatches(saved["train"])
        ]
        detail += model_mismatches(self.model_config, saved["model"])  # the model built, not its spelling
        # the same tokenizer spec can name a file whose contents changed since: it would tokenize the data
        # (and the data position) differently
        want = (saved.get("tokenizer") or {}).get("fingerprint")
        have = tokenizer_fingerprint(self.tokenizer)
        if want and have and want != have:
            detail.append(
                f"tokenizer: {self.config.tokenizer!r} is not the tokenizer the checkpoint was trained with "
                f"(its contents differ; the run keeps a copy of a file tokenizer in its {TOKENIZER_DIR}/ "
                "folder)"
            )
        if detail:
            raise ValueError(f"cannot resume from {str(path)!r}: the config differs in {'; '.join(detail)}")

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        # the optimizer state is keyed by parameter name when an FSDP run wrote it, by position otherwise
        # (`_state_dicts`); either loads in either mode, converted to the form this one reads
        names = D.optimizer_param_names(self.model, self.optimizer)
        if self.config.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            by_name = D.optimizer_state_by_name(state["optimizer"], names)
            set_optimizer_state_dict(
                self.model, self.optimizer, by_name, options=StateDictOptions(full_state_dict=True)
            )
        else:
            self.optimizer.load_state_dict(D.optimizer_state_by_position(state["optimizer"], names))
        self.scheduler.load_state_dict(state["scheduler"])
        # The lr of the next step from the schedule of *this* config (it differs from the saved one only
        # when `steps`/`tokens` changed to extend the run); identical to the saved lr otherwise.
        for group, base, fn in zip(
            self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas
        ):
            group["lr"] = base * fn(self.scheduler.last_epoch)
        self.batches.load_state_dict(state["data"])
        if state.get("carried") is not None:  # per group, the global batch's rows; this rank takes its own
            mine = torch.arange(self.info.rank, self.config.batch_size, self.info.world_size)
            self.carried = [
                None if b is None else select_rows(state_from_bytes(b, self.device, model=self.model), mine)
                for b in state["carried"]
            ]
        restore_rng_state(state["rng"])
        self.step = int(state["step"])
        if self.step > self.config.total_steps:
            raise ValueError(
                f"cannot resume: the checkpoint is at step {self.step}, past this config's "
                f"{self.config.total_steps} steps (steps and tokens may grow to extend a run, not end before "
                "the steps it has done)"
            )
        if self.batches.step != self.step:
            raise ValueError(f"checkpoint data position {self.batches.step} != its step {self.step}")

    # ---------------------------------------------------------------------------------------- saving
    def _state_dicts(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Full (unsharded) model and optimizer state; under FSDP a collective (every rank calls it). The
        optimizer state names each parameter by its name under FSDP, by its position otherwise; a resume
        in the other mode converts it (`_load_trainer_state`)."""
        if self.config.fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return (
                get_model_state_dict(self.model, options=opts),
                get_optimizer_state_dict(self.model, self.optimizer, options=opts),
            )
        return self.model.state_dict(), self.optimizer.state_dict()

    def _last_good(self) -> str:
        if self.last_checkpoint is None:
            return "this run has written no checkpoint"
        return f"the last good checkpoint is {self.last_checkpoint}"

    def _all_finite(self) -> bool:
        """Whether every weight and optimizer state tensor is finite on every rank (a collective)."""
        tensors = [p.detach() for p in self.model.parameters()]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        # FSDP: DTensors; each rank checks its own shards
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
        # one device for the flags: an optimizer's step counters can sit on the CPU beside CUDA weights
        device = local[0].device
        finite = bool(torch.stack([torch.isfinite(t).all().to(device) for t in local if t.numel()]).all())
        return not D.any_rank(not finite, self.info)

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint of the current step (rank 0; the others wait). Returns its folder on rank 0.

        Refuses (FloatingPointError, on every rank) weights or optimizer state that hold NaN or inf: a
        checkpoint is written only if training can go on from it. A write that fails (a full disk) raises
        CheckpointWriteError and leaves the earlier checkpoints as they were."""
        if not self._all_finite():
            raise FloatingPointError(
                f"the weights or the optimizer state became NaN or inf by step {self.step}, so they are not "
                f"saved as a checkpoint; {self._last_good()} (try a lower lr or memory_max_lr, or grad_clip)"
            )
        model_state, optim_state = self._state_dicts()
        carried = self._global_carried()
        path, failed = None, None
        if self.info.is_main:
            trainer_state = {
                "step": self.step,
                "optimizer": optim_state,
                "scheduler": self.scheduler.state_dict(),
                "data": self.batches.state_dict(),
                "rng": capture_rng_state(),
                "world_size": self.info.world_size,
                "carried": carried,
            }
            config = {
                "train": self.config.to_dict(),
                "model": self.model_config.to_dict(),
                "tokenizer": tokenizer_record(self.config.tokenizer, self.tokenizer),
            }
            try:
                path = save_checkpoint(
                    self.run_dir,
                    self.step,
                    model_state=model_state,
                    trainer_state=trainer_state,
                    config=config,
                    keep_last=self.config.keep_last,
                )
                self.last_checkpoint = path
            except CheckpointWriteError as e:
                failed = e
        # every rank learns whether the write failed (the collective is also the wait for rank 0's write),
        # so all stop with the error; one waiting alone in a barrier died of the lost connection instead
        if D.any_rank(failed is not None, self.info):
            if failed is None:
                raise CheckpointWriteError(
                    f"rank {self.info.rank}: the main rank could not write the checkpoint of step "
                    f"{self.step} (its error says why)"
                )
            fix = "free some space" if failed.errno == errno.ENOSPC else "mend that"
            raise CheckpointWriteError(
                f"{failed}; {self._last_good()}: {fix}, then run the same command with --resume",
                errno=failed.errno,
            ) from failed
        return path

    def _global_carried(self) -> list[bytes | None] | None:
        """Per group of lanes, the carried state of the whole global batch (rows in global order) as state
        bytes, on the main rank (a collective under torchrun); None without carry_state."""
        if not self.config.carry_state:
            return None
        return [self._global_state(s) for s in self.carried]

    def _global_state(self, state: TitansState | None) -> bytes | None:
        """One group's carried state, gathered from every rank into global row order (main rank)."""
        parts = D.gather_objects(None if state is None else state_to_bytes(state), self.info)
        if not self.info.is_main or parts[0] is None:
            return None
        if self.info.world_size == 1:
            return parts[0]
        joined = cat_rows([state_from_bytes(p) for p in parts])
        rows = self.config.batch_size // self.info.world_size
        # global row g is row g // world_size of rank g % world_size
        order = torch.tensor([(g % self.info.world_size) * rows + g // self.info.world_size
                              for g in range(self.config.batch_size)])  # fmt: skip
        return state_to_bytes(select_rows(joined, order))

    # ---------------------------------------------------------------------------------------- steps
    def _step_states(self, step: int, accum: int) -> list[TitansState | None]:
        """The state each micro-batch of ``step`` starts from: fresh, or (carry_state) its rows of the
        state its group's last visit ended with, unless ``step`` starts an episode of that group."""
        if not self.config.carry_state or self.batches.resets(step):
            return [None] * accum
        carried = self.carried[self.batches.group(step)]
        if carried is None:
            return [None] * accum
        rows = torch.arange(self.config.batch_size // self.info.world_size)
        return [select_rows(carried, part) for part in rows.chunk(accum)]

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on global batch ``step``: (this rank's mean loss, the gradient norm)."""
        inputs, targets = self.batches.get_batch(step)
        self.batches.step = step + 1  # the data position a checkpoint records
        if self.config.cuda_graphs:
            return self._graphed_train_step(inputs, targets)
        accum = self.config.grad_accum
        self.engine.train()
        loss_sum = torch.zeros((), device=self.device)
        ends: list[TitansState] = []
        for i, (x, y, state) in enumerate(
            zip(inputs.chunk(accum), targets.chunk(accum), self._step_states(step, accum))
        ):
            with D.no_sync(self.engine, skip=i < accum - 1):
                with autocast_context(self.device, self.autocast_dtype):
                    logits, end = self.engine(x.to(self.device, non_blocking=True), state)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(self.device).flatten())
                (loss / accum).backward()
            loss_sum += loss.detach() / accum
            ends.append(end.detach())  # truncated backprop: the next step's graph starts here
        if self.config.carry_state:
            self.carried[self.batches.group(step)] = cat_rows(ends)
        return loss_sum, self._optimizer_step()

    def _optimizer_step(self) -> torch.Tensor:
        """Clip, step the optimizer and the schedule, clear the gradients; returns the gradient norm."""
        # a CUDA graph adds into the gradient tensors it was captured with: zero them, keep them
        return optimizer_step(
            self.model.parameters(),
            self.optimizer,
            self.scheduler,
            self.config.grad_clip,
            set_to_none=not self.config.cuda_graphs,
        )

    def _graphed_train_step(self, inputs: torch.Tensor, targets: torch.Tensor):
        """`train_step` with each micro-step a CUDA graph replay (one process, one GPU)."""
        accum = self.config.grad_accum
        self.model.train()
        if self.graphed_step is None:
            shape = (inputs.shape[0] // accum, inputs.shape[1])
            vocab = self.model_config.vocab_size
            self.graphed_step = GraphedMicroStep(self.model, shape, accum, self.autocast_dtype, vocab)
        loss_sum = torch.zeros((), device=self.device)
        for x, y in zip(inputs.chunk(accum), targets.chunk(accum)):
            loss_sum += self.graphed_step(x, y) / accum
        return loss_sum, self._optimizer_step()

    def evaluate(self) -> PerplexityResult:
        """Held-out loss / perplexity / bits per byte over the run's evaluation windows (all ranks)."""
        # DDP: each rank scores its windows with the bare model (no gradient hooks); FSDP: the sharded
        # model, whose forward is a collective, so every rank runs the same number of passes.
        model = self.model if self.config.fsdp else D.unwrap(self.engine)
        with self._uncompiled():
            return evaluate_perplexity(
                model,
                self.eval_windows,
                device=self.device,
                autocast_dtype=self.autocast_dtype,
                lockstep=self.config.fsdp,
            )

    def _uncompiled(self):
        """A context in which compiled blocks (`TrainConfig.compile`) run eager: the evaluation, the memory
        monitor and the sample call them at batch sizes and modes the training step never uses, and each
        would compile again (minutes on a GPU; recompiled with a dynamic batch, a 170M MAC's blocks found no
        CUDA attention kernel for their mask)."""
        return torch.compiler.set_stance("force_eager") if self.config.compile else contextlib.nullcontext()

    # ---------------------------------------------------------------------------------------- loop
    def train(self, stop_at: int | None = None, *, handle_signals: bool = True) -> TrainResult:
        """Train to ``config.total_steps`` (or the time budget, or step ``stop_at`` of the same schedule:
        an interruption that ``resume`` continues), then checkpoint, evaluate, plot and sample.

        ``handle_signals`` (main thread only): a SIGTERM or SIGINT during training stops the run after the
        current step, with a checkpoint, the final evaluation and the report, and sets
        ``TrainResult.stopped_by``; a second one stops at once (``titans.training.signals``). One that
        arrives after the last step (during the final checkpoint, evaluation, plot or sample) sets
        ``stopped_by`` too, and there is no sample (one under way is abandoned)."""
        with self._writing():
            if self.info.is_main:
                self._check_run_dir_unchanged()
            signals = StopSignals(enabled=handle_signals, announce=self.info.is_main)
            with tf32(self.config.tf32), signals as sig:
                return self._train(stop_at, sig)

    def _train(self, stop_at: int | None, signals: StopSignals) -> TrainResult:
        cfg, info = self.config, self.info
        total = cfg.total_steps
        start_step = self.step
        loop = TrainLoop(
            self.model,
            self.optimizer,
            total_steps=total,
            step_fn=self._loop_step,
            scheduler=self.scheduler,
            start_step=self.step,
            log_every=cfg.log_every,
            eval_every=cfg.eval_every,
            evaluate=lambda step: self._log_eval(self.evaluate(), loop),
            ckpt_every=cfg.ckpt_every,
            checkpoint=lambda step: self.save_checkpoint(),
            checkpointed_at=self.step if self.last_checkpoint is not None else None,
            after_log=lambda step: self._log_memory(),
            time_budget_s=None if cfg.time_budget_min is None else cfg.time_budget_min * 60,
            metrics=self.metrics,
            tokens_per_step=cfg.tokens_per_step,
            progress=cfg.progress and info.is_main,
            verbose=info.is_main,
            info=info,
            device=self.device,
            failure_hint=lambda: f"{self._last_good()} (try a lower lr or memory_max_lr, or grad_clip)",
            step_losses=self.step_losses,
            tf32=cfg.tf32,
        )
        done = loop.run(stop_at, signals=signals)
        signals.next_steps = "training is done and checkpointed; finishing the report, without a sample"
        self.step = done.step
        last_logged, train_time, stopped_by = done.last_logged, done.train_time_s, done.stopped_by
        final_eval = self.evaluate()
        # a finished run resumed (nothing trained now) may have logged this evaluation when it finished
        again = self.step == start_step and any(
            r.get("split") == "eval" and r.get("step") == self.step
            for r in read_metrics(self.run_dir / METRICS_FILE)
        )
        self._log_eval(final_eval, None, record=not again)
        session_tokens = (self.step - start_step) * cfg.tokens_per_step
        tokens_per_s = session_tokens / train_time if train_time > 0 else 0.0
        if last_logged is None:  # nothing left to train (a finished run resumed): report its last log
            last = [r for r in read_metrics(self.run_dir / METRICS_FILE) if r.get("split") == "train"]
            if last:
                last_logged, tokens_per_s = last[-1].get("loss"), last[-1].get("tokens_per_s", 0.0)
            # and the time and throughput of the session that trained it, not this one's zero
            previous = _previous_report(self.run_dir)
            if previous.get("step") == self.step and previous.get("train_time_s"):
                train_time, tokens_per_s = (
                    previous["train_time_s"],
                    previous.get("tokens_per_s", tokens_per_s),
                )
        result = TrainResult(
            step=self.step,
            total_steps=total,
            tokens=self.step * cfg.tokens_per_step,
            num_parameters=self.model.num_parameters(),
            train_loss=last_logged,
            eval=final_eval,
            tokens_per_s=tokens_per_s,
            train_time_s=train_time,
            stopped_early=done.stopped_early,
            checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
            step_losses=list(self.step_losses),
            stopped_by=stopped_by,
        )
        if info.is_main:
            self.metrics.close()
            if cfg.plot:
                plot_losses(self.run_dir / METRICS_FILE, self.run_dir / PLOT_FILE, title=self._title())
            # a stopped run ends promptly: no sample, and a signal during the sample ends it
            if cfg.sample_tokens > 0 and stopped_by is None and signals.signum is None:
                result.sample = self.sample(lambda: signals.signum is not None)
        if stopped_by is None:
            # a signal after the last step (during the final checkpoint, evaluation, plot or sample) stops
            # the run as one during training does: recorded in the report, exit status 128 + its number,
            # no sample, no next run of --compare. The ranks agree on it (one all_reduce), as after a step
            _, signum = D.agree_to_stop(False, signals.signum, info)
            if signum:
                stopped_by = result.stopped_by = signal_name(signum)
                result.sample = None
        if info.is_main:
            report = {"config": cfg.to_dict(), **result.to_dict()}
            report["eval"] = final_eval.to_dict()
            # the threads the run used (config threads null: one per core); its numbers follow them
            report["torch_threads"] = torch.get_num_threads()
            write_text_atomic(self.run_dir / REPORT_FILE, json.dumps(report, indent=2) + "\n")
        return result

    def _title(self) -> str:
        c = self.model_config
        return f"{c.variant} dim={c.dim} depth={c.depth} | {self.config.data} | {self.config.tokenizer}"

    def _loop_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`train_step` as the loop's step: the trainer's step counter moves with the loop's."""
        out = self.train_step(step)
        self.step = step + 1
        return out

    def _log_memory(self) -> None:
        """The memory's monitoring numbers (`titans.models.monitor`, head means per memory layer) as the
        "memory" rows of the metrics: one no-grad forward of the first held-out window per log interval, on
        the main rank (not under FSDP, whose forward every rank must run together)."""
        if not self.info.is_main or self.config.fsdp or not memory_layers(self.model):
            return
        if getattr(self, "_monitor_tokens", None) is None:
            self._monitor_tokens = next(iter(self.eval_windows))[0][:1]
        model = D.unwrap(self.engine)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), autocast_context(self.device, self.autocast_dtype), self._uncompiled():
                out = model.forward_with_stats(self._monitor_tokens.to(self.device), last_only=True)
            report = memory_report(model, out.stats, out.state)
        finally:
            model.train(was_training)
        self.metrics.log("memory", self.step, **report.summary())

    def _log_eval(self, result: PerplexityResult, loop: TrainLoop | None, record: bool = True) -> None:
        """Print the evaluation; with ``record``, also log it (metrics.jsonl, TensorBoard)."""
        if record:
            self.metrics.log("eval", self.step, loss=result.loss, ppl=result.ppl, bpb=result.bpb)
        if self.info.is_main:
            bpb = f"{result.bpb:.4f}" if result.bpb is not None else "n/a"
            line = f"step {self.step}: held-out loss {result.loss:.4f}  ppl {result.ppl:.3f}  bpb {bpb}"
            (loop.write if loop is not None else print)(line)

    # ---------------------------------------------------------------------------------------- sample
    def sample(self, stop: Callable[[], bool] | None = None) -> str | None:
        """A continuation of ``sample_prompt`` from the trained model (rank 0, not under FSDP). ``stop``:
        asked after every token; when it says true the sample is abandoned and None returned (a stop
        signal)."""
        cfg = self.config
        if cfg.fsdp:
            print("(no sample under FSDP: the sharded model needs every rank to run it)")
            return None
        ids = self.tokenizer.encode(self.sample_prompt) or [self.batches.tokens[0].item()]
        prompt = torch.tensor([ids], dtype=torch.long, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        model = D.unwrap(self.engine)
        eos = self.tokenizer.eos_id

        def check(token: torch.Tensor) -> None:
            if stop():
                raise _SampleStopped

        model.eval()
        try:
            with torch.no_grad(), autocast_context(self.device, self.autocast_dtype), self._uncompiled():
                out = generate(
                    model,
                    prompt,
                    cfg.sample_tokens,
                    temperature=cfg.sample_temperature,
                    top_k=cfg.sample_top_k,
                    stop_tokens=eos,
                    generator=generator,
                    on_token=None if stop is None else check,
                )
        except _SampleStopped:
            return None
        finally:
            model.train()
        new = out[0, prompt.shape[1] :].tolist()
        new = new[: new.index(eos)] if eos in new else new  # the end-of-text token ends it, as in `generate`
        # decoded after the prompt's last tokens: a SentencePiece continuation keeps its first space
        return self.sample_prompt + continuation_text(self.tokenizer, ids, new)


class _SampleStopped(Exception):
    """Raised between two tokens of `Trainer.sample` to abandon it."""


def _check_split_lengths(n_train: int, n_heldout: int, cfg: TrainConfig) -> None:
    """A training and a held-out split long enough for one window of ``seq_len + 1`` tokens each, or an
    error that says which setting to change."""
    need = cfg.seq_len + 1
    longest = max([cfg.seq_len, *cfg.curriculum_seq_lens]) + 1
    if n_train < longest:
        raise ValueError(
            f"the training split of {cfg.data!r} has {n_train} tokens, fewer than one training window of "
            f"{longest} (the longest window + 1): give more text, or lower seq_len (--seq-len) or "
            "curriculum_seq_lens"
        )
    if n_heldout < need:
        share = need / (n_train + n_heldout)
        hint = f" (about {share:.2g} of this source)" if share < 0.5 else ""
        raise ValueError(
            f"the held-out split of {cfg.data!r} has {n_heldout} tokens (heldout_fraction="
            f"{cfg.heldout_fraction:g}), fewer than one evaluation window of seq_len + 1 = {need}: raise "
            f"heldout_fraction (--set heldout_fraction=...){hint}, lower seq_len (--seq-len), or give "
            "more text"
        )


def _previous_report(run_dir: Path) -> dict:
    """The report.json a run folder holds ({} for none or an unreadable one)."""
    try:
        report = json.loads((run_dir / REPORT_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


def clear_run(run_dir: Path) -> None:
    """Delete what a training run wrote in ``run_dir`` (only the trainer's own files and folders)."""
    for name in (CHECKPOINTS, TENSORBOARD_DIR, TOKENIZER_DIR):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    # and the evaluations written into the run by default: they would describe the run this one replaces
    evals = (EVAL_PPL_FILE, EVAL_CONTEXT_FILE, str(Path(EVAL_CONTEXT_FILE).with_suffix(".png")))
    for name in (METRICS_FILE, PLOT_FILE, REPORT_FILE, CONFIG_FILE, *evals):
        (run_dir / name).unlink(missing_ok=True)
