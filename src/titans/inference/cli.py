"""`titans read` and `titans generate`: read a long document once, then query it many times; `titans
export-hf`: a checkpoint as a Hugging Face `transformers` folder.

    titans read --checkpoint runs/main --input book.txt --save-state book.safetensors
    titans generate --checkpoint runs/main --state book.safetensors --prompt "Who is Ahab?" --num-samples 3
    titans export-hf --checkpoint runs/main --out titans-small

`read` streams the file (text blocks cut at line ends, tokenized block by block) through chunked prefill,
so memory is bounded by the model's state, not the document; it prints tokens/s and peak RSS.
`generate` starts every sample from the same saved state (the file is never modified unless
--save-state names it).
"""

from __future__ import annotations

import argparse
import io
import math
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from titans._fs import check_writable
from titans.data.sources import open_text
from titans.inference.generation import IncrementalDecoder, generate
from titans.models.decode_graph import check_static_decoding
from titans.models.lm import TitansLM
from titans.models.state import TitansState, load_state, read_state_header, save_state, state_nbytes
from titans.models.streaming import prefill
from titans.runtime.checkpoint import Checkpoint
from titans.runtime.device import resolve_device
from titans.runtime.loading import checkpoint_of, load_trained
from titans.runtime.sampling import SAMPLING
from titans.validation import path_arg, text_arg

DEFAULT_BLOCK_CHARS = 1 << 20  # characters read and tokenized at a time by `titans read`


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, MiB (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def read_text_blocks(path: str, block_chars: int = DEFAULT_BLOCK_CHARS) -> Iterator[str]:
    """The text of `path` ("-" for stdin) in blocks of about `block_chars` characters, each ending at a line
    end (so a tokenizer sees whole lines), or, in a line longer than a block, after its last space or tab
    (whole words), or at the block's end if it has none; block_chars <= 0 reads the whole file as one block.
    Line ends are kept as they are ("\r\n" stays two characters, as training reads files)."""
    if path == "-":
        # stdin read as a file is: invalid UTF-8 bytes become U+FFFD (Python's own stdin would pass them on
        # as lone surrogates, which no tokenizer encodes), a leading UTF-8 byte-order mark is skipped
        raw = getattr(sys.stdin, "buffer", None)
        stream = sys.stdin
        if raw is not None:
            stream = io.TextIOWrapper(raw, encoding="utf-8-sig", errors="replace", newline="")
    else:
        stream = open_text(path)  # UTF-16 and byte-order marks as training reads them
    try:
        if block_chars <= 0:
            yield stream.read()
            return
        carry = ""
        while True:
            block = stream.read(block_chars)
            if not block:
                break
            block = carry + block
            # a line longer than a block is cut too: carried whole, a file of one long line was held in
            # memory entire and searched again at every block
            cut = block.rfind("\n") + 1 or max(block.rfind(" "), block.rfind("\t")) + 1 or len(block)
            carry = block[cut:]
            yield block[:cut]
        if carry:
            yield carry
    finally:
        if path != "-":
            stream.close()
        elif stream is not sys.stdin:
            stream.detach()  # leaves sys.stdin's buffer open


def check_save_state(path: str, inputs: dict[str, str | None] | None = None) -> None:
    """Refuse a --save-state that could not be written (a folder, a file where its folder should be, no
    permission, one of the command's `inputs`) before any work: the write comes only after the whole text
    was read."""
    if Path(path).is_dir():
        raise ValueError(f"--save-state {path!r} is a folder; give a file name (e.g. state.safetensors)")
    check_writable(path, inputs)


def load_continued_state(
    path: str, checkpoint: Checkpoint, model: TitansLM, device: torch.device
) -> TitansState:
    """`--state`: the saved state (another config's is refused by `load_state`), with a warning when other
    weights of the same config wrote it (another run, or another step of this one): its memory was written
    through their projections, so this model reads it as noise."""
    state = load_state(path, map_location=device, model=model)
    wrote, mine = read_state_header(path).get("weights"), checkpoint.weights_id
    if wrote and mine and wrote != mine:
        print(
            f"warning: --state {path!r} was written by other weights of this config (model.safetensors "
            f"sha256 {wrote[:12]}..., this checkpoint's {mine[:12]}...): its memory will not mean to this "
            "model what it meant to that one",
            file=sys.stderr,
        )
    return state


def run_read(args: argparse.Namespace) -> int:
    path = Path(args.input)
    if args.input != "-" and not path.is_file():
        raise FileNotFoundError(f"--input: no such file {str(path)!r}")
    check_save_state(args.save_state, {"--input": None if args.input == "-" else args.input})
    device = resolve_device(args.device)
    checkpoint = checkpoint_of(args.checkpoint)
    model, tokenizer = load_trained(checkpoint, map_location=device)
    state = load_continued_state(args.state, checkpoint, model, device) if args.state else None
    start_position = state.position if state is not None else 0

    def pieces() -> Iterator[torch.Tensor]:
        for block in read_text_blocks(args.input, args.block_chars):
            yield torch.tensor(tokenizer.encode(block), dtype=torch.int64)

    t0 = time.perf_counter()
    _, state = prefill(model, pieces(), state, piece_len=args.piece_len, progress=not args.no_progress)
    seconds = time.perf_counter() - t0
    if state is None or state.position == start_position:
        raise ValueError(f"--input {str(path)!r} holds no tokens")
    n = state.position - start_position
    save_state(state, args.save_state, weights=checkpoint.weights_id)
    print(
        f"read {n:,} tokens in {seconds:.1f} s ({n / max(seconds, 1e-9):,.0f} tokens/s); state now at "
        f"position {state.position:,}, {state_nbytes(state) / 2**20:.2f} MiB, saved to {args.save_state}; "
        f"peak RSS {peak_rss_mib():,.0f} MiB"
    )
    return 0


def _int_or_none(text: str) -> int | None:
    if text.strip().lower() in ("none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or none, got {text!r}") from None


class _SamplingOption(argparse.Action):
    """Stores a sampling option's value and records that it was given: `--greedy` would leave it unused."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.sampling_given = (*namespace.sampling_given, option_string)


def check_generate_args(args: argparse.Namespace) -> None:
    """Option errors of `titans generate`, found before anything is loaded or generated."""
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.save_state and args.num_samples > 1:
        raise ValueError(
            f"--save-state needs --num-samples 1 (one state per sample), got --num-samples {args.num_samples}"
        )
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not 0 <= args.seed < 2**64:  # what a torch generator takes
        raise ValueError(f"--seed must be in [0, 2**64), got {args.seed}")
    if args.greedy and args.sampling_given:
        given = ", ".join(dict.fromkeys(args.sampling_given))
        raise ValueError(f"--greedy takes the most likely token: give it or {given}, not both")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.save_state:  # last: it makes the file's folder, as the write would
        check_save_state(args.save_state)


def run_generate(args: argparse.Namespace) -> int:
    """Print each sample as it is generated: the prompt, then every piece of text as soon as it is whole."""
    check_generate_args(args)
    device = resolve_device(args.device)
    if args.compile == "cuda_graph" and device.type != "cuda":  # before the prompt is printed
        raise ValueError(f"--compile cuda_graph needs a CUDA device, this run is on {device}")
    checkpoint = checkpoint_of(args.checkpoint)
    model, tokenizer = load_trained(checkpoint, map_location=device)
    if args.compile:  # before the prompt is printed
        check_static_decoding(model, "--compile")
    state = load_continued_state(args.state, checkpoint, model, device) if args.state else None
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise ValueError("--prompt must not be empty (the next token is predicted from it)")
    prompt = torch.tensor([ids], dtype=torch.int64, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(args.seed)
    stop = None
    if not args.no_stop and tokenizer.eos_id is not None:
        stop = tokenizer.eos_id
    final_state = None
    # one sample at a time, each from the same starting state, so that each can be printed as it grows
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1}")
        print(args.prompt, end="", flush=True)
        decoder = IncrementalDecoder(tokenizer, context=ids)  # continues the prompt printed above

        def show(token: torch.Tensor, decoder: IncrementalDecoder = decoder) -> None:
            if int(token[0]) != stop:  # the end-of-text token ends the sample unprinted
                piece = decoder.push(int(token[0]))
                if piece:
                    print(piece, end="", flush=True)

        result = generate(
            model,
            prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            greedy=args.greedy,
            stop_tokens=stop,
            generator=generator,
            state=state,
            return_state=bool(args.save_state),
            on_token=show,
            compiled=args.compile or False,
        )
        if args.save_state:
            _, final_state = result
        print(decoder.finish(), flush=True)
    if args.save_state:
        save_state(final_state, args.save_state, weights=checkpoint.weights_id)
        # on stderr: stdout holds only the generated text
        print(f"wrote {args.save_state} (the state after the generated text)", file=sys.stderr)
    return 0


def run_export_hf(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        raise FileExistsError(f"--out {str(out)!r} exists and is not empty (--overwrite writes into it)")
    model, tokenizer = load_trained(args.checkpoint)
    try:
        # local: transformers is an optional extra, needed only by this command
        from titans.hf.export import save_pretrained
    except ModuleNotFoundError as e:
        raise ImportError(f"export-hf needs transformers: pip install 'titans[hf]' ({e})") from None
    try:  # another export may fill --out while this one loads and writes
        files = save_pretrained(model, out, tokenizer, overwrite=args.overwrite)
    except FileExistsError as e:
        raise FileExistsError(f"--out {e} (--overwrite writes into it)") from None
    print(f"wrote {', '.join(str(f) for f in files)}")
    print(
        f"load with AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True) and "
        f"AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)"
    )
    return 0


def register(commands, evals) -> None:
    p = commands.add_parser("read", help="read a long document into the model's state and save the state")
    p.add_argument("--checkpoint", type=path_arg, required=True, help="checkpoint folder or run folder")
    p.add_argument("--input", type=path_arg, required=True, help="UTF-8 text file ('-' for stdin)")
    p.add_argument(
        "--save-state", type=path_arg, required=True, help="where to write the state (.safetensors)"
    )
    p.add_argument("--state", type=path_arg, help="continue from this saved state (e.g. a second document)")
    p.add_argument("--piece-len", type=int, default=None, help="tokens per model call (default: automatic)")
    p.add_argument(
        "--block-chars",
        type=int,
        default=DEFAULT_BLOCK_CHARS,
        help="characters tokenized at a time, cut at line ends (<= 0: the whole file at once)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_read)

    g = commands.add_parser(
        "generate",
        help="generate text, optionally from a saved state",
        description="Continue --prompt with the model of --checkpoint, printing the text as it is generated.",
    )
    g.add_argument("--checkpoint", type=path_arg, required=True, help="checkpoint folder or run folder")
    g.add_argument("--state", type=path_arg, help="a state saved by `titans read` (or generate --save-state)")
    g.add_argument("--prompt", required=True, type=text_arg, help="text to continue (at least one token)")
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens generated per sample at most")
    g.add_argument(
        "--temperature",
        type=float,
        action=_SamplingOption,
        default=SAMPLING.temperature,
        help="sampling temperature (0: greedy)",
    )
    g.add_argument(
        "--top-k",
        type=_int_or_none,
        action=_SamplingOption,
        default=SAMPLING.top_k,
        help="sample from the k most likely tokens (none: from all)",
    )
    g.add_argument(
        "--top-p",
        type=float,
        action=_SamplingOption,
        default=None,
        help="sample from the most likely tokens up to this probability",
    )
    g.add_argument(
        "--greedy", action="store_true", help="always take the most likely token (no sampling options)"
    )
    g.add_argument(
        "--compile",
        nargs="?",
        const="compile",
        choices=("compile", "cuda_graph", "eager"),
        help="decode through fixed state buffers, each step compiled (torch.compile) or a CUDA graph",
    )
    g.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same samples)")
    g.add_argument("--num-samples", type=int, default=1, help="samples, each from the same starting state")
    g.add_argument("--no-stop", action="store_true", help="do not stop at the tokenizer's end-of-text token")
    g.add_argument(
        "--save-state", type=path_arg, help="write the state after the generated text here (one sample only)"
    )
    g.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1")
    g.set_defaults(func=run_generate, check=check_generate_args, sampling_given=())

    e = commands.add_parser(
        "export-hf",
        help="save a checkpoint as a Hugging Face transformers folder (model, tokenizer, remote code)",
        description="Write a checkpoint's model and tokenizer as a folder that transformers loads with "
        "AutoModelForCausalLM (trust_remote_code=True), AutoTokenizer and pipeline('text-generation'). "
        "Needs the hf extra.",
    )
    e.add_argument("--checkpoint", type=path_arg, required=True, help="checkpoint folder or run folder")
    e.add_argument("--out", type=path_arg, required=True, help="the folder to write")
    e.add_argument("--overwrite", action="store_true", help="write into --out even if it holds files")
    e.set_defaults(func=run_export_hf)


__all__ = [
    "check_generate_args",
    "peak_rss_mib",
    "read_text_blocks",
    "register",
    "run_export_hf",
    "run_generate",
    "run_read",
]
