"""Every shell block in README.md and docs/*.md runs as written.

A fenced block tagged `sh`, `bash`, `shell` or `console` (there, only its `$ ` lines) runs in bash with
`set -e -o pipefail`, in a fresh copy of the repository (its sources; runs/, results/ and other
outputs start empty), with the checkout's `src` on PYTHONPATH and this Python's `bin` first on PATH; the test
fails, naming the block's file and line, on a non-zero exit. HTML comments on the lines just above a
block's opening fence adjust it for a test's budget, each saying why where it changes what runs:

    <!-- skip: REASON -->            not run (needs a GPU, the hub, files not shipped, many minutes)
    <!-- drop: TEXT :: REASON -->    the commands holding TEXT are left out (the rest run)
    <!-- long: OLD => NEW -->        OLD is replaced by NEW before running (a shorter budget, a free port)
    <!-- setup: COMMAND -->          runs first: what the text assumes the reader has (a document, a run)

In NEW and COMMAND, `$DOC_RUN` is a tiny trained run (a copy each block may write into) and `$DOC_PORT` a
free port. A mark whose TEXT or OLD is not in its block fails the test: marks can't go stale unnoticed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"sh", "bash", "shell", "console"}
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
MARK = re.compile(r"^\s*<!--\s*(skip|drop|long|setup)\s*:\s*(.*?)\s*-->\s*$")
# copied into each block's folder: everything tracked but what the blocks never read (and is large)
IGNORED = shutil.ignore_patterns(
    ".git", ".venv", "runs", "out", "results", "__pycache__", "*.egg-info", ".*_cache"
)
BLOCK_TIMEOUT = 150


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marks: list[tuple[str, str]] = field(default_factory=list)

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def extract(path: Path) -> list[Block]:
    """The shell blocks of a markdown file, with the marks just above each."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if lang in SHELLS:
            body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : j]]
            marks, k = [], i - 1
            while k >= 0 and (MARK.match(lines[k]) or not lines[k].strip()):
                if mark := MARK.match(lines[k]):
                    marks.insert(0, (mark.group(1), mark.group(2)))
                k -= 1
            blocks.append(Block(path, i + 1, lang, "\n".join(body), marks))
        i = j + 1
    return blocks


def commands(text: str, lang: str) -> list[str]:
    """The block's commands, each with its continuation lines (console: only what follows `$ `)."""
    out: list[str] = []
    continued = False
    for line in text.splitlines():
        if lang == "console" and not continued:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if continued:
            out[-1] += "\n" + line
        else:
            out.append(line)
        continued = line.rstrip().endswith("\\")
    return out


def script(block: Block) -> str:
    """The block as it runs: marks applied (each checked to match)."""
    cmds = commands(block.text, block.lang)
    setup = []
    for kind, arg in block.marks:
        if kind == "drop":
            text = arg.split("::")[0].strip()
            kept = [c for c in cmds if text not in c]
            assert len(kept) < len(cmds), f"{block.where}: `drop: {text}` matches no command of the block"
            cmds = kept
        elif kind == "long":
            old, sep, new = arg.partition("=>")
            old, new = old.strip(), new.strip()
            assert sep and old, f"{block.where}: a `long:` mark reads `OLD => NEW`, got {arg!r}"
            assert any(old in c for c in cmds), f"{block.where}: `long: {old} => ...` is not in the block"
            cmds = [c.replace(old, new) for c in cmds]
        elif kind == "setup":
            setup.append(arg)
    return "\n".join(["set -e -o pipefail", *setup, *cmds, ""])


def all_blocks() -> list[Block]:
    return [block for path in DOCS for block in extract(path)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def doc_run(tmp_path_factory) -> Path:
    """A tiny MAC run trained for 2 steps: what blocks that read a trained run copy (`$DOC_RUN`)."""
    run = tmp_path_factory.mktemp("doc-run") / "run"
    cmd = [sys.executable, "-m", "titans", "train", "--preset", "tiny", "--variant", "mac", "--steps", "2"]
    cmd += ["--batch-size", "2", "--seq-len", "64", "--run-dir", str(run), "--no-progress"]
    cmd += ["--set", "eval_windows=2", "--set", "sample_tokens=4", "--set", "threads=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=environment(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return run


def environment(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **extra}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def test_the_extractor_finds_blocks_and_their_marks(tmp_path):
    """Fences of either kind, indented ones, marks above (blank lines between allowed), console prompts."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "text\n<!-- skip: needs a GPU -->\n\n```bash\ntitans a \\\n  --b\n```\n"
        "```python\nprint()\n```\n- item\n\n  <!-- long: 200 => 2 -->\n  ~~~sh\n  titans c 200\n  ~~~\n"
        "```console\n$ titans d\noutput\n$ titans e \\\n  --f\n```\n"
    )
    blocks = extract(doc)
    assert [(b.line, b.lang) for b in blocks] == [(4, "bash"), (14, "sh"), (17, "console")]
    assert blocks[0].marks == [("skip", "needs a GPU")]
    assert commands(blocks[0].text, "bash") == ["titans a \\\n  --b"]
    assert blocks[1].marks == [("long", "200 => 2")] and "titans c 2\n" in script(blocks[1])
    assert commands(blocks[2].text, "console") == ["titans d", "titans e \\\n  --f"]
    blocks[1].marks = [("long", "300 => 3")]
    with pytest.raises(AssertionError, match="doc.md:14"):
        script(blocks[1])


@pytest.mark.parametrize("block", all_blocks(), ids=lambda b: b.where)
def test_documented_commands_run_as_written(block: Block, doc_run: Path, tmp_path: Path):
    skips = [arg for kind, arg in block.marks if kind == "skip"]
    if skips:
        pytest.skip(f"{block.where}: {skips[0]}")
    work = tmp_path / "repo"
    shutil.copytree(ROOT, work, ignore=IGNORED, symlinks=True)
    run = tmp_path / "doc-run"
    shutil.copytree(doc_run, run)
    env = environment(DOC_RUN=str(run), DOC_PORT=str(free_port()))
    text = script(block)
    log = tmp_path / "output.txt"
    with open(log, "w") as sink:  # a file, not a pipe: a server left in the background holds a pipe open
        proc = subprocess.Popen(
            ["bash", "-c", text],
            cwd=work,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: background servers end with it
        )
        try:
            proc.wait(timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = log.read_text(errors="replace")
    assert proc.returncode is not None and proc.returncode >= 0, (
        f"{block.where}: still running after {BLOCK_TIMEOUT} s\n{text}\n--- output:\n{out[-4000:]}"
    )
    assert proc.returncode == 0, f"{block.where}: exit {proc.returncode}\n{text}\n--- output:\n{out[-4000:]}"
