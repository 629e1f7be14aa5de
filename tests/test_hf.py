"""The transformers wrapper: save/load through the Auto classes, and transformers' generate() == ours."""

from __future__ import annotations

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
from titans.inference import generate, prefill  # noqa: E402

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


def test_core_library_does_not_import_transformers():
    code = "import sys, titans, titans.inference.cli; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
