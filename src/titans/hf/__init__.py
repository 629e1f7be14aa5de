"""Hugging Face `transformers` integration (optional extra: `pip install 'titans[hf]'`).

Importing this package registers the "titans" model type with `AutoConfig` and `AutoModelForCausalLM`:

    import titans.hf
    hf_model = titans.hf.TitansForCausalLM.from_titans(model)       # wrap a TitansLM (shares its weights)
    hf_model.save_pretrained("out/")
    hf_model = AutoModelForCausalLM.from_pretrained("out/")         # after `import titans.hf`
    ids = hf_model.generate(prompt, max_new_tokens=20, do_sample=False)

The `TitansState` travels through `generate()` in a `TitansCache`, as `past_key_values` (`cache` from
transformers 5.24). The core library never imports this package, so `transformers` stays optional.
"""

from titans.hf.configuration import TitansHFConfig
from titans.hf.modeling import TitansCache, TitansForCausalLM, register

register()

__all__ = ["TitansCache", "TitansForCausalLM", "TitansHFConfig", "register"]
