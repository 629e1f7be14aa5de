"""The transformers wrapper: save/load through the Auto classes, and transformers' generate() == ours."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_lm import random_tokens  # noqa: E402
from tiny_lm import tiny_model as shared_model  # noqa: E402
from titans import VARIANTS  # noqa: E402
from titans.hf import TitansCache, TitansForCausalLM, TitansHFConfig  # noqa: E402
from titans.hf.modeling import _OUTPUT_CACHE  # noqa: E402
from titans.inference import generate, prefill  # noqa: E402
from titans.models import TitansLM  # noqa: E402
from titans.models.state import select_rows, state_batch_size  # noqa: E402

VOCAB = 41

tiny_model = partial(shared_model, vocab_size=VOCAB, dtype=torch.float32)
tokens = partial(random_tokens, vocab=VOCAB)


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    model = tiny_model("mac")
    path = tmp_path_factory.mktemp("hf") / "titans-tiny"
    TitansForCausalLM.from_titans(model).save_pretrained(path)
    return path, model


def test_auto_classes_round_trip(saved_dir):
    path, model = saved_dir
    config = transformers.AutoConfig.from_pretrained(path)
    assert isinstance(config, TitansHFConfig) and config.model_type == "titans"
    assert config.to_titans() == model.config
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert isinstance(hf, TitansForCausalLM)
    assert hf.model.head.weight is hf.model.embed.weight  # tie survives loading
    x = tokens(2, 13)
    with torch.no_grad():
        want, _ = model(x)
        got = hf(x).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_generate_equals_ours(variant):
    model = tiny_model(variant)
    hf = TitansForCausalLM.from_titans(model).eval()
    prompt = tokens(2, 11)
    ours = generate(model, prompt, 17, greedy=True)
    theirs = hf.generate(prompt, max_new_tokens=17, do_sample=False)
    assert torch.equal(theirs, ours)


def test_weights_a_checkpoint_lacks_are_initialised_as_a_fresh_model_does(saved_dir, tmp_path):
    """transformers builds the model on the meta device and leaves the tensors a checkpoint lacks (or that
    ``ignore_mismatched_sizes`` re-makes) to ``_init_weights``, which did nothing: they were uninitialised
    memory (NaN here), and the first forward failed."""
    from safetensors.torch import load_file, save_file

    path, model = saved_dir
    folder = tmp_path / "partial"
    TitansForCausalLM.from_titans(model).save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    dropped = [
        "model.blocks.0.mlp.down_proj.weight",  # a projection into the residual stream
        "model.blocks.0.norm_mix.weight",  # a norm
        "model.blocks.0.memory.to_gates.bias",  # the memory's gates
        "model.blocks.0.memory.init_weights.0",  # the memory's initial weights
        "model.blocks.0.attn.qk_log_scale",
    ]
    for key in dropped:
        del weights[key]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    got = dict(loaded.named_parameters())
    fresh = dict(TitansForCausalLM(TitansHFConfig.from_titans(model.config)).named_parameters())
    for key in dropped:
        assert torch.isfinite(got[key]).all(), key
        if key.endswith(("norm_mix.weight", "to_gates.bias", "qk_log_scale")):  # constants at init
            torch.testing.assert_close(got[key], fresh[key], msg=key)
        else:  # random at init: the same distribution
            assert got[key].std().item() == pytest.approx(fresh[key].std().item(), rel=0.3), key
    for key, value in weights.items():  # the rest as saved
        torch.testing.assert_close(got[key], value)
    with torch.no_grad():
        assert torch.isfinite(loaded(tokens(1, 13)).logits).all()


def test_a_new_wrapper_keeps_titans_own_initialisation():
    config = TitansHFConfig.from_titans(tiny_model("mac").config)
    torch.manual_seed(3)
    hf = TitansForCausalLM(config)
    torch.manual_seed(3)
    plain = TitansLM(hf.config.to_titans())
    for (name, a), b in zip(hf.model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_generate_continues_a_saved_state(saved_dir, tmp_path):
    path, model = saved_dir
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    doc, question = tokens(1, 27, seed=5), tokens(1, 4, seed=6)
    _, state = prefill(model, doc)
    ours = generate(model, question, 9, greedy=True, state=state)
    cache = TitansCache(state)
    theirs = hf.generate(question, past_key_values=cache, max_new_tokens=9, do_sample=False)
    assert torch.equal(theirs, ours)
    again = hf.generate(question, past_key_values=cache, max_new_tokens=9, do_sample=False)
    assert torch.equal(again, ours)  # the cache passed in is not consumed
    many = hf.generate(
        question, past_key_values=cache, max_new_tokens=5, do_sample=True, top_k=5, num_return_sequences=3
    )
    assert many.shape == (3, 9)


def test_forward_takes_the_state_as_cache_or_past_key_values(saved_dir):
    """transformers >= 5.24 passes the cache as `cache`, earlier versions as `past_key_values`: the forward
    continues the state under either name, whichever version is installed."""
    _, model = saved_dir
    hf = TitansForCausalLM.from_titans(model).eval()
    doc, more = tokens(2, 21, seed=7), tokens(2, 5, seed=8)
    with torch.no_grad():
        want, _ = model(more, prefill(model, doc)[1])
        state = prefill(model, doc)[1]
        by_cache = hf(more, cache=TitansCache(state)).logits
        by_past = hf(more, past_key_values=TitansCache(state)).logits
        fresh = hf(more).logits
    torch.testing.assert_close(by_cache, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(by_past, want, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(fresh, want)  # the state matters, so a dropped one would show
    with pytest.raises(ValueError, match="not both"):
        hf(more, cache=TitansCache(state), past_key_values=TitansCache(state))


def test_beam_search_runs(saved_dir, monkeypatch):
    """Beam search reorders the state through the cache's reorder_cache hook."""
    path, _ = saved_dir
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    reorders = []
    reorder = TitansCache.reorder_cache

    def counting_reorder(cache, beam_idx):
        reorders.append(beam_idx)
        reorder(cache, beam_idx)

    monkeypatch.setattr(TitansCache, "reorder_cache", counting_reorder)
    out = hf.generate(tokens(2, 5), max_new_tokens=6, num_beams=3, do_sample=False)
    assert out.shape == (2, 11)
    assert reorders and all(idx.shape == (6,) for idx in reorders)  # 2 prompts x 3 beams


def test_loss_and_refusals(saved_dir):
    path, model = saved_dir
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    x = tokens(2, 10)
    with torch.no_grad():
        out = hf(x, labels=x)
        logits, _ = model(x)
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, want, atol=1e-6, rtol=1e-6)
    mask = torch.ones_like(x)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padded"):
        hf(x, attention_mask=mask)
    with pytest.raises(TypeError, match="past_key_values"):
        hf(x, past_key_values=(torch.zeros(1),))


def test_empty_input_ids_are_refused_as_our_generate_refuses_them(saved_dir):
    """input_ids of no tokens (with or without a state) is refused by name, in the forward and so in
    transformers' generate, with our generate's reason (not empty logits, then an IndexError)."""
    path, model = saved_dir
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    _, state = prefill(model, tokens(1, 9))
    empty = torch.zeros(1, 0, dtype=torch.long)
    message = "^TitansForCausalLM: input_ids is empty; give at least one token"
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        hf(empty, cache=TitansCache(state))
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        hf(empty)
    with pytest.raises(ValueError, match=message):
        hf.generate(empty, cache=TitansCache(state), max_new_tokens=3)
    with pytest.raises(ValueError, match="generate: the prompt is empty; give at least one token"):
        generate(model, empty, 3, state=state)


def test_activation_checkpointing_from_transformers(saved_dir):
    """`activation_checkpointing_enable()` (what the Trainer's `gradient_checkpointing=True` calls) turns on
    the model's block recomputation, with transformers' checkpoint function and options, and the loss and
    every gradient stay those of the plain model; `..._disable()` turns it off."""
    path, _ = saved_dir
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).train()
    x = tokens(2, 13)
    runs, calls = [], []
    for enable in (False, True):
        if enable:
            hf.activation_checkpointing_enable()
            chosen = hf.model._gradient_checkpointing_func  # transformers' function recomputes each block
            hf.model._gradient_checkpointing_func = lambda *a, f=chosen, **kw: calls.append(1) or f(*a, **kw)
        hf.zero_grad()
        out = hf(x, labels=x)
        out.loss.backward()
        runs.append((out.loss.detach(), [p.grad.clone() for p in hf.parameters() if p.grad is not None]))
    assert hf.model.gradient_checkpointing and len(calls) == len(hf.model.blocks)
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1])) and len(runs[0][1]) == len(
        runs[1][1]
    )
    hf.activation_checkpointing_disable()
    assert not hf.model.gradient_checkpointing


def test_core_library_does_not_import_transformers():
    code = "import sys, titans, titans.inference.cli; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- a saved folder as transformers users load it: AutoTokenizer, pipeline, remote code -------------------

TRICKY = "def f(x):\n\treturn x  # é Ā 😀 \x00 end"  # "Ā" is what ByteLevel writes for byte 0


def tokenizer_cases(tmp_path):
    """(our tokenizer, a prompt) for each kind a folder can carry: bytes, the DNA alphabet, a trained BPE."""
    from titans.data.dna import DNATokenizer
    from titans.data.tokenizers import ByteTokenizer, train_bpe

    bpe = train_bpe(["def hello(world):\n    return world + 1\n"] * 40, 300, tmp_path / "bpe.json")
    return {
        "bytes": (ByteTokenizer(), "def "),
        "dna": (DNATokenizer(), "ACGTacgtN"),
        "bpe": (bpe, "def hello"),
    }


@pytest.fixture(scope="module")
def saved_folders(tmp_path_factory):
    """name -> (folder, model, our tokenizer, prompt), each saved by titans.hf.save_pretrained."""
    import titans.hf

    root = tmp_path_factory.mktemp("hf-folders")
    out = {}
    for name, (tok, prompt) in tokenizer_cases(root).items():
        model = shared_model("mac", vocab_size=tok.vocab_size, dtype=torch.float32, seed=3)
        folder = root / name
        files = titans.hf.save_pretrained(model, folder, tok)
        assert {"config.json", "model.safetensors", "tokenizer.json", "modeling_titans.py"} <= {
            f.name for f in files
        }
        out[name] = (folder, model, tok, prompt)
    return out


@pytest.mark.parametrize("name", ["bytes", "dna", "bpe"])
def test_auto_tokenizer_encodes_as_ours(saved_folders, name):
    folder, _, tok, prompt = saved_folders[name]
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = prompt if name == "dna" else TRICKY + " <|endoftext|>"  # spelled out, it is ordinary text
    ids = hf_tok(text)["input_ids"]
    assert ids == tok.encode(text)
    assert hf_tok.decode(ids) == tok.decode(ids)
    assert len(hf_tok) == tok.vocab_size


def test_special_tokens_and_pad_ids(saved_folders):
    """pad_token_id is the tokenizer's pad token (<pad> for DNA), else its eos (a BPE's), else unset (bytes:
    every byte is text, NUL included, and generate reads an id equal to the pad id as padding)."""
    want = {"bytes": (None, None), "dna": (0, 1), "bpe": (0, 0)}
    for name, (folder, *_) in saved_folders.items():
        config = transformers.AutoConfig.from_pretrained(folder)
        gen = transformers.GenerationConfig.from_pretrained(folder)
        assert (config.pad_token_id, config.eos_token_id) == want[name], name
        assert (gen.pad_token_id, gen.eos_token_id) == want[name], name
    assert transformers.AutoTokenizer.from_pretrained(saved_folders["bytes"][0]).pad_token_id is None
    dna = transformers.AutoTokenizer.from_pretrained(saved_folders["dna"][0])
    assert (dna.pad_token_id, dna.eos_token_id, dna.cls_token_id) == (0, 1, 2)
    with pytest.raises(Exception, match="UNK"):  # no silent gap for a letter outside the alphabet
        dna("ACXG")


def test_dna_tokenizer_treats_special_names_in_text_as_ours_does(saved_folders):
    """Text that spells "<eos>", "<pad>" or "<cls>" is not a special token: ours refuses its '<', and so
    does the saved tokenizer (no base); decoding drops special ids, as ours does."""
    folder, _, tok, _ = saved_folders["dna"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    for text in ("AC<eos>G", "AC<pad>G", "<cls>A"):
        with pytest.raises(ValueError, match="unknown letter '<'"):
            tok.encode(text)
        with pytest.raises(Exception, match="UNK"):
            hf_tok(text)
    for ids in ([1, 3, 4], [2, 3, 0, 4, 1], [0, 1, 2], [5, 6, 7]):
        assert hf_tok.decode(ids) == tok.decode(ids), ids
    assert hf_tok.decode([1, 3, 4]) == "AC"
    assert hf_tok("acgtN")["input_ids"] == tok.encode("acgtN")


def test_bpe_file_with_a_template_post_processor_encodes_as_ours(tmp_path):
    """A tokenizers file whose post-processor adds a BOS: ours never adds special tokens, and the saved
    transformers tokenizer (add_special_tokens=True by default) gives the same ids, so transformers'
    generate from its ids continues as ours does."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import processors

    import titans.hf
    from titans.data.tokenizers import HFTokenizer, train_bpe

    bpe = train_bpe(["def hello(world):\n    return world + 1\n"] * 40, 300, tmp_path / "bpe.json")
    rust = RustTokenizer.from_file(str(bpe.path))
    rust.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A <|endoftext|>", special_tokens=[("<|endoftext|>", 0)]
    )
    rust.save(str(tmp_path / "bos.json"))
    tok = HFTokenizer(tmp_path / "bos.json")
    model = shared_model("mac", vocab_size=tok.vocab_size, dtype=torch.float32, seed=3)
    titans.hf.save_pretrained(model, tmp_path / "hf", tok)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def hello(world)"
    ids = hf_tok(text)["input_ids"]
    assert ids == tok.encode(text) and 0 not in ids
    assert hf_tok.decode(ids) == tok.decode(ids) == text
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = hf_tok(text, return_tensors="pt").input_ids
    want = generate(model, torch.tensor([tok.encode(text)]), 5, greedy=True, stop_tokens=tok.eos_id)
    got = hf.generate(prompt, max_new_tokens=5, do_sample=False)
    assert got[0, : want.shape[1]].tolist() == want[0].tolist()


@pytest.mark.parametrize("name", ["bytes", "dna", "bpe"])
def test_pipeline_greedy_equals_ours(saved_folders, name):
    """pipeline("text-generation") from the folder (the state travels through generate's cache) writes
    the text our own greedy generation writes, stopping at the same eos."""
    folder, model, tok, prompt = saved_folders[name]
    pipe = transformers.pipeline("text-generation", model=str(folder), trust_remote_code=True)
    got = pipe(prompt, max_new_tokens=25, do_sample=False)[0]["generated_text"]
    ids = torch.tensor([tok.encode(prompt)])
    ours = generate(model, ids, 25, greedy=True, stop_tokens=tok.eos_id)
    new = [i for i in ours[0, ids.shape[1] :].tolist() if i != tok.eos_id]
    assert got == prompt + tok.decode(new)


def test_remote_code_loads_without_importing_titans_first(saved_folders, tmp_path):
    """A fresh process that never imports titans loads the folder through trust_remote_code alone (the
    saved config's auto_map), and its logits and pipeline text match the model that was saved."""
    folder, model, tok, prompt = saved_folders["bytes"]
    x = torch.tensor([tok.encode(prompt * 5)])
    with torch.no_grad():
        want = model(x)[0]
    torch.save({"x": x, "want": want}, tmp_path / "want.pt")
    code = f"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
assert not any(m == "titans" or m.startswith("titans.") for m in sys.modules)
model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
saved = torch.load({str(tmp_path / "want.pt")!r})
with torch.no_grad():
    torch.testing.assert_close(model(saved["x"]).logits, saved["want"], atol=1e-5, rtol=1e-5)
pipe = pipeline("text-generation", model={str(folder)!r}, trust_remote_code=True)
print(repr(pipe({prompt!r}, max_new_tokens=10, do_sample=False)[0]["generated_text"]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = torch.tensor([tok.encode(prompt)])
    ours = prompt + tok.decode(generate(model, ids, 10, greedy=True)[0, ids.shape[1] :].tolist())
    assert done.stdout.strip().splitlines()[-1] == repr(ours)


def test_without_trust_remote_code_a_fresh_process_is_refused(saved_folders):
    """Remote code runs only when asked for: the folder does not load silently without the flag."""
    folder = saved_folders["bytes"][0]
    code = f"import transformers; transformers.AutoModelForCausalLM.from_pretrained({str(folder)!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "trust_remote_code" in done.stderr


def test_save_pretrained_refuses_before_writing(tmp_path):
    import titans.hf
    from titans.data.tokenizers import ByteTokenizer

    model = shared_model("mac", vocab_size=VOCAB, dtype=torch.float32)
    with pytest.raises(ValueError, match="256 symbols, more than the model's 41"):
        titans.hf.save_pretrained(model, tmp_path / "out", ByteTokenizer())
    assert not (tmp_path / "out").exists()

    class Other:  # e.g. a SentencePiece model: no conversion here
        name, vocab_size, eos_id = "other.model", VOCAB, None

    with pytest.raises(ValueError, match="cannot be saved as a transformers tokenizer"):
        titans.hf.save_pretrained(model, tmp_path / "out", Other())
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="push_to_hub"):  # it would upload before the remote code is written
        TitansForCausalLM.from_titans(model).save_pretrained(tmp_path / "out", push_to_hub=True)


def test_save_pretrained_over_a_folder_is_all_or_nothing_with_ordinary_modes(tmp_path, monkeypatch):
    """An export over an earlier one wrote file by file into it: stopped part-way (a kill), the new
    config.json sat beside the old weights and loaded as a model of random weights. It is staged in a
    temporary folder and moved in, config.json last after the old one is removed; a failure while writing
    leaves the earlier export whole, and the folder's other entries and mode stay. transformers writes the
    weights 0600: every file gets the mode open() gives (a served folder other users read)."""
    import stat

    import titans.hf
    from titans.data.tokenizers import ByteTokenizer
    from titans.hf import tokenization

    out = tmp_path / "hf"
    mac = shared_model("mac", vocab_size=256, dtype=torch.float32)
    umask = os.umask(0o022)
    try:
        titans.hf.save_pretrained(mac, out, ByteTokenizer())
    finally:
        os.umask(umask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}
    (out / "README.md").write_text("my model card\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fails(*args, **kwargs):  # after the model's files were written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tokenization.PreTrainedTokenizerFast, "save_pretrained", fails, raising=False)
    mal = shared_model("mal", vocab_size=256, dtype=torch.float32)
    with pytest.raises(OSError, match="No space"):
        titans.hf.save_pretrained(mal, out, ByteTokenizer())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary folder left
    monkeypatch.undo()
    (out / "assets").symlink_to(tmp_path)
    (out / "empty").mkdir()
    out.chmod(0o750)
    titans.hf.save_pretrained(mal, out, ByteTokenizer())
    assert json.loads((out / "config.json").read_text())["titans"]["variant"] == "mal"
    assert (out / "README.md").read_text() == "my model card\n"  # the folder's other entries stay
    assert (out / "assets").is_symlink() and (out / "empty").is_dir()
    assert stat.S_IMODE(out.stat().st_mode) == 0o750 and not list(out.glob(".export-*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    here = tmp_path / "here"  # `--out .`: a folder that cannot be renamed (a shell's working folder)
    here.mkdir()
    monkeypatch.chdir(here)
    titans.hf.save_pretrained(mal, ".", ByteTokenizer())
    assert (here / "model.safetensors").is_file() and not list(here.glob(".export-*"))


def test_export_hf_command_writes_a_folder_pipeline_loads(tmp_path, capsys):
    """`titans export-hf` turns a training run into a folder transformers loads, and says what it wrote."""
    from micro_train import micro_config
    from titans.cli import main
    from titans.training.model_io import load_model
    from titans.training.trainer import Trainer

    run = tmp_path / "run"
    Trainer(micro_config(run, tmp_path / "cache", steps=1, batch_size=2, eval_windows=1)).train()
    out = tmp_path / "exported"
    assert main(["export-hf", "--checkpoint", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out / "tokenizer.json") in printed and str(out / "model.safetensors") in printed
    # both Auto classes read the config's auto_map: without the flag AutoTokenizer asks on a terminal
    assert printed.count("from_pretrained(") == printed.count("trust_remote_code=True") == 2
    model, _, tok = load_model(run)
    pipe = transformers.pipeline("text-generation", model=str(out), trust_remote_code=True)
    got = pipe("The ", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    ids = torch.tensor([tok.encode("The ")])
    assert got == "The " + tok.decode(generate(model, ids, 12, greedy=True)[0, ids.shape[1] :].tolist())
    assert main(["export-hf", "--checkpoint", str(run), "--out", str(out)]) == 2  # not over a folder
    assert "--overwrite" in capsys.readouterr().err


# ------------------------------------------------------------------------- decoding as a fixed graph
@pytest.mark.parametrize("variant", ["mac", "mag", "lmm"])
def test_decode_graph_generate_equals_eager(variant):
    """config.decode_graph: generate() steps the static decoder (its version counts the steps) and gives
    the eager wrapper's greedy tokens, with every step's logits equal to float tolerance; 19 new tokens
    from 11 cross memory chunks (4), MAC segments (8) and windows (6)."""
    model = tiny_model(variant)
    hf = TitansForCausalLM.from_titans(model).eval()
    prompt = tokens(2, 11)
    kwargs = dict(max_new_tokens=19, do_sample=False, output_scores=True, return_dict_in_generate=True)
    want = hf.generate(prompt, **kwargs)
    hf.config.decode_graph = "eager"  # the static step as it is; "compile" runs the same step compiled
    got = hf.generate(prompt, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.sequences, generate(model, prompt, 19, greedy=True))
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-5, atol=1e-5)
    (decoder,) = hf._decoders.values()
    assert decoder.version == 18 and decoder.position == 11 + 18  # the last token is never fed


def _cache(out) -> TitansCache:
    return getattr(out, _OUTPUT_CACHE)


def test_decode_graph_live_cache():
    """A live cache copies its state out when read; once a later forward moved the buffers on, the cache
    it came from refuses to be read; a cache whose decoder is taken by another state keeps its state."""
    model = tiny_model("mac")
    hf = TitansForCausalLM.from_titans(model).eval()
    hf.config.decode_graph = "eager"
    prompt, a, b = tokens(1, 9), tokens(1, 1, seed=2), tokens(1, 1, seed=3)
    with torch.no_grad():
        cache = _cache(hf(prompt))
        _, want1 = model(a, cache.state)
        one = _cache(hf(a, past_key_values=cache))
        assert one.is_live() and one.get_seq_length() == 10
        _, want2 = model(b, want1)
        two = _cache(hf(b, past_key_values=one))
        with pytest.raises(RuntimeError, match="moved on in place"):
            one.state  # noqa: B018
        assert not torch.equal(two.state.layers[0].memory.pending_k, want1.layers[0].memory.pending_k)
        torch.testing.assert_close(two.state.layers[0].memory.pending_k, want2.layers[0].memory.pending_k)
        three = _cache(hf(a, past_key_values=two))  # `two` copied its state out when read: kept
        torch.testing.assert_close(two.state.layers[0].memory.pending_k, want2.layers[0].memory.pending_k)
        other = _cache(hf(a, past_key_values=cache))  # loads the decoder with another state
        assert three.state.position == 12 and other.state.position == 10
        torch.testing.assert_close(other.state.layers[0].memory.pending_k, want1.layers[0].memory.pending_k)
        hf.config.decode_graph = "graph"
        with pytest.raises(ValueError, match="decode_graph must be None or one of"):
            hf(a, past_key_values=cache)


def test_decode_graph_with_and_without_autocast():
    """One wrapper decoding with and without bf16 autocast: a state made under autocast holds bf16 tensors,
    so it gets its own decoder (loading it into the float32 one is refused), and going back to float32
    gives the same tokens as before."""
    hf = TitansForCausalLM.from_titans(tiny_model("mac")).eval()
    hf.config.decode_graph = "eager"
    prompt = tokens(1, 9)
    first = hf.generate(prompt, max_new_tokens=10, do_sample=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hf.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(hf.generate(prompt, max_new_tokens=10, do_sample=False), first)
    assert len(hf._decoders) == 2


# ------------------------------------------------------------------ transformers conventions, kept or refused
def test_loss_honours_num_items_in_batch(saved_dir):
    """The Trainer passes `num_items_in_batch` to a forward that takes **kwargs and then leaves the loss
    undivided by the gradient accumulation steps: the loss is the summed cross-entropy over the non-ignored
    (shifted) labels divided by it, as transformers' causal LMs compute it; without it, the mean."""
    _, model = saved_dir
    hf = TitansForCausalLM.from_titans(model).eval()
    x = tokens(2, 10)
    labels = x.clone()
    labels[0, :4] = -100
    with torch.no_grad():
        logits, _ = model(x)
        by_tensor = hf(x, labels=labels, num_items_in_batch=torch.tensor(40)).loss
        by_int = hf(x, labels=labels, num_items_in_batch=40).loss
        mean = hf(x, labels=labels).loss
    flat = (logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    total = torch.nn.functional.cross_entropy(*flat, reduction="sum")
    torch.testing.assert_close(by_tensor, total / 40, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(by_int, total / 40, atol=1e-6, rtol=1e-6)
    assert labels[:, 1:].ne(-100).sum() == 15  # 18 shifted labels, 3 ignored
    torch.testing.assert_close(mean, total / 15, atol=1e-6, rtol=1e-6)


def test_trainer_gradient_accumulation_matches_one_batch(tmp_path):
    """transformers' Trainer: one step over 4 rows as 2 batches of 2 accumulated gives the loss and the
    update of one batch of 4."""
    pytest.importorskip("accelerate")  # the Trainer's own dependency (in the `hf` extra)
    data = [{"input_ids": r, "labels": r.clone()} for r in tokens(4, 12)]
    runs = []
    for batch, accumulate in ((4, 1), (2, 2)):
        hf = TitansForCausalLM.from_titans(tiny_model("mac", train=True))
        before = [p.detach().clone() for p in hf.parameters()]
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"ga{accumulate}"),
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulate,
            max_steps=1,
            learning_rate=0.1,
            optim="sgd",
            lr_scheduler_type="constant",
            max_grad_norm=0,
            weight_decay=0.0,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
        )
        loss = transformers.Trainer(model=hf, args=args, train_dataset=data).train().training_loss
        update = torch.cat([(p.detach() - b).flatten() for p, b in zip(hf.parameters(), before)])
        runs.append((loss, update))
    assert runs[1][0] == pytest.approx(runs[0][0], rel=1e-5)
    torch.testing.assert_close(runs[1][1], runs[0][1], atol=1e-6, rtol=1e-4)


PADDED = {"dna": ["ACG", "ACGTTGCA"], "bpe": ["def", "def hello(world):"]}


@pytest.mark.parametrize("name", ["dna", "bpe"])
def test_padded_batches_from_the_tokenizer_are_refused(saved_folders, name):
    """The saved tokenizer returns the attention mask, so prompts of different lengths padded by it (and
    by the pipeline's batching) are refused by the forward instead of running on pad tokens."""
    folder, *_ = saved_folders[name]
    tok = transformers.AutoTokenizer.from_pretrained(folder, padding_side="left")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    enc = tok(PADDED[name], padding=True, return_tensors="pt")
    assert sorted(enc) == ["attention_mask", "input_ids"]
    with torch.no_grad(), pytest.raises(ValueError, match="padded batches are not supported"):
        hf(**enc)
    with pytest.raises(ValueError, match="padded batches are not supported"):
        hf.generate(**enc, max_new_tokens=3, do_sample=False)
    pipe = transformers.pipeline("text-generation", model=hf, tokenizer=tok)
    with pytest.raises(ValueError, match="padded batches are not supported"):
        pipe(PADDED[name], max_new_tokens=3, do_sample=False, batch_size=2)
    same = [PADDED[name][1]] * 2  # equal lengths: no padding, the batch runs
    assert len(pipe(same, max_new_tokens=3, do_sample=False, batch_size=2)) == 2


def test_a_nul_byte_is_text_not_padding(saved_folders):
    """Every byte is text, NUL included: a byte folder has no pad id for generate to read a mask from, so a
    prompt holding NUL generates as ours does; batching prompts, which needs a pad token, is refused."""
    folder, model, tok, _ = saved_folders["bytes"]
    prompt = "a\x00b"
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([hf_tok(prompt)["input_ids"]])
    assert ids[0].tolist() == tok.encode(prompt) == [97, 0, 98]
    want = generate(model, ids, 6, greedy=True)
    assert torch.equal(hf.generate(ids, max_new_tokens=6, do_sample=False), want)
    pipe = transformers.pipeline("text-generation", model=str(folder), trust_remote_code=True)
    got = pipe(prompt, max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert got == prompt + tok.decode(want[0, 3:].tolist())
    with pytest.raises(ValueError, match="padding token"):
        hf_tok(["a", "abc"], padding=True)
    with pytest.raises(ValueError, match="pad_token"):
        pipe(["a", "abc"], max_new_tokens=2, do_sample=False, batch_size=2)


@pytest.mark.parametrize("tie", [True, False])
def test_resize_token_embeddings_keeps_the_configs_in_step(tmp_path, tie):
    """resize_token_embeddings: the new ids are accepted, the Titans config (and the inner model's) has the
    new size, and the saved folder loads back with the same logits."""
    hf = TitansForCausalLM.from_titans(tiny_model("mac", tie_embeddings=tie)).eval()
    hf.resize_token_embeddings(VOCAB + 9)
    n = VOCAB + 9
    assert hf.config.vocab_size == hf.config.titans["vocab_size"] == hf.model.config.vocab_size == n
    assert hf.model.embed.weight.shape[0] == hf.model.head.weight.shape[0] == n
    assert (hf.model.head.weight is hf.model.embed.weight) == tie
    x = torch.tensor([[1, VOCAB + 5, 3, VOCAB + 8]])
    with torch.no_grad():
        want = hf(x).logits
    assert want.shape == (1, 4, n)
    hf.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.to_titans() == hf.model.config
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, want, atol=1e-6, rtol=1e-6)


def test_hidden_states_attentions_and_a_raw_state(saved_dir):
    """output_hidden_states gives the embedding output and each block's output (the last after the final
    norm, which the head reads), in forward and generate; output_attentions is refused (no attention
    weights to return); a bare TitansState passed to generate is refused, naming TitansCache."""
    _, model = saved_dir
    hf = TitansForCausalLM.from_titans(model).eval()
    x = tokens(2, 9)
    with torch.no_grad():
        out = hf(x, output_hidden_states=True)
        logits, state = model(x)
        first, _ = model.blocks[0](model.embed(x), None, None)
    hidden = out.hidden_states
    assert len(hidden) == len(model.blocks) + 1 and all(h.shape == (2, 9, model.config.dim) for h in hidden)
    torch.testing.assert_close(hidden[0], model.embed(x).detach())
    torch.testing.assert_close(hidden[1], first)
    torch.testing.assert_close(model.head(hidden[-1]).detach(), logits)
    torch.testing.assert_close(out.logits, logits)
    assert hf(x).hidden_states is None
    for graph in (None, "eager"):  # a decode step through the static decoder runs eagerly to give them
        hf.config.decode_graph = graph
        kwargs = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        gen = hf.generate(x, output_hidden_states=True, **kwargs)
        assert len(gen.hidden_states) == 3 and len(gen.hidden_states[-1]) == len(model.blocks) + 1
        assert torch.equal(gen.sequences, generate(model, x, 3, greedy=True))
    hf.config.decode_graph = None
    with pytest.raises(ValueError, match="output_attentions is not supported"):
        hf(x, output_attentions=True)
    with pytest.raises(ValueError, match="output_attentions is not supported"):
        hf.generate(x, output_attentions=True, **kwargs)
    for key in ("past_key_values", "cache"):
        with pytest.raises(TypeError, match=r"TitansCache\(state\)"):
            hf.generate(x[:, :1], max_new_tokens=2, **{key: state})


def test_generate_refuses_a_cache_that_has_read_the_whole_prompt():
    """The cache of forward(x) has read all of x, its last token included: generate(x) from it would have
    transformers feed x again (5.24 slices input_ids[:, -0:]), read into the memory twice, silently. It is
    refused, for the prompt itself and for a shorter one, under either keyword; the ways the message names
    (the sequence plus a new token; only the new tokens in TitansCache(cache.state); the cache of
    forward(x[:, :-1]) with x; a mask over the whole sequence) each give one reading of every token. A cache
    returned by generate leaves its last token out, so its sequences continue it."""
    model = tiny_model("mag")
    hf = TitansForCausalLM.from_titans(model).eval()
    x, new = tokens(1, 9), tokens(1, 3, seed=7)
    whole = torch.cat([x, new], 1)
    gen = partial(hf.generate, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        cache = _cache(hf(x))
        short = _cache(hf(x[:, :-1]))
    assert cache.get_seq_length() == 9
    for key in ("past_key_values", "cache"):
        for prompt in (x, new):
            with pytest.raises(ValueError, match=r"already consumed 9 tokens .*TitansCache\(cache\.state\)"):
                gen(prompt, **{key: cache})
    assert cache.get_seq_length() == 9  # untouched
    assert torch.equal(gen(x, past_key_values=short), gen(x))
    want = gen(whole)
    assert torch.equal(gen(whole, past_key_values=cache), want)
    assert torch.equal(gen(new, past_key_values=TitansCache(cache.state)), want[:, 9:])
    mask = torch.ones_like(whole)
    assert torch.equal(gen(new, attention_mask=mask, past_key_values=cache), want[:, 9:])
    out = gen(x, return_dict_in_generate=True)
    assert _cache(out).get_seq_length() == out.sequences.shape[1] - 1  # the last token is left out
    assert torch.equal(gen(out.sequences, past_key_values=_cache(out)), gen(x, max_new_tokens=8))


def test_num_return_sequences_and_beams_from_a_batched_state():
    """A state of 2 rows (two documents read) with num_return_sequences=k or num_beams=k: transformers
    expands input_ids to 2k rows with repeat_interleave and the state is expanded the same way, so row i's
    copies start from row i's state: greedy copies (sampling with top_k=1, eager and through the static
    decoder) have the tokens and logits of each row's greedy continuation, and beam search equals beam
    search of each row from its own state (the scores tell the states apart: the tiny model's tokens barely
    depend on them). The cache passed in keeps its 2 rows."""
    model = shared_model("mag", vocab_size=VOCAB, dtype=torch.float64)
    hf = TitansForCausalLM.from_titans(model).eval()
    _, state = prefill(model, tokens(2, 20, seed=4))
    question = tokens(2, 3, seed=5)
    cache = TitansCache(state)
    logits = dict(return_dict_in_generate=True, output_logits=True)
    greedy = hf.generate(question, past_key_values=cache, max_new_tokens=5, do_sample=False, **logits)
    assert torch.equal(greedy.sequences, generate(model, question, 5, greedy=True, state=state))
    swapped = TitansCache(select_rows(state, [1, 0]))
    other = hf.generate(question, past_key_values=swapped, max_new_tokens=5, do_sample=False, **logits)
    assert not torch.allclose(other.logits[0], greedy.logits[0])  # each row's state matters
    # (transformers refuses num_return_sequences > 1 for greedy search: sampling with top_k=1 is greedy)
    for graph in (None, "eager"):
        hf.config.decode_graph = graph
        kw = dict(max_new_tokens=5, do_sample=True, top_k=1, num_return_sequences=2, **logits)
        out = hf.generate(question, past_key_values=cache, **kw)
        assert torch.equal(out.sequences, greedy.sequences.repeat_interleave(2, 0)), graph
        for got, want in zip(out.logits, greedy.logits, strict=True):
            torch.testing.assert_close(got, want.repeat_interleave(2, 0))
    hf.config.decode_graph = None
    for kw in (dict(num_beams=2), dict(num_beams=3, num_return_sequences=2)):
        kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True, **kw)
        out = hf.generate(question, past_key_values=cache, **kw)
        want = [
            hf.generate(question[i : i + 1], past_key_values=TitansCache(select_rows(state, [i])), **kw)
            for i in range(2)
        ]
        assert torch.equal(out.sequences, torch.cat([w.sequences for w in want])), kw
        torch.testing.assert_close(out.sequences_scores, torch.cat([w.sequences_scores for w in want]))
        mixed = hf.generate(question, past_key_values=swapped, **kw)
        assert not torch.allclose(mixed.sequences_scores, out.sequences_scores)
    torch.manual_seed(1)  # sampling runs, each of the 4 rows from its document's state
    out = hf.generate(
        question, past_key_values=cache, max_new_tokens=4, do_sample=True, num_return_sequences=2
    )
    assert out.shape == (4, 7) and torch.equal(out[:, :3], question.repeat_interleave(2, 0))
    assert state_batch_size(cache.state) == 2 and cache.state is state


def test_an_export_without_overwrite_never_replaces_another_writers_folder(tmp_path, monkeypatch):
    """Two `titans export-hf` into one new folder at once, without --overwrite: both checked the folder
    empty before loading, then both wrote, the second silently replacing the first's export (exit 0)."""
    import stat

    import titans.hf
    from titans.data.tokenizers import ByteTokenizer
    from titans.hf import export

    out = tmp_path / "hf"
    real = export.ordinary_mode

    def other_export_lands(path):  # the other writer publishes while this export is being staged
        if not out.exists():
            out.mkdir()
            (out / "config.json").write_text('{"the": "other export"}')
        return real(path)

    monkeypatch.setattr(export, "ordinary_mode", other_export_lands)
    model = shared_model("mac", vocab_size=256, dtype=torch.float32)
    with pytest.raises(FileExistsError, match="was written by another export meanwhile"):
        titans.hf.save_pretrained(model, out, ByteTokenizer(), overwrite=False)
    assert [p.name for p in out.iterdir()] == ["config.json"]  # the other's, kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging folder left
    monkeypatch.undo()
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        titans.hf.save_pretrained(model, out, ByteTokenizer(), overwrite=False)
    # an empty folder is written into, kept as it is (a mount point, a symlink, a shared folder's mode)
    (out / "config.json").unlink()
    real = tmp_path / "real"
    out.rmdir()
    real.mkdir(mode=0o2770)
    real.chmod(0o2770)
    out.symlink_to(real)
    assert titans.hf.save_pretrained(model, out, ByteTokenizer(), overwrite=False)
    assert out.is_symlink() and (real / "model.safetensors").is_file()
    assert (real / "config.json").stat().st_size > 0  # the export's, over the claim's empty marker
    assert stat.S_IMODE(real.stat().st_mode) == 0o2770 and not list(real.glob(".export-*"))
    # another export claimed the empty folder first: refused, its marker left to it
    (empty := tmp_path / "empty").mkdir()

    def claimed_meanwhile(path):
        if not (empty / "config.json").exists():
            (empty / "config.json").write_text("")
        return real_mode(path)

    real_mode = export.ordinary_mode
    monkeypatch.setattr(export, "ordinary_mode", claimed_meanwhile)
    with pytest.raises(FileExistsError, match="was written by another export meanwhile"):
        titans.hf.save_pretrained(model, empty, ByteTokenizer(), overwrite=False)
    assert [p.name for p in empty.iterdir()] == ["config.json"]


def test_a_folder_loaded_through_remote_code_saves_as_the_installed_classes(saved_folders, tmp_path):
    """Loaded with trust_remote_code and saved (as the Trainer's save_model does), transformers copied
    the loaded class's module file into the folder and pointed auto_map at it: saved twice, the folder
    then loaded frozen copies of titans' classes, and titans.hf.TitansCache was refused as "not a
    TitansCache". A saved folder always points at titans' remote code."""
    folder, model, tok, prompt = saved_folders["bytes"]
    first, second = tmp_path / "g1", tmp_path / "g2"
    code = f"""
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).save_pretrained({str(first)!r})
AutoModelForCausalLM.from_pretrained({str(first)!r}, trust_remote_code=True).save_pretrained({str(second)!r})
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for saved in (first, second):
        auto_map = json.loads((saved / "config.json").read_text())["auto_map"]
        assert auto_map == json.loads((folder / "config.json").read_text())["auto_map"]
        assert not (saved / "configuration.py").exists() and not (saved / "modeling.py").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(second, trust_remote_code=True)
    assert isinstance(hf, TitansForCausalLM)
    x = torch.tensor([tok.encode(prompt)])
    _, state = prefill(model, x[:, :-1])
    theirs = hf.generate(x[:, -1:], past_key_values=TitansCache(state), max_new_tokens=4, do_sample=False)
    assert torch.equal(theirs, generate(model, x[:, -1:], 4, greedy=True, state=state))


def test_a_checkpoint_without_its_embedding_is_refused(saved_dir, tmp_path):
    """The embedding is the head's tied weight: a checkpoint without it loaded with no warning and the
    embedding left on the meta device (generate failed later on a meta tensor)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, _ = saved_dir
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.embed.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks model\.embed\.weight.*export it again"):
        transformers.AutoModelForCausalLM.from_pretrained(broken)


def test_a_config_override_the_model_would_ignore_is_refused(saved_dir):
    """`from_pretrained(path, num_hidden_layers=1)` and `config.vocab_size = 500` were ignored (the model
    is built from config.titans) while the config said otherwise. They are refused, naming the field; a
    change to config.titans carries to the mirrored names."""
    path, model = saved_dir
    with pytest.raises(ValueError, match=r"num_hidden_layers=1 disagrees with titans\['depth'\]"):
        transformers.AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=1)
    config = transformers.AutoConfig.from_pretrained(path)
    config.vocab_size = 500
    with pytest.raises(ValueError, match=r"vocab_size=500 disagrees"):
        transformers.AutoModelForCausalLM.from_config(config)
    config = transformers.AutoConfig.from_pretrained(path)
    config.titans = {**config.titans, "depth": 1}
    assert config.num_hidden_layers == 1
    assert len(transformers.AutoModelForCausalLM.from_config(config).model.blocks) == 1
    config = transformers.AutoConfig.from_pretrained(path)
    config.titans["depth"] = 1  # in place: the mirror cannot follow; the message gives both ways out
    with pytest.raises(
        ValueError, match=r"config.titans = \{\*\*config.titans, 'depth': 2\}.*set num_hidden_layers = 1"
    ):
        transformers.AutoModelForCausalLM.from_config(config)
    config.num_hidden_layers = 1
    assert len(transformers.AutoModelForCausalLM.from_config(config).model.blocks) == 1


def test_every_n_layers_is_refused_not_ignored(saved_dir):
    """`activation_checkpointing_enable(every_n_layers=2)` recomputed every block all the same."""
    path, _ = saved_dir
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError, match="every_n_layers=2 is not supported"):
        hf.activation_checkpointing_enable(every_n_layers=2)
    hf.activation_checkpointing_enable(every_n_layers=1)
    assert hf.model.gradient_checkpointing


def test_sigterm_during_an_export_leaves_no_staging_folder(tmp_path, monkeypatch):
    """SIGTERM killed an export at once, leaving its hidden `.export-*` staging folder: the next export
    into the folder was refused as not empty (while `ls` showed it empty). SIGTERM now unwinds it as
    Ctrl-C does (status 143), removing the staging folder."""
    import signal

    from titans.hf.export import save_pretrained

    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        pytest.skip("this process handles SIGTERM itself")
    model = tiny_model("lmm")
    real = TitansForCausalLM.save_pretrained

    def save_then_terminated(self, *args, **kwargs):
        real(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, mid-export

    out = tmp_path / "empty"
    out.mkdir()
    with monkeypatch.context() as m:
        m.setattr(TitansForCausalLM, "save_pretrained", save_then_terminated)
        with pytest.raises(SystemExit) as ended:
            save_pretrained(model, out, overwrite=False)
    assert ended.value.code == 128 + signal.SIGTERM
    assert list(out.iterdir()) == [] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert save_pretrained(model, out, overwrite=False)  # the folder is still free
