"""The `titans` command line: `titans train | eval ... | generate | read | inspect | serve | demo | kernels`.

Each command lives in the module of the part of the library it drives and registers itself through
`register(commands, evals)`; `commands` and `evals` are argparse sub-parser collections for top-level
commands and for `titans eval <task>`. A registered parser sets `func=callable(args) -> int | None`, and
may set `check=callable(args)`: option errors that need several options at once, raised as ValueError
before `func` loads or computes anything. Every option has a help line; `--help` shows the defaults.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys

from titans.validation import did_you_mean

# Imported by name (importlib) so that a part left out of a build only loses its commands.
COMMAND_MODULES = (
    "titans.demo",  # demo: the neural memory memorizing at test time
    "titans.models.cli",  # presets: parameter counts
    "titans.training.cli",  # train
    "titans.inference.cli",  # generate, read
    "titans.inference.inspection.cli",  # inspect: an HTML report of the memory along a text
    "titans.evaluation.cli",  # eval ppl | niah | babilong | tasks | ablate | depth
    "titans.forecast.cli",  # forecast train | eval | study | aggregate
    "titans.dna.cli",  # dna study | classify
    "titans.serving.cli",  # serve
    "titans.ops.cpu_kernels",  # kernels build: the fused CPU kernels, ahead of time
)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with each option's default appended, unless it is None or False (nothing to say)
    or the help already mentions one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" not in text
            and default is not None
            and default is not False  # a switch (store_true): its help says what it turns on
            and default != argparse.SUPPRESS
            and (action.option_strings or action.nargs in ("?", "*"))
        ):
            text += " (default: %(default)s)"
        return text


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with "did you mean" for a mistyped choice (a command, a --variant, ...)."""

    def _check_value(self, action: argparse.Action, value) -> None:
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(repr, action.choices))
            hint = did_you_mean(value, action.choices)
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {choices}){hint}")


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield sub
                yield from _subparsers(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="titans",
        description="Titans: neural long-term memory models. `titans COMMAND --help` describes a command.",
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    eval_parser = commands.add_parser("eval", help="evaluate a checkpoint (ppl, niah, babilong, ...)")
    evals = eval_parser.add_subparsers(dest="task", metavar="TASK")
    evals.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:  # a part not installed in this build: skip its commands
            if e.name != name:
                raise
            continue
        module.register(commands, evals)
    for sub in _subparsers(parser):
        sub.formatter_class = HelpFormatter
        # the innermost command's parser sets this last: errors name it ("titans forecast eval: error: ...")
        sub.set_defaults(_prog=sub.prog)
    return parser


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> None:
    """Report options the command does not know as that command's error (argparse would report them as
    the top-level parser's), with the closest option it has."""
    # compared without the dashes, which every option shares
    options = {s.lstrip("-"): s for action in parser._actions for s in action.option_strings}
    hint = ""
    for word in extras:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=")[0].lstrip("-"), list(options), n=1, cutoff=0.6)
            if close:
                hint = f"; did you mean {options[close[0]]}?"
                break
    parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


# Errors in what the user asked for (a bad option or config value, a missing or damaged file, a missing
# optional package, a learning rate the run diverges at: the trainer's FloatingPointError) or in the machine
# (a full disk, a folder without write permission): one line on stderr and exit status 2, not a traceback.
USER_ERRORS = (ValueError, OSError, ImportError, KeyError, FloatingPointError)


def _user_errors() -> tuple[type[BaseException], ...]:
    from titans.runtime.checkpoint import CheckpointError  # imported only once something went wrong

    return (*USER_ERRORS, CheckpointError)


def _out_of_memory(error: BaseException) -> bool:
    """numpy's and Python's MemoryError, torch's OutOfMemoryError (CUDA), or torch's CPU allocator failing
    (a plain RuntimeError): a size the machine cannot hold, e.g. a --batch-size of 10**11."""
    import torch

    return isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
    )


def main(argv: list[str] | None = None) -> int:
    # Flush subnormal floats to zero, before torch starts its thread pool (the threads inherit the
    # setting). Memory weights that get no writes decay geometrically into subnormals, which x86 CPUs
    # process many times slower: without this a long stream slows down as it goes (3.9x by 200K tokens,
    # benchmarks/subnormal_stream.py).
    # numpy reads its float limits when numpy.ma loads (np.percentile loads it); with subnormals already
    # flushed it would warn, on every command that reaches it, that the smallest subnormal is zero
    import numpy.ma  # noqa: F401
    import torch

    torch.set_flush_denormal(True)
    # a path's bytes that are not UTF-8 (Python holds them as lone surrogates) are printed and logged as
    # escapes: a console's strict UTF-8 encoder failed on them, ending the command at its first line
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    from titans.runtime.device import tf32  # imports torch: here, as torch above, not when cli is imported

    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    prog = vars(args).pop("_prog", parser.prog)  # popped: commands record their options in result files
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, as result files record it
    command_parser = next((p for p in _subparsers(parser) if p.prog == prog), parser)
    if extras:
        _unrecognized(command_parser, extras)
    try:
        check = getattr(args, "check", None)
        if check is not None:
            check(args)
        # float32 matrix products on CUDA in TF32, as `titans train` runs them by default (TrainConfig.tf32):
        # the memory's Triton kernels follow the flag, and in exact float32 they run without tensor cores
        with tf32(True):
            return int(args.func(args) or 0)
    except _user_errors() as e:
        print(f"{prog}: error: {_message(e)}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        # a bare MemoryError has no text; torch's allocator starts its own with "[enforce fail at ...] ..."
        detail = re.sub(r"^\[enforce fail at [^\]]*\] err == 0\. ", "", _message(e).strip()).splitlines()
        print(f"{prog}: error: out of memory" + (f" ({detail[0]})" if detail else ""), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's status, not a traceback (`titans train`
        # handles its own signals: it saves a checkpoint first)
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _message(error: BaseException) -> str:
    """The error's text; an OS error on a file names the file ("no space left on device: 'run/x.jsonl'"),
    not Python's "[Errno 28] ..." form."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        where = repr(str(error.filename))
        if error.filename2 is not None:  # a rename or link: both ends
            where += f" -> {str(error.filename2)!r}"
        return f"{error.strerror.lower()}: {where}"
    return str(error)


if __name__ == "__main__":
    sys.exit(main())
