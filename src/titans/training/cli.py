"""`titans train` (`titans eval ppl` is in `titans.evaluation.perplexity`).

    titans train                                    # defaults: small MAC, builtin:stdlib, bytes, CPU
    titans train --config configs/main.json --resume
    titans train --config configs/main.json --steps 200 --set model.depth=2 --set lr=1e-3
    torchrun --nproc_per_node 2 -m titans train --config configs/main.json      # DDP (gloo / nccl)
    titans train --compare configs/compare_mac.json configs/compare_transformer.json configs/compare_swa.json
    titans eval ppl --checkpoint runs/main

Precedence: defaults < --config file < explicit flags < --set key=value (``model.<field>`` for the model).

SIGTERM or SIGINT (Ctrl-C) during training: the run finishes its step, writes a checkpoint and its report,
and the command exits with status 128 + the signal's number (143, 130) after a line saying where the
checkpoint is; ``--resume`` continues exactly. One after the last step (during the final checkpoint,
evaluation or sample) ends the same way, without a sample. Either way ``--compare`` trains none of the
configs after it. A second signal stops at once (``titans.training.signals``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

from titans.data.tokenizers import TOKENIZER_HELP
from titans.models.config import VARIANTS
from titans.training import distributed as D
from titans.training.config import DATA_HELP, TrainConfig, field_listing, parse_set
from titans.training.report import compare_table, format_report
from titans.training.signals import exit_status
from titans.training.trainer import Trainer, check_fresh_run_dir, check_run_dir_files
from titans.validation import path_arg

# explicit flag (argparse dest) -> TrainConfig field
_FLAGS: dict[str, str] = {
    "preset": "preset",
    "variant": "variant",
    "data": "data",
    "tokenizer": "tokenizer",
    "steps": "steps",
    "tokens": "tokens",
    "seq_len": "seq_len",
    "batch_size": "batch_size",
    "lr": "lr",
    "seed": "seed",
    "run_dir": "run_dir",
    "device": "device",
    "time_budget": "time_budget_min",
    "threads": "threads",
}


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for flag, key in _FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            out[key] = value
    if getattr(args, "fsdp", False):
        out["fsdp"] = True
    if getattr(args, "cuda_graphs", False):
        out["cuda_graphs"] = True
    if getattr(args, "compile", False):
        out["compile"] = True
    if getattr(args, "no_progress", False):
        out["progress"] = False
    out.update(parse_set(getattr(args, "set", None) or []))
    return out


def _train_one(cfg: TrainConfig, resume: bool, overwrite: bool) -> tuple[bool, int]:
    """Train one config and print its report (rank 0). Returns (whether this is rank 0, the exit status:
    0, or 128 + the number of the signal that stopped the run)."""
    trainer = Trainer(cfg, resume=resume, overwrite=overwrite)
    if trainer.info.is_main:
        n = trainer.model.num_parameters()
        print(
            f"training {cfg.variant} ({cfg.preset}, {n:,} parameters) on {cfg.data} [{cfg.tokenizer}], "
            f"{cfg.total_steps:,} steps x {cfg.tokens_per_step:,} tokens, "
            f"world size {trainer.info.world_size}, "
            f"device {trainer.device}, run_dir {cfg.run_dir}",
            flush=True,
        )
        memory = any(trainer.model_config.has_memory(i) for i in range(trainer.model_config.depth))
        if trainer.device.type == "cuda" and memory and not cfg.cuda_graphs and trainer.info.world_size == 1:
            print("hint: --cuda-graphs replays each step as a CUDA graph; memory variants train several times"
                  " faster (docs/benchmarks.md, section 6)", flush=True)  # fmt: skip
        if trainer.device.type == "cuda" and not cfg.compile:
            print("hint: --compile compiles each block (torch.compile): a 170M MAC trained 1.4x faster on an"
                  " H100 (docs/benchmarks.md, \"Compiled blocks on an H100\")", flush=True)  # fmt: skip
    result = trainer.train()
    is_main = trainer.info.is_main
    if is_main:
        report = format_report(result, f"{cfg.variant} on {cfg.data}", run_dir=cfg.run_dir, resumed=resume)
        print(report, flush=True)
    if result.stopped_by is None:
        return is_main, 0
    if is_main:
        if not result.stopped_early:  # every step ran: the signal came after the last one
            then = "training is done: the same command with --resume trains no more, it evaluates and samples"
        else:
            then = "run the same command with --resume to continue"
        print(
            f"titans: stopped by {result.stopped_by} at step {result.step}; checkpoint saved to "
            f"{result.checkpoint}; {then}",
            file=sys.stderr,
            flush=True,
        )
    return is_main, exit_status(signal.Signals[result.stopped_by])


def _comparable(configs: list[TrainConfig], paths: list[str]) -> None:
    """Runs compared side by side must share data, tokenizer, budget, size and optimizer."""
    free = {"variant", "run_dir"}  # model overrides too must match: they set the size
    base = configs[0].to_dict()
    for cfg, path in zip(configs[1:], paths[1:]):
        d = cfg.to_dict()
        diff = sorted(k for k in base if k not in free and base[k] != d[k])
        if diff:
            raise ValueError(f"--compare: {path} differs from {paths[0]} in {diff}; compared runs must match")
    dirs = [c.run_dir for c in configs]
    if len(set(dirs)) != len(dirs):
        raise ValueError(f"--compare: the configs must have distinct run_dir values, got {dirs}")


def run_train(args: argparse.Namespace) -> int:
    if args.list_fields:
        print(field_listing())
        return 0
    logging.getLogger("titans").setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")

    clean = False
    try:
        status = _run_train(args)
        clean = True
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training started
        print(
            "titans train: interrupted; run the same command with --resume to continue from the newest "
            "checkpoint",
            file=sys.stderr,
        )
        status = 130
    except FloatingPointError as e:  # the run diverged: the message names the last good checkpoint
        print(f"titans train: error: {e}", file=sys.stderr)
        status = 1
    finally:
        # after _run_train returns, so that its trainers are garbage: shutdown frees them first
        D.shutdown(clean=clean)
    return status


def _run_train(args: argparse.Namespace) -> int:
    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite contradict each other: choose one")
    if args.compare and args.config:
        raise ValueError("--config and --compare contradict each other: --compare trains its own configs")
    overrides = overrides_from_args(args)
    if "steps" in overrides and "tokens" in overrides:  # a token budget sets the steps
        raise ValueError("steps and tokens (--steps, --tokens, --set) contradict each other: give one budget")
    if args.compare:
        varied = sorted({"variant", "run_dir"} & overrides.keys())
        if varied:  # each config trains its own variant in its own folder: one override would make them one
            raise ValueError(f"--compare varies {' and '.join(varied)} by config: do not override it")
        configs = [TrainConfig.from_file(p, overrides) for p in args.compare]
        _comparable(configs, args.compare)
        for cfg in configs:  # every run folder, before the first config trains
            check_run_dir_files(cfg.run_dir)  # as each Trainer checks it, but for all before any trains
            if not (args.resume or args.overwrite):
                check_fresh_run_dir(cfg.run_dir)
        for cfg in configs:
            is_main, status = _train_one(cfg, args.resume, args.overwrite)
            if status:  # stopped by a signal: train none of the others
                return status
        if is_main:
            print("\n" + compare_table([c.run_dir for c in configs]))
        return 0
    cfg = TrainConfig.from_file(args.config, overrides)
    return _train_one(cfg, args.resume, args.overwrite)[1]


def register(commands, evals) -> None:
    d = TrainConfig()  # the flags default to the config's values (shown in --help)
    p = commands.add_parser(
        "train",
        help="train a Titans language model (also under torchrun)",
        description="Train a Titans language model. Precedence: the TrainConfig defaults < --config < the "
        "flags below < --set KEY=VALUE. `titans train --list-fields` lists every field --set accepts.",
    )
    p.add_argument("--config", type=path_arg, default=None, help="JSON TrainConfig file (see configs/)")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a TrainConfig field, model.<field> for the model (repeatable); the value is parsed "
        "as the field's type, null for None; --list-fields lists the fields",
    )
    p.add_argument(
        "--list-fields",
        action="store_true",
        help="print every field --set accepts (type, default, meaning) and exit",
    )
    p.add_argument(
        "--preset", help=f"model size preset (tiny, small, base, 170M, ...; config default: {d.preset})"
    )
    p.add_argument("--variant", help=f"{', '.join(VARIANTS)} (config default: {d.variant})")
    p.add_argument("--data", help=f"{DATA_HELP} (config default: {d.data})")
    p.add_argument("--tokenizer", help=f"{TOKENIZER_HELP} (config default: {d.tokenizer})")
    p.add_argument(
        "--steps",
        type=int,
        help=f"optimizer steps (config default: {d.steps}); replaces a config file's token budget",
    )
    p.add_argument("--tokens", type=int, help="token budget (sets the steps)")
    p.add_argument("--seq-len", type=int, help=f"training sequence length (config default: {d.seq_len})")
    p.add_argument(
        "--batch-size", type=int, help=f"global batch (all ranks together; config default: {d.batch_size})"
    )
    p.add_argument("--lr", type=float, help=f"peak learning rate (config default: {d.lr:g})")
    p.add_argument(
        "--seed",
        type=int,
        help=f"seed of the weights, the batch order and the sample (config default: {d.seed})",
    )
    p.add_argument(
        "--run-dir",
        type=path_arg,
        help=f"where checkpoints, metrics and plots go (config default: {d.run_dir})",
    )
    p.add_argument("--device", help=f"auto, cpu, cuda, cuda:1, ... (config default: {d.device})")
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch CPU threads of this process (config default: torch's own, one per core)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="MINUTES",
        help="stop (and checkpoint) after this long; the same command with --resume continues",
    )
    p.add_argument(
        "--fsdp", action="store_true", help="shard the model with FSDP2 (under torchrun, for CUDA)"
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay each micro-step as a CUDA graph (one GPU; much faster for the memory variants)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile each block with torch.compile (the first step compiles; faster steps on GPUs)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--resume", action="store_true", help="continue from the newest good checkpoint of run_dir"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="discard an earlier run in run_dir and start again"
    )
    p.add_argument(
        "--compare",
        type=path_arg,
        nargs="+",
        metavar="CONFIG",
        help="train each config in turn, print a bpb table",
    )
    p.set_defaults(func=run_train)
