"""The lm-eval adapter (`titans.evaluation.lm_eval_adapter`): its numbers are the model's own.

loglikelihood == the sum of log-softmax over the continuation from one full forward pass (float64), for
contexts read through the state in pieces of awkward sizes, shared contexts and batched continuations;
the greedy flag == argmax of that pass; rolling == the full-sequence loglikelihood; generation == the
model's greedy argmax chain, cut at the stop string. Then lm-eval end to end on local files only: a saved
checkpoint, a task YAML in a temp dir (`--include_path`), json data the test writes, through
`simple_evaluate` and through `titans lm-eval` (the command line).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from titans.data.tokenizers import ByteTokenizer  # noqa: E402
from titans.evaluation.lm_eval_adapter import TitansEvalLM  # noqa: E402
from titans.models.config import TitansConfig  # noqa: E402
from titans.models.lm import TitansLM  # noqa: E402

TOK = ByteTokenizer()
SRC = Path(__file__).resolve().parents[1] / "src"


def tiny_model(variant: str, seed: int = 0, dtype=torch.float64) -> TitansLM:
    cfg = TitansConfig.preset(
        "tiny", variant=variant, dim=32, depth=2, heads=2, segment_len=16, window=16, chunk_size=4,
        persistent_tokens=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    return TitansLM(cfg).to(dtype).eval()


def reference(model: TitansLM, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """Sum of log p(cont | ctx) and greedy flag from one full forward pass over ctx + cont."""
    tokens = torch.tensor([ctx + cont])
    with torch.no_grad():
        logits, _ = model(tokens)
    logp = F.log_softmax(logits[0, len(ctx) - 1 : -1].double(), -1)
    target = torch.tensor(cont)
    lp = logp.gather(-1, target[:, None]).sum().item()
    greedy = bool((logits[0, len(ctx) - 1 : -1].argmax(-1) == target).all())
    return lp, greedy


def req(kind: str, args: tuple) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@pytest.mark.parametrize("variant", ["lmm", "mac"])
def test_loglikelihood_equals_full_forward(variant):
    model = tiny_model(variant)
    # piece_len 7 (not a multiple of the chunk size 4 or the MAC segment 16) and batch 2 of 3 rows
    lm = TitansEvalLM(model=model, tokenizer=TOK, dtype="float64", piece_len=7, batch_size=2)
    story = "The kitchen is north of the garden. Mary went to the hallway. " * 3
    pairs = [
        (story + "Where is Mary? ", "hallway"),
        (story + "Where is Mary? ", "kitchen"),  # same context, same length: batched, one prefill
        (story + "Where is Mary? ", "garden!"),
        (story + "Where is Mary?", " office"),  # a trailing space moves to the continuation
        ("A", "b"),  # one-token context: nothing to prefill
        ("", "Hello there"),  # empty context: the document separator
    ]
    got = lm.loglikelihood([req("loglikelihood", p) for p in pairs])
    for (context, continuation), (lp, greedy) in zip(pairs, got):
        ctx_text = context.rstrip()
        cont_text = context[len(ctx_text) :] + continuation
        ctx = TOK.encode(ctx_text) if ctx_text else lm.prefix
        want_lp, want_greedy = reference(model, ctx, TOK.encode(cont_text))
        assert lp == pytest.approx(want_lp, rel=1e-9, abs=1e-9)
        assert greedy == want_greedy


def test_greedy_flag_true_for_the_models_own_argmax_chain():
    model = tiny_model("lmm", seed=3)
    lm = TitansEvalLM(model=model, tokenizer=TOK, dtype="float64", piece_len=5)
    context = TOK.encode("Once upon a time, ")
    chain = list(context)
    with torch.no_grad():
        for _ in range(6):
            logits, _ = model(torch.tensor([chain]))
            chain.append(int(logits[0, -1].argmax()))
    greedy_cont = chain[len(context) :]
    other = list(greedy_cont)
    other[2] = (other[2] + 1) % 256
    [(lp_g, g), (lp_o, o)] = lm.score_pairs([(context, greedy_cont), (context, other)])
    assert g and not o
    assert lp_g > lp_o
    # generate_until decodes the same chain, and stops at (and before) a stop string
    text = TOK.decode(greedy_cont)
    [out] = lm.generate_until([req("generate_until", ("Once upon a time, ", {"max_gen_toks": 6}))])
    assert out == text
    stop = text[3:5]
    [cut] = lm.generate_until([req("generate_until", ("Once upon a time, ", {"until": [stop]}))])
    assert cut == text.split(stop)[0]
    # max_gen_toks None (a task's generation_kwargs can say so): the default, as when it is absent
    none = {"until": [stop], "max_gen_toks": None}
    assert lm.generate_until([req("generate_until", ("Once upon a time, ", none))]) == [cut]


def test_rolling_equals_full_sequence_loglikelihood():
    model = tiny_model("lmm", seed=1)
    text = "It was the best of times, it was the worst of times; it was the age of wisdom. " * 2
    tokens = TOK.encode(text)
    want, _ = reference(model, [0], tokens)  # the byte tokenizer's separator is byte 0
    lm = TitansEvalLM(model=model, tokenizer=TOK, dtype="float64", piece_len=11)
    [got] = lm.loglikelihood_rolling([req("loglikelihood_rolling", (text,))])
    assert got == pytest.approx(want, rel=1e-9)
    # max_length: lm-eval's rolling windows, each token predicted once from at most max_length tokens
    windowed = TitansEvalLM(model=model, tokenizer=TOK, dtype="float64", max_length=50)
    [got_w] = windowed.loglikelihood_rolling([req("loglikelihood_rolling", (text,))])
    first = reference(model, [0], tokens[:50])[0]
    assert got_w != pytest.approx(got, rel=1e-6)  # later windows see less context
    assert got_w < 0 and math.isfinite(got_w) and first > got_w


@pytest.mark.parametrize("max_length", [10, 16, 33])
def test_max_length_reads_what_lm_eval_s_hf_model_reads(max_length):
    """lm-eval's HF model feeds (context + continuation)[-(max_length + 1):][:-1]: max_length tokens. Every
    rolling window (the last, partial one too) is then scored whole, and the total equals lm-eval's own
    windows scored directly."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    model = tiny_model("mac", seed=2)
    lm = TitansEvalLM(model=model, tokenizer=TOK, dtype="float64", max_length=max_length)
    text = "The kitchen is north of the garden. Mary went to the hallway. John is here."
    tokens = TOK.encode(text)
    windows = get_rolling_token_windows(
        token_list=tokens, prefix_token=lm.prefix[-1], max_seq_len=max_length, context_len=1
    )
    want = sum(reference(model, *make_disjoint_window(w))[0] for w in windows)
    [got] = lm.loglikelihood_rolling([req("loglikelihood_rolling", (text,))])
    assert got == pytest.approx(want, rel=1e-9, abs=1e-9)
    # loglikelihood: the last max_length + 1 tokens of context + continuation
    context, continuation = text[:50], text[50:56]
    whole = (TOK.encode(context) + TOK.encode(continuation))[-(max_length + 1) :]
    [(lp, greedy)] = lm.loglikelihood([req("loglikelihood", (context, continuation))])
    want_lp, want_greedy = reference(model, whole[:-6], whole[-6:])
    assert lp == pytest.approx(want_lp, rel=1e-9, abs=1e-9) and greedy == want_greedy


def test_max_length_refuses_what_it_cannot_hold():
    """max_length is the most tokens the model reads per request: a continuation longer than max_length
    (which lm-eval's HF model refuses too; the continuation is never cut) is refused by name, not read
    whole; one of exactly max_length tokens keeps one context token and reads max_length tokens. Generation
    with max_gen_toks >= max_length (no room for a context token; lm-eval's HF model refuses it too) is
    refused, and otherwise reads at most max_length tokens."""
    model = tiny_model("mag", seed=2)
    lm = TitansEvalLM(model=model, tokenizer=TOK, max_length=8)
    read = []
    forward = model.forward

    def counting(x, state=None, *args, **kwargs):
        read.append(x.shape[1])
        return forward(x, state, *args, **kwargs)

    model.forward = counting
    with pytest.raises(ValueError, match="continuation of 9 tokens is longer than max_length=8"):
        lm.loglikelihood([req("loglikelihood", ("ab", "0123456789abcdef"[:9]))])
    assert read == []  # refused before the model reads anything
    [(lp, greedy)] = lm.loglikelihood([req("loglikelihood", ("ab", "01234567"))])
    assert sum(read) == 8
    want_lp, want_greedy = reference(model, TOK.encode("b"), TOK.encode("01234567"))
    assert lp == pytest.approx(want_lp, rel=1e-9, abs=1e-9) and greedy == want_greedy
    for max_gen in (8, 9):
        with pytest.raises(ValueError, match=f"max_gen_toks={max_gen} leaves no room .*max_length=8"):
            lm.generate_until([req("generate_until", ("Hello there", {"max_gen_toks": max_gen}))])
    read.clear()
    lm.generate_until([req("generate_until", ("Hello there", {"max_gen_toks": 7}))])
    assert sum(read) <= 8


def test_an_in_memory_model_is_used_as_it_is():
    """TitansEvalLM(model=...) keeps the model's own dtype and device (lm-eval's HF model does the same
    with a model instance) and only sets eval mode (documented); dtype= casts it when asked."""
    model = tiny_model("lmm").train()  # float64
    lm = TitansEvalLM(model=model, tokenizer=TOK)
    assert lm.model is model and not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float64} and lm.device == torch.device("cpu")
    [(lp, _)] = lm.loglikelihood([req("loglikelihood", ("Hello", " there"))])
    assert lp == pytest.approx(reference(model, TOK.encode("Hello"), TOK.encode(" there"))[0], rel=1e-9)
    TitansEvalLM(model=model, tokenizer=TOK, dtype="float32", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_bad_model_args_are_named():
    model = tiny_model("lmm")
    with pytest.raises(ValueError, match="dtype"):
        TitansEvalLM(model=model, tokenizer=TOK, dtype="half")
    with pytest.raises(ValueError, match="max_length"):
        TitansEvalLM(model=model, tokenizer=TOK, max_length="0")
    with pytest.raises(ValueError, match="checkpoint=RUN"):
        TitansEvalLM()
    lm = TitansEvalLM(model=model, tokenizer=TOK)
    with pytest.raises(ValueError, match="unsupported generation options"):
        lm.generate_until([req("generate_until", ("Hi", {"num_beams": 4}))])


def test_generation_options_as_transformers_reads_them():
    """top_k=0 is transformers' "no top-k filter" (the same draws as top_k=None); sampling options out of
    range and a repetition_penalty other than 1.0 are refused by name before anything runs, not ignored."""
    lm = TitansEvalLM(model=tiny_model("lmm", dtype=torch.float32), tokenizer=TOK)

    def run(**kw):
        torch.manual_seed(5)
        return lm.generate_until([req("generate_until", ("Hi", {"max_gen_toks": 6, **kw}))])[0]

    assert run(do_sample=True, top_k=0) == run(do_sample=True)
    assert run(repetition_penalty=1.0) == run()
    cases = [
        (dict(repetition_penalty=1.3), "repetition_penalty is not supported .*got 1.3"),
        (dict(do_sample=True, temperature=-1.0), "temperature must be a finite number >= 0, got -1.0"),
        (dict(do_sample=True, top_p=1.5), r"top_p must be a number in \(0, 1\] or None, got 1.5"),
        (dict(do_sample=True, top_k=-2), "top_k must be a positive int or None, got -2"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=f"^titans lm-eval model: {message}"):
            run(**kw)


# ----------------------------------------------------------------------------------- lm-eval end to end

TASK_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""

PPL_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def write_tasks(folder: Path) -> None:
    mc = [
        {"question": "Colour of the sky:", "choices": ["blue", "green", "loud"], "answer": 0},
        {"question": "Two plus two is", "choices": ["five", "four"], "answer": 1},
        {"question": "The cat sat on the", "choices": ["mat", "moon", "idea"], "answer": 0},
    ]
    docs = [{"text": "The sea was calm. Ships came in."}, {"text": "Call me Ishmael. Some years ago."}]
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in mc))
    (folder / "ppl.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "titans_test_mc.yaml").write_text(
        TASK_YAML.format(name="titans_test_mc", data=folder / "mc.jsonl")
    )
    (folder / "titans_test_ppl.yaml").write_text(
        PPL_YAML.format(name="titans_test_ppl", data=folder / "ppl.jsonl")
    )


@pytest.fixture
def offline(monkeypatch):
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "1")


def save_tiny_checkpoint(run: Path) -> TitansLM:
    from titans.evaluation.recipe import save_task_model

    model = tiny_model("lmm", seed=2, dtype=torch.float32)
    args = type("A", (), {"tokenizer": "bytes", "lr": 1e-3, "seed": 0})()
    save_task_model(run, model, TOK, args, {"steps_done": 1, "recipe": {"train_length": 64}})
    return model


def test_simple_evaluate_on_local_tasks(tmp_path, offline):
    import lm_eval
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    run = tmp_path / "run"
    model = save_tiny_checkpoint(run)
    out = lm_eval.simple_evaluate(
        model="titans",
        model_args=f"checkpoint={run},device=cpu,dtype=float64",
        tasks=["titans_test_mc", "titans_test_ppl"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        batch_size=2,
    )
    res = out["results"]
    # the multiple-choice accuracy is the argmax of the model's own loglikelihoods
    model = model.double()
    mc = [json.loads(line) for line in (tmp_path / "mc.jsonl").read_text().splitlines()]
    hits = []
    for d in mc:  # lm-eval joins question and choice with its target delimiter, a space
        scores = [reference(model, TOK.encode(d["question"]), TOK.encode(" " + c))[0] for c in d["choices"]]
        hits.append(max(range(len(scores)), key=scores.__getitem__) == d["answer"])
    assert res["titans_test_mc"]["acc,none"] == pytest.approx(sum(hits) / len(hits))
    # bits per byte of the rolling task == the model's own full-sequence loss over all bytes
    docs = [json.loads(line)["text"] for line in (tmp_path / "ppl.jsonl").read_text().splitlines()]
    nll = -sum(reference(model, [0], TOK.encode(t))[0] for t in docs)
    n_bytes = sum(len(t.encode()) for t in docs)
    assert res["titans_test_ppl"]["bits_per_byte,none"] == pytest.approx(
        nll / n_bytes / math.log(2), rel=1e-6
    )


@pytest.mark.slow  # a fresh interpreter importing lm-eval: what a plain `lm_eval --model titans` runs
def test_plain_lm_eval_command_with_the_hook(tmp_path):
    """`python -m titans.lm_eval --install-hook` puts a .pth hook in site-packages; here it is installed
    into a folder that a fresh interpreter adds as a site dir, and lm-eval's own command line (not titans')
    then finds the `titans` model by name, and still finds its own models."""
    from titans.evaluation.lm_eval_hook import install_hook

    site_dir = tmp_path / "site"
    site_dir.mkdir()
    install_hook(site_dir)
    write_tasks(tmp_path)
    run = tmp_path / "run"
    save_tiny_checkpoint(run)
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    out_dir = tmp_path / "out"
    args = ["--model", "titans", "--model_args", f"checkpoint={run}", "--tasks", "titans_test_mc"]
    args += ["--include_path", str(tmp_path), "--output_path", str(out_dir)]
    code = (
        "import site, sys\n"
        f"site.addsitedir({str(site_dir)!r})\n"
        "assert 'titans' not in sys.modules\n"  # the hook imports nothing of titans at start-up
        "from lm_eval.__main__ import cli_evaluate\n"
        "from lm_eval.api.registry import get_model\n"
        "assert get_model('dummy').__name__ == 'DummyLM'\n"
        f"sys.argv = ['lm_eval', *{args!r}]\n"
        "cli_evaluate()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [result] = out_dir.rglob("results_*.json")
    assert "acc,none" in json.loads(result.read_text())["results"]["titans_test_mc"]
