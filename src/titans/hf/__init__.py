"""Hugging Face `transformers` integration (optional extra: `pip install 'titans[hf]'`).

Importing this package registers the "titans" model type with `AutoConfig` and `AutoModelForCausalLM`:

    import titans.hf
    titans.hf.save_pretrained(model, "out/", tokenizer)             # weights, config, remote code, tokenizer
    hf_model = AutoModelForCausalLM.from_pretrained("out/")         # after `import titans.hf`
    hf_model = AutoModelForCausalLM.from_pretrained("out/", trust_remote_code=True)  # in any process
    tok = AutoTokenizer.from_pretrained("out/", trust_remote_code=True)  # it reads the config too
    ids = hf_model.generate(prompt, max_new_tokens=20, do_sample=False)
    hf_model = titans.hf.TitansForCausalLM.from_titans(model)       # wrap a TitansLM (shares its weights)

The `TitansState` travels through `generate()` in a `TitansCache`, as `past_key_values` (`cache` from
transformers 5.24). The core library never imports this package, so `transformers` stays optional.
"""

from titans.hf.configuration import TitansHFConfig
from titans.hf.export import save_pretrained
from titans.hf.modeling import TitansCache, TitansForCausalLM, register
from titans.hf.tokenization import special_token_ids, to_hf_tokenizer

register()

__all__ = [
    "TitansCache",
    "TitansForCausalLM",
    "TitansHFConfig",
    "register",
    "save_pretrained",
    "special_token_ids",
    "to_hf_tokenizer",
]
