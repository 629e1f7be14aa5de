"""generate(): greedy == teacher-forced argmax, determinism, top-k/top-p, seeds, stop tokens, states;
and the `titans read` / `titans generate` commands on a checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial

import numpy as np
import pytest
import torch

from tiny_lm import random_tokens, save_tiny_run
from tiny_lm import tiny_model as shared_model
from titans import VARIANTS
from titans.inference import generate, load_state, prefill, sample_next

F64 = torch.float64
VOCAB = 47

tiny_model = partial(shared_model, vocab_size=VOCAB)
tokens = partial(random_tokens, vocab=VOCAB)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_is_the_teacher_forced_argmax(variant):
    model = tiny_model(variant)
    prompt = tokens(2, 9)
    out = generate(model, prompt, 15, greedy=True)
    assert out.shape == (2, 24) and torch.equal(out[:, :9], prompt)
    with torch.no_grad():
        logits, _ = model(out[:, :-1])
    assert torch.equal(logits[:, 8:].argmax(-1), out[:, 9:])
    assert torch.equal(generate(model, prompt, 15, greedy=True), out)  # deterministic
    assert torch.equal(generate(model, prompt, 15, temperature=0), out)  # temperature 0 is greedy
    assert torch.equal(model.generate(prompt, 15, greedy=True), out)  # TitansLM.generate


def test_top_k_1_and_tiny_top_p_are_greedy():
    model = tiny_model("mag")
    prompt = tokens(3, 5)
    greedy = generate(model, prompt, 12, greedy=True)
    assert torch.equal(generate(model, prompt, 12, top_k=1, temperature=1.3, generator=seeded(0)), greedy)
    assert torch.equal(generate(model, prompt, 12, top_p=1e-9, generator=seeded(1)), greedy)


def test_seeds_reproduce_samples():
    model = tiny_model("lmm")
    prompt = tokens(2, 4)
    a = generate(model, prompt, 25, temperature=1.0, generator=seeded(123))
    b = generate(model, prompt, 25, temperature=1.0, generator=seeded(123))
    c = generate(model, prompt, 25, temperature=1.0, generator=seeded(124))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_sample_next_respects_top_k_and_top_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=F64)
    logits = probs.log().expand(4000, -1)
    draw = sample_next(logits, top_k=2, generator=seeded(0))
    assert set(draw.tolist()) == {0, 1}
    draw = sample_next(logits, top_k=3, generator=seeded(0))  # one below the vocabulary: still a cut
    assert set(draw.tolist()) == {0, 1, 2}
    draw = sample_next(logits, top_p=0.75, generator=seeded(0))  # 0.5 + 0.3 reaches 0.75
    assert set(draw.tolist()) == {0, 1}
    draw = sample_next(logits, top_p=0.85, generator=seeded(0))
    assert set(draw.tolist()) == {0, 1, 2}
    draw = sample_next(logits, generator=seeded(0))
    freq = torch.bincount(draw, minlength=4).double() / draw.numel()
    torch.testing.assert_close(freq, probs[0], atol=0.03, rtol=0)
    assert torch.equal(sample_next(logits[:3], greedy=True), torch.zeros(3, dtype=torch.int64))


def test_sampling_at_the_limits_of_float32():
    """Settings that pass the checks sample as their limits do, in float32 logits: a temperature under the
    smallest normal float32 (1e-39 is subnormal, 1e-45 rounds to the smallest subnormal, and the suite
    flushes subnormals to 0) and a top_p that rounds to 0 are greedy; past float32's largest, the
    temperature samples the top_k tokens uniformly, never others. A non-finite temperature is refused by
    name (nan passed the check, inf sampled outside the top k)."""
    model = tiny_model("mag", dtype=torch.float32)
    prompt = tokens(2, 5)
    greedy = generate(model, prompt, 6, greedy=True)
    for kw in (dict(temperature=1e-39), dict(temperature=1e-45), dict(top_p=1e-300), dict(top_p=1e-40)):
        assert torch.equal(generate(model, prompt, 6, generator=seeded(0), **kw), greedy), kw
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"temperature must be a finite number >= 0, got {bad}"):
            generate(model, prompt, 3, temperature=bad, top_k=5)
    logits = torch.randn(2000, VOCAB, generator=seeded(1))
    top = logits.topk(5, dim=-1).indices
    draw = sample_next(logits, temperature=1e300, top_k=5, generator=seeded(0))
    assert (draw[:, None] == top).any(-1).all()
    assert torch.equal(sample_next(logits, temperature=1e-45, generator=seeded(0)), logits.argmax(-1))


def test_sample_next_refuses_bad_options():
    """sample_next checks its options as generate does, naming itself: top_k < 1, a NaN or negative
    temperature (not silently greedy), top_p outside (0, 1] or a bool; numpy numbers are numbers."""
    logits = torch.tensor([[5.0, 0.0, -5.0, 1.0]])
    cases = [
        (dict(top_k=0), "top_k must be a positive int or None, got 0"),
        (dict(top_k=-1), "top_k must be a positive int or None, got -1"),
        (dict(top_k=True), "top_k must be a positive int or None, got True"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
        (dict(temperature=-1.0), "temperature must be a finite number >= 0, got -1.0"),
        (dict(top_p=-0.5), r"top_p must be a number in \(0, 1\] or None, got -0.5"),
        (dict(top_p=7), r"top_p must be a number in \(0, 1\] or None, got 7"),
        (dict(top_p=True), r"top_p must be a number in \(0, 1\] or None, got True"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=f"^sample_next: {message}$"):
            sample_next(logits, generator=seeded(0), **kw)
    want = sample_next(logits, temperature=0.5, top_k=2, top_p=0.9, generator=seeded(3))
    got = sample_next(
        logits, temperature=np.float32(0.5), top_k=np.int64(2), top_p=np.float64(0.9), generator=seeded(3)
    )
    assert torch.equal(got, want)


def test_stop_tokens_stop_each_row_and_pad_it():
    model = tiny_model("mac")
    prompt = tokens(2, 6)
    full = generate(model, prompt, 20, greedy=True)
    stop = int(full[0, 6 + 3])  # row 0 emits it at its 4th new token
    out = generate(model, prompt, 20, greedy=True, stop_tokens=[stop])
    ends = []
    for row in range(2):
        hits = (full[row, 6:] == stop).nonzero()
        end = 6 + int(hits[0]) + 1 if len(hits) else full.shape[1]
        ends.append(end)
        assert torch.equal(out[row, :end], full[row, :end])
        assert (out[row, end:] == stop).all()
    assert out.shape[1] == max(ends)  # stops early once every row is finished
    # stopping on the first token: only one new column
    first = generate(model, prompt, 20, greedy=True, stop_tokens=full[:, 6].tolist())
    assert first.shape[1] == 7
    # integer-like ids: a numpy integer, a tensor of ids, a 0-d tensor
    for ids in (np.int64(stop), torch.tensor([stop]), torch.tensor(stop), [np.int32(stop)]):
        assert torch.equal(generate(model, prompt, 20, greedy=True, stop_tokens=ids), out)


def test_return_state_continues_exactly():
    model = tiny_model("mal")
    prompt = tokens(1, 7)
    out, state = generate(model, prompt, 10, greedy=True, return_state=True)
    assert state.position == out.shape[1]
    more = tokens(1, 5, seed=9)
    with torch.no_grad():
        full, _ = model(torch.cat([out, more], dim=1))
        cont, _ = model(more, state)
    torch.testing.assert_close(cont, full[:, out.shape[1] :], atol=1e-10, rtol=0)


def test_generate_from_a_state_shared_by_rows():
    model = tiny_model("mac")
    doc, question = tokens(1, 30, seed=3), tokens(1, 4, seed=4)
    _, state = prefill(model, doc)
    one = generate(model, question, 8, greedy=True, state=state)
    three = generate(model, question.expand(3, -1), 8, greedy=True, state=state)
    assert all(torch.equal(three[r], one[0]) for r in range(3))
    whole = generate(model, torch.cat([doc, question], dim=1), 8, greedy=True)
    assert torch.equal(whole[:, 30:], one)  # reading the doc first == having it in the prompt


def test_on_token_and_zero_new_tokens():
    model = tiny_model("swa")
    prompt = tokens(2, 5)
    seen = []
    out = generate(model, prompt, 6, greedy=True, on_token=seen.append)
    assert torch.equal(torch.stack(seen, dim=1), out[:, 5:])
    assert torch.equal(generate(model, prompt, 0), prompt)


def test_generate_refuses_bad_arguments():
    model = tiny_model("lmm")
    prompt = tokens(1, 3)
    with pytest.raises(ValueError, match="empty"):
        generate(model, prompt[:, :0], 5)
    with pytest.raises(ValueError, match="batch, seq"):
        generate(model, prompt[0], 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, prompt, -1)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 3, temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompt, 3, top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, prompt, 3, top_k=0)
    with pytest.raises(TypeError, match="integer token ids"):
        generate(model, prompt.double(), 3)
    assert generate(model, prompt.int(), 2, greedy=True).dtype == torch.int64
    with pytest.raises(
        ValueError, match=rf"stop_tokens must be token ids in \[0, {VOCAB}\), got \[{VOCAB}\]"
    ):
        generate(model, prompt, 3, stop_tokens=torch.tensor([VOCAB]))
    with pytest.raises(ValueError, match=r"stop_tokens must be token ids .*, got \[2.0, True\]"):
        generate(model, prompt, 3, stop_tokens=[2.0, True])
    with pytest.raises(ValueError, match="stop_tokens must be a token id or an iterable of ids, got 2.5"):
        generate(model, prompt, 3, stop_tokens=2.5)
    # before the prompt is read (a long prompt was read first, then a bare "'int' object is not callable")
    with pytest.raises(TypeError, match="on_token must be a function of each new column or None, got 5"):
        generate(model, prompt, 3, on_token=5)


def test_generate_checks_every_option_up_front():
    """compiled and guards are checked whatever max_new_tokens and compiled (not only when a static decoder
    is built); top_p refuses a bool as the other options do; numpy numbers are accepted as numbers."""
    model = tiny_model("lmm")
    prompt = tokens(1, 3)
    modes = r"\('eager', 'compile', 'cuda_graph'\)"
    for n in (0, 1, 3):
        for bad in ("bogus", None, 1, ""):
            with pytest.raises(
                ValueError, match=f"^generate: compiled must be False, True or one of {modes}"
            ):
                generate(model, prompt, n, compiled=bad)
        with pytest.raises(
            ValueError, match=r"^generate: guards must be one of \('full', 'state'\), got 'x'"
        ):
            generate(model, prompt, n, guards="x")
        if not torch.cuda.is_available():  # no decoder is built for n <= 1, the mode is checked anyway
            with pytest.raises(ValueError, match="^generate: compiled='cuda_graph' needs a CUDA model"):
                generate(model, prompt, n, compiled="cuda_graph")
    with pytest.raises(ValueError, match=r"^generate: top_p must be a number in \(0, 1\] or None, got True"):
        generate(model, prompt, 3, top_p=True)
    with pytest.raises(ValueError, match="^generate: top_k must be a positive int or None, got 2.0"):
        generate(model, prompt, 3, top_k=2.0)
    want = generate(model, prompt, 5, temperature=0.5, top_k=5, top_p=0.9, generator=seeded(7))
    got = generate(
        model,
        prompt,
        np.int64(5),
        temperature=np.float32(0.5),
        top_k=np.int64(5),
        top_p=np.float32(0.9),
        generator=seeded(7),
    )
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------------- CLI
@pytest.fixture
def checkpoint(tmp_path):
    """A trainer-style checkpoint (see titans.runtime.loading) of a tiny byte-level model."""
    model = tiny_model("mac", dtype=torch.float32, vocab_size=256, segment_len=16, chunk_size=8)
    save_tiny_run(tmp_path / "run", model)
    return tmp_path / "run", model


def test_cli_read_from_stdin_as_from_a_file_and_inspect_without_warnings(checkpoint, tmp_path):
    """`titans read --input -` takes invalid UTF-8 as a file does (U+FFFD; Python's stdin gave lone
    surrogates, which the tokenizer refused), and `titans inspect` prints its result line only (numpy
    warned four times about float limits under flushed subnormals). Real processes: both depend on how
    the interpreter starts."""
    run, _ = checkpoint
    doc = tmp_path / "bad.txt"
    doc.write_bytes(b"ab\xff\xfecd\n\xc3")
    cmd = [sys.executable, "-m", "titans", "read", "--checkpoint", str(run), "--no-progress"]
    cmd += ["--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, stdin in (("file", None), ("stdin", doc)):
        args = [*cmd, "--input", str(doc) if stdin is None else "-", "--save-state", str(tmp_path / name)]
        with open(stdin or os.devnull, "rb") as f:
            proc = subprocess.run(args, stdin=f, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "file").read_bytes() == (tmp_path / "stdin").read_bytes()
    proc = subprocess.run(
        [sys.executable, "-m", "titans", "inspect", "--checkpoint", str(run), "--prompt", "hello there",
         "--device", "cpu", "--out", str(tmp_path / "r.html")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr


def test_cli_read_then_generate_from_the_same_state(checkpoint, tmp_path, capsys):
    from titans.cli import main

    run, model = checkpoint
    doc = tmp_path / "doc.txt"
    text = "".join(f"line {i}: the whale is white.\n" for i in range(150))
    doc.write_text(text)
    state_path = tmp_path / "doc.safetensors"
    args = ["read", "--checkpoint", str(run), "--input", str(doc), "--save-state", str(state_path)]
    args += ["--device", "cpu"]  # where the reference model is (auto would take a GPU where there is one)
    assert main([*args, "--no-progress", "--block-chars", "100"]) == 0
    report = capsys.readouterr().out
    assert "tokens/s" in report and "peak RSS" in report
    state = load_state(state_path, model=model)
    assert state.position == len(text.encode())
    _, want = prefill(model, torch.tensor([list(text.encode())]))
    with torch.no_grad():
        a, _ = model(torch.tensor([[1, 2, 3]]), state)
        b, _ = model(torch.tensor([[1, 2, 3]]), want)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # block-wise reading == reading at once

    gen = [
        "generate",
        "--checkpoint",
        str(run),
        "--device",
        "cpu",
        "--state",
        str(state_path),
        "--prompt",
        "Ahab",
        "--max-new-tokens",
        "12",
        "--seed",
        "7",
        "--top-k",
        "20",
    ]
    outputs = []
    for _ in range(2):  # the same saved state, twice: same samples
        assert main(gen) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("Ahab")
    assert main([*gen, "--num-samples", "3"]) == 0
    assert capsys.readouterr().out.count("--- sample") == 3
    assert main([*gen[:-4], "--greedy"]) == 0  # greedy CLI == library generate from the state
    want_ids = generate(model, torch.tensor([list(b"Ahab")]), 12, greedy=True, state=state)[0, 4:].tolist()
    assert capsys.readouterr().out == "Ahab" + bytes(want_ids).decode("utf-8", errors="replace") + "\n"


def test_read_text_blocks_cut_at_line_ends(tmp_path):
    from titans.inference.cli import read_text_blocks

    text = "short\n" + "x" * 50 + "\nmore lines\nno newline at the end"
    path = tmp_path / "t.txt"
    path.write_text(text)
    blocks = list(read_text_blocks(str(path), block_chars=8))
    assert "".join(blocks) == text
    assert all(b.endswith(("\n", " ")) or set(b) == {"x"} for b in blocks[:-1])  # x * 50: cut anywhere
    assert list(read_text_blocks(str(path), block_chars=0)) == [text]


def test_read_text_blocks_bound_a_long_line_and_keep_line_ends(tmp_path):
    """A file of one long line was carried whole (a 48 MiB line: 1 GiB of memory, and a search of the
    growing carry at every block); "\r\n" and a lone "\r" were read as "\n" (3 tokens fewer than the
    same file gives training)."""
    from titans.inference.cli import read_text_blocks

    text = "crlf\r\nlone\r" + "word " * 40 + "y" * 30 + "\n" + "z" * 100
    path = tmp_path / "t.txt"
    path.write_bytes(text.encode())
    for block_chars in (0, 8, 1 << 20):
        blocks = list(read_text_blocks(str(path), block_chars=block_chars))
        assert "".join(blocks) == text
    blocks = list(read_text_blocks(str(path), block_chars=8))
    assert max(map(len, blocks)) <= 8 + 30  # a block and at most one word carried
    assert [b for b in blocks if "word" in b and not b.endswith((" ", "\n"))] == []  # words stay whole


def test_long_cpu_stream_warns_once_when_subnormals_are_kept(monkeypatch):
    """Memory weights that get no writes decay into subnormal floats, which slow a long CPU stream down;
    the model says so (once per process) when a stream passes SUBNORMAL_WARNING_POSITION tokens unless they
    are flushed, as the titans commands and this suite do."""
    import warnings

    import titans.models.lm as lm

    model, prompt = tiny_model("mac"), tokens(1, 8)
    monkeypatch.setattr(lm, "SUBNORMAL_WARNING_POSITION", 20)
    monkeypatch.setattr(lm, "_warned_subnormals", False)
    assert lm.subnormals_flushed()  # conftest
    torch.set_flush_denormal(False)
    try:
        assert not lm.subnormals_flushed()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            prefill(model, prompt)  # 8 tokens: below the position, silent
        with pytest.warns(RuntimeWarning, match="set_flush_denormal"):
            prefill(model, tokens(1, 24))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            generate(model, tokens(1, 24), 3)  # once per process
    finally:
        torch.set_flush_denormal(True)
    monkeypatch.setattr(lm, "_warned_subnormals", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prefill(model, tokens(1, 24))  # flushed: silent
