"""`titans eval ppl`: held-out loss, perplexity and bits per byte of a saved checkpoint.

    titans eval ppl --checkpoint C [--data SPEC] [--seq-len N] [--windows K]

scores a checkpoint's own held-out split, or all of the text named by ``--data`` (see
``titans.data.sources``), with ``titans.training.perplexity.evaluate_perplexity`` (the function the
trainer's own evaluations use), prints the result and writes it as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from titans.data.loader import EvalWindows
from titans.data.sources import load_source
from titans.data.stream import TokenStream, encode_documents, load_token_streams, separator_ids, token_dtype
from titans.data.tokenizers import Tokenizer
from titans.runtime.device import resolve_device
from titans.runtime.loading import load_checkpoint_from
from titans.training import perplexity as _heldout
from titans.training.model_io import load_model


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


def heldout_stream(cfg, tokenizer: Tokenizer) -> TokenStream:
    """The held-out split a training run (its `TrainConfig`) set aside, as that run split and tokenized it."""
    return load_token_streams(
        cfg.data,
        tokenizer,
        heldout_fraction=cfg.heldout_fraction,
        cache_dir=cfg.cache_dir,
        text_field=cfg.text_field,
    ).heldout


def run_ppl(args) -> int:
    """``titans eval ppl``: load a checkpoint, score held-out text, print and write JSON."""
    loaded = load_checkpoint_from(args.checkpoint)
    checkpoint = loaded.path
    device = resolve_device(args.device)
    model, cfg, tokenizer = load_model(loaded, map_location=device)
    seq_len = cfg.seq_len if args.seq_len is None else args.seq_len
    if args.data is None:
        stream = heldout_stream(cfg, tokenizer)
        data_desc = f"{cfg.data} (held-out split)"
    else:
        stream = whole_source_stream(args.data, tokenizer, text_field=args.text_field)
        data_desc = args.data
    windows = EvalWindows(stream, seq_len=seq_len, num_windows=args.windows, batch_size=args.batch_size)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    result = _heldout.evaluate_perplexity(model, windows, device=device, autocast_dtype=autocast)
    report = {"checkpoint": str(checkpoint), "data": data_desc, **result.to_dict()}
    bpb = f"{result.bpb:.4f}" if result.bpb is not None else "n/a"
    print(
        f"{data_desc}: {result.windows} windows x {result.seq_len} tokens  "
        f"loss {result.loss:.4f}  ppl {result.ppl:.3f}  bpb {bpb}"
    )
    out = Path(args.out) if args.out else checkpoint.parent.parent / "eval_ppl.json"  # the run folder
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def add_ppl_parser(evals) -> None:
    """Register ``titans eval ppl`` in the ``evals`` sub-parser collection."""
    p = evals.add_parser("ppl", help="held-out loss, perplexity and bits per byte of a checkpoint")
    p.add_argument(
        "--checkpoint", required=True, help="a checkpoint folder or a run folder (newest checkpoint)"
    )
    p.add_argument(
        "--data", default=None, help="text source to score in full (default: the checkpoint's held-out split)"
    )
    p.add_argument("--text-field", default="text", help="JSONL / dataset text field for --data")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the training seq_len)")
    p.add_argument("--windows", type=int, default=64, help="number of windows, spread over the text")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1")
    p.add_argument("--out", default=None, help="JSON output (default: RUN_DIR/eval_ppl.json)")
    p.set_defaults(func=run_ppl)
