"""`titans inspect`: the HTML report holds the trace's numbers token by token, is self-contained, and renders
in a real browser (headless Chromium) to a page that is not blank."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from micro_train import micro_config
from titans.cli import main as titans_main
from titans.inference.inspection import render_html, set_surprise_threshold, token_texts, trace_text
from titans.training.model_io import load_model
from titans.training.trainer import Trainer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TEXT = "The memory writes what surprises it.\nThe memory writes what surprises it.\nOnce more: the memory.\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inspect")
    cfg = micro_config(root / "run", root / "cache", steps=1, batch_size=2, eval_windows=1)
    Trainer(cfg).train(handle_signals=False)
    return root / "run"


def _spans(page: str) -> list[tuple[str, str]]:
    """(class, tooltip) of every token span."""
    return re.findall(r'<span class="(t(?: w)?)" style="[^"]*" title="([^"]*)"', page)


def test_report_holds_the_trace_token_by_token(run_dir):
    model, _, tokenizer = load_model(run_dir)
    ids = tokenizer.encode(TEXT)
    with torch.no_grad():
        surprise = model.forward_with_stats(torch.tensor([ids])).stats[0].surprise
    threshold = float(surprise.median())
    set_surprise_threshold(model, threshold)
    trace = trace_text(model, torch.tensor(ids), max_norm=3.0)
    assert trace.threshold == threshold and trace.max_norm == 3.0
    assert trace.surprise.shape == (len(trace.layers), len(ids)) and np.isnan(trace.loss[0])
    assert 0 < trace.report.write_rate < 1
    page = render_html(trace, token_texts(tokenizer, ids), "t", {"k": "v"})
    spans = _spans(page)
    assert len(spans) == len(ids)
    written = trace.written.reshape(-1, len(ids)).any(0)
    assert [cls == "t w" for cls, _ in spans] == written.tolist()
    mean = trace.surprise.mean(0)
    for t in (0, 7, len(ids) - 1):
        tip = html.unescape(spans[t][1])
        assert tip.startswith(f"#{t} ")
        assert f"surprise {float(mean[t]):.3g}" in tip
    assert "".join(token_texts(tokenizer, ids)) == TEXT
    # self-contained: no external resource of any kind
    assert not re.search(r"(src|href)=|https?://|@import|url\(", page)
    assert page.count("<svg") == 7


def test_inspect_command_and_its_errors(run_dir, tmp_path, capsys):
    out = tmp_path / "r.html"
    args = ["inspect", "--checkpoint", str(run_dir), "--prompt", TEXT, "--out", str(out), "--device", "cpu"]
    assert titans_main([*args, "--threshold", "0.5", "--max-tokens", "40"]) == 0
    assert "inspected 40 tokens (truncated)" in capsys.readouterr().out
    assert len(_spans(out.read_text())) == 40
    assert titans_main([*args, "--text", "x.txt"]) == 2
    assert "exactly one of --text" in capsys.readouterr().err
    assert titans_main([*args, "--threshold", "-1"]) == 2
    assert (
        titans_main(
            ["inspect", "--checkpoint", str(run_dir), "--text", str(tmp_path / "no.txt"), "--out", "o"]
        )
        == 2
    )
    assert "no text file" in capsys.readouterr().err
    # an --out that would replace the text, or could not be written, is refused before the trace
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    argv = ["inspect", "--checkpoint", str(run_dir), "--text", str(text), "--device", "cpu"]
    assert titans_main([*argv, "--out", str(text)]) == 2
    assert "is the --text file" in capsys.readouterr().err and text.read_text() == TEXT
    assert titans_main([*argv, "--out", str(text / "r.html")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_inspect_reads_only_the_start_of_a_long_file_and_keeps_its_line_ends(run_dir, tmp_path, capsys):
    """--max-tokens 40 of a long file: the file was read and tokenized whole first (a 48 MiB file took
    0.7 GB for a 100-token report), and its "\r\n" became "\n"."""
    from titans.inference.inspection import cli as inspect_cli
    from titans.runtime.loading import load_trained

    _, tokenizer = load_trained(run_dir)
    text = tmp_path / "long.txt"
    text.write_bytes(("line\r\n" * 60_000).encode())
    read = []
    encode = tokenizer.encode
    ids, truncated = inspect_cli._first_tokens(text, _Counting(encode, read), 40)
    assert truncated and ids[:40] == encode("line\r\n" * 7)[:40]
    assert max(read) < 2_000  # characters encoded: the start of the 360,000
    short = tmp_path / "short.txt"
    short.write_bytes(b"a\r\nb")
    assert inspect_cli._first_tokens(short, tokenizer, 40) == (encode("a\r\nb"), False)
    out = tmp_path / "r.html"
    args = [
        "inspect",
        "--checkpoint",
        str(run_dir),
        "--text",
        str(text),
        "--out",
        str(out),
        "--device",
        "cpu",
    ]
    assert titans_main([*args, "--max-tokens", "40"]) == 0
    assert "inspected 40 tokens (truncated)" in capsys.readouterr().out


class _Counting:
    """A tokenizer stand-in that records the length of each text it encodes."""

    def __init__(self, encode, lengths: list[int]) -> None:
        self.encode_, self.lengths = encode, lengths

    def encode(self, text: str) -> list[int]:
        self.lengths.append(len(text))
        return self.encode_(text)


def _screenshot(page: Path, png: Path, profile: Path) -> np.ndarray:
    """Headless Chromium's 1200 x 900 screenshot of `page`, as (900, 1200, 3) floats."""
    image = pytest.importorskip("PIL.Image", reason="Pillow is not installed (it comes with titans[train])")
    proc = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            f"--screenshot={png}",
            "--window-size=1200,900",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert png.is_file(), f"no screenshot (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return np.asarray(image.open(png).convert("RGB"), dtype=np.float64)


def _reddish(pixels: np.ndarray) -> np.ndarray:
    """Which pixels are clearly more red than blue (orange to red; not the palest yellows)."""
    return pixels[..., 0] > pixels[..., 2] + 40


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (scripts/install_test_deps.sh installs it)"
)
def test_report_renders_in_headless_chromium(run_dir, tmp_path):
    page, text = tmp_path / "report.html", tmp_path / "text.txt"
    text.write_text(TEXT * 4)
    cmd = ["inspect", "--checkpoint", str(run_dir), "--text", str(text), "--out", str(page)]
    assert titans_main([*cmd, "--device", "cpu", "--threshold", "0.3", "--max-norm", "5"]) == 0
    pixels = _screenshot(page, tmp_path / "shot.png", tmp_path / "profile")
    assert pixels.shape == (900, 1200, 3)
    assert pixels.std() > 20  # text, colours and plots, not a blank page
    # the surprise colouring shows: pixels that turn red against the same page with the tokens' backgrounds
    # removed (the same layout; the plots' red lines are in both)
    plain = tmp_path / "plain.html"
    plain.write_text(re.sub(r'style="background:[^";]*;?', 'style="', page.read_text()))
    uncoloured = _screenshot(plain, tmp_path / "plain.png", tmp_path / "profile")
    coloured = (pixels != uncoloured).any(-1) & _reddish(pixels) & ~_reddish(uncoloured)
    assert coloured.mean() > 0.002
