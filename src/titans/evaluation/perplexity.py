"""`titans eval ppl`: held-out loss, perplexity and bits per byte of a saved checkpoint.

    titans eval ppl --checkpoint C [--data SPEC] [--seq-len N] [--windows K] [--dtype D]
                    [--allow-changed-data]

scores a checkpoint's own held-out split, or all of the text named by ``--data`` (see
``titans.data.sources``), with ``titans.training.perplexity.evaluate_perplexity`` (the function the
trainer's own evaluations use), prints the result and writes it as JSON. The windows (their number and
length) and the precision are the run's (``eval_windows``, ``seq_len``, ``TrainConfig.dtype`` by the
trainer's rule: ``titans.training.config.autocast_dtype_for``) unless ``--windows``, ``--seq-len`` or
``--dtype`` name others, so the held-out score is the one the trainer reported.

The held-out split is rebuilt from the run's data as it is now, and checked against the digests the
checkpoint recorded (``TokenBatches.state_dict``; an older checkpoint records only the training token
count): data edited, added to or removed from since the run would be split otherwise, and a "held-out"
score could include text the model trained on. Such data is refused, or scored with a warning under
``--allow-changed-data``.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from titans._fs import check_writable
from titans.data.loader import EvalWindows
from titans.data.sources import load_source
from titans.data.stream import (
    TokenStream,
    TokenStreams,
    encode_documents,
    load_token_streams,
    separator_ids,
    token_dtype,
)
from titans.data.tokenizers import Tokenizer
from titans.evaluation.reporting import command_line
from titans.evaluation.scoring import write_json
from titans.runtime.checkpoint import EVAL_PPL_FILE, run_folder_of
from titans.runtime.device import resolve_device
from titans.runtime.loading import load_checkpoint_from
from titans.training import perplexity as _heldout
from titans.training.config import DTYPES, autocast_dtype_for
from titans.training.model_io import load_model
from titans.validation import path_arg

log = logging.getLogger(__name__)


def whole_source_stream(spec: str, tokenizer: Tokenizer, text_field: str = "text") -> TokenStream:
    """All documents of a source as one token stream (each followed by the separator), for evaluating on
    text that is held out by construction (a file the model never saw)."""
    source = load_source(spec, text_field=text_field)
    sep = np.asarray(separator_ids(tokenizer), dtype=np.int64)
    parts, ids, n_bytes = [], [], 0
    docs = [d for d in source.documents() if d.text]
    for doc, tokens in zip(docs, encode_documents(tokenizer, [d.text for d in docs])):
        parts += [tokens, sep]
        ids.append(doc.id)
        n_bytes += len(doc.text.encode("utf-8")) + len(sep)
    if not parts:
        raise ValueError(f"text source {spec!r} holds no text")
    tokens = np.concatenate(parts).astype(token_dtype(tokenizer.vocab_size))
    return TokenStream(tokens, n_bytes, tuple(ids), "all", source.spec, tokenizer.name)


def data_changes(streams: TokenStreams, data_state: dict[str, Any] | None) -> str | None:
    """How the data now differs from what a checkpoint's data state (``TokenBatches.state_dict``) records,
    or None when it does not, as far as the record tells: by the held-out digest (the same held-out text
    scores the same, whatever became of the training text), else, for a checkpoint from before digests,
    by the training token count."""
    state = data_state or {}
    if state.get("heldout") and streams.heldout.digest:
        same = state["heldout"] == streams.heldout.digest
        return None if same else "the held-out tokens differ from the ones the run held out"
    if "n_tokens" in state and int(state["n_tokens"]) != streams.train.n_tokens:
        return f"the training split has {streams.train.n_tokens} tokens, the run's had {state['n_tokens']}"
    return None


def heldout_stream(
    cfg, tokenizer: Tokenizer, data_state: dict[str, Any] | None = None, allow_changed: bool = False
) -> TokenStream:
    """The held-out split a training run (its `TrainConfig`) set aside, as that run split and tokenized it.

    ``data_state``: the checkpoint's ``trainer_state["data"]``; when the data differs from it (see the
    module docstring) a ValueError, or with ``allow_changed`` a warning. None: not checked.
    """
    return heldout_split(cfg, tokenizer, data_state, allow_changed)[0]


def heldout_split(
    cfg, tokenizer: Tokenizer, data_state: dict[str, Any] | None = None, allow_changed: bool = False
) -> tuple[TokenStream, str | None]:
    """`heldout_stream`, and how the data changed since the run (None: it did not, or was not checked), for
    a result file to say what it scored."""
    try:
        streams = load_token_streams(
            cfg.data,
            tokenizer,
            heldout_fraction=cfg.heldout_fraction,
            cache_dir=cfg.cache_dir,
            text_field=cfg.text_field,
        )
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}{_relative_hint(cfg.data)}") from None
    change = data_changes(streams, data_state) if data_state is not None else None
    if change is not None:
        what = (
            f"the data {cfg.data!r} changed since the run ({change}), so its held-out split is no longer "
            "the run's: the documents held out now may include text the model trained on"
            + _relative_hint(cfg.data)
        )
        if not allow_changed:
            raise ValueError(
                f"{what}; restore the run's data, score other text with --data, or pass --allow-changed-data "
                "to score it anyway"
            )
        log.warning("%s; scoring it anyway (--allow-changed-data)", what)
    return streams.heldout, change


def _relative_hint(spec: str) -> str:
    """For a run's data given as a relative path: that it is read from the current folder (a run trained
    in another folder names other files here, or none)."""
    if spec.startswith(("builtin:", "hf:")) or spec == "fasta:builtin":
        return ""
    if os.path.isabs(os.path.expanduser(spec.removeprefix("fasta:"))):
        return ""
    return (
        f" (the run's data is a relative path, read from the current folder {os.getcwd()!r}: if the run "
        "was trained in another folder, run this from there)"
    )


def check_has_heldout_split(checkpoint) -> None:
    """Refuse a model the task recipe trained (`eval niah` / `babilong` / `tasks` with `--save-model`): it
    trained on generated prompts, not on its config's ``data``, so that has no held-out split for it."""
    if "task_training" in checkpoint.config:
        raise ValueError(
            f"{str(checkpoint.path)!r} was trained by the task recipe on generated prompts, so it has no "
            "held-out split of its own: give the text to score with --data"
        )


def heldout_description(cfg, change: str | None) -> str:
    """What a result file calls a run's held-out split: "DATA (held-out split)", saying so when the data
    changed since the run (scored with --allow-changed-data)."""
    changed = "" if change is None else f"; changed since the run: {change}"
    return f"{cfg.data} (held-out split{changed})"


def run_ppl(args) -> int:
    """``titans eval ppl``: load a checkpoint, score held-out text, print and write JSON."""
    text_field = text_field_of(args)
    loaded = load_checkpoint_from(args.checkpoint)
    checkpoint = loaded.path
    out = Path(args.out) if args.out else run_folder_of(checkpoint) / EVAL_PPL_FILE
    check_writable(out, {"--data": args.data})
    device = resolve_device(args.device)
    model, cfg, tokenizer = load_model(loaded, map_location=device)
    seq_len = cfg.seq_len if args.seq_len is None else args.seq_len
    if args.data is None:
        check_has_heldout_split(loaded)
        data_state = loaded.trainer_state.get("data") or {}
        stream, change = heldout_split(cfg, tokenizer, data_state, allow_changed=args.allow_changed_data)
        data_desc, what = heldout_description(cfg, change), f"the held-out split of {cfg.data!r}"
    else:
        stream = whole_source_stream(args.data, tokenizer, text_field=text_field)
        data_desc, what = args.data, f"text source {args.data!r}"  # as whole_source_stream names it
    windows = EvalWindows(
        stream,
        seq_len=seq_len,
        num_windows=cfg.eval_windows if args.windows is None else args.windows,  # as the run scored
        batch_size=args.batch_size,
        what=what,
    )
    autocast = autocast_dtype_for(cfg.dtype if args.dtype is None else args.dtype, device)
    result = _heldout.evaluate_perplexity(model, windows, device=device, autocast_dtype=autocast)
    precision = str(autocast or next(model.parameters()).dtype).removeprefix("torch.")
    if not math.isfinite(result.loss):
        raise ValueError(
            f"{data_desc}: the loss is {result.loss}: the model's outputs are not finite (NaN or inf "
            "logits); nothing written"
        )
    report = {
        "checkpoint": str(checkpoint),
        "step": loaded.step,  # a copied or renamed checkpoint folder no longer says it
        "weights": loaded.weights_id,
        "data": data_desc,
        **result.to_dict(),
        "device": str(device),
        "dtype": precision,  # what the forward passes ran in (autocast, else the weights' dtype)
        "command": command_line(args),
    }
    bpb = f"{result.bpb:.4f}" if result.bpb is not None else "n/a"
    print(
        f"{data_desc}: {result.windows} windows x {result.seq_len} tokens  "
        f"loss {result.loss:.4f}  ppl {result.ppl:.3f}  bpb {bpb}"
    )
    write_json(out, report)
    print(f"wrote {out}")
    return 0


def add_text_field_arg(p) -> None:
    p.add_argument("--text-field", default=None, help="JSONL / dataset text field for --data (default: text)")


def text_field_of(args) -> str:
    """``--text-field`` (default "text"), refused without ``--data``: the held-out split is read with the
    run's own text_field (the option had been ignored there, and recorded in the result as used)."""
    if args.text_field is not None and args.data is None:
        raise ValueError(
            "--text-field applies to --data; the held-out split is read with the run's text_field"
        )
    return args.text_field or "text"


def add_changed_data_arg(p) -> None:
    """``--allow-changed-data``, for the commands that rebuild a run's held-out split (`heldout_stream`)."""
    p.add_argument(
        "--allow-changed-data",
        action="store_true",
        help="score the held-out split even when the run's data changed since the run (it may then hold "
        "training text; a warning says so)",
    )


def add_ppl_parser(evals) -> None:
    """Register ``titans eval ppl`` in the ``evals`` sub-parser collection."""
    p = evals.add_parser("ppl", help="held-out loss, perplexity and bits per byte of a checkpoint")
    p.add_argument(
        "--checkpoint",
        type=path_arg,
        required=True,
        help="a checkpoint folder or a run folder (newest checkpoint)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="text source to score: --windows windows spread over it (default: the checkpoint's held-out "
        "split)",
    )
    add_text_field_arg(p)
    add_changed_data_arg(p)
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the training seq_len)")
    p.add_argument(
        "--windows",
        type=int,
        default=None,
        help="number of windows, spread over the text (default: the run's eval_windows)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="precision, as the trainer's dtype: bfloat16 (bf16 autocast), float32, auto (bf16 on CUDA, "
        "float32 on CPU) (default: the run's dtype, as the trainer scored it)",
    )
    p.add_argument(
        "--out",
        type=path_arg,
        default=None,
        help="JSON output (default: RUN_DIR/eval_ppl.json; a checkpoint folder outside a run: in it)",
    )
    p.set_defaults(func=run_ppl)
