"""`TitansForCausalLM`: a `transformers` causal LM around `TitansLM`, with the state as the cache.

`generate()` drives the model one forward per step; our forward threads a `TitansState` through
`past_key_values` (wrapped in a `TitansCache`), so transformers' decoding costs what ours does. The state
can also come from outside: `past_key_values=TitansCache(load_state("doc.safetensors"))` continues after
a document read earlier; `input_ids` then holds only the new tokens (the cache counts as "seen" only the
tokens it consumed since it was wrapped, which is the convention `generate()` slices inputs by).

Decoding as a fixed graph (opt-in): with `config.decode_graph` set to "compile", "cuda_graph" or "eager"
(`titans.models.decode_graph.StaticDecoder`'s modes), a forward of one token per row from a state, with no
gradient and no labels (what `generate()` runs after the prompt), steps a static decoder whose buffers
hold the state, instead of calling the model. The cache it returns is live: its state stays in the
decoder's buffers and is copied out only when read (`cache.state`); the next forward from it steps the
buffers in place, after which the cache it came from holds no state (reading it raises; the eager path
keeps every cache valid). The logits equal the eager forward's to float rounding, not bit for bit: hence
opt-in. Prompts (more than one token) run eagerly.

A state of b > 1 rows with `num_return_sequences=k` or `num_beams=k` is expanded as transformers expands
`input_ids` (`repeat_interleave`): rows i*k ... i*k + k-1 start from row i's state.

Not supported (refused with a clear error): padded batches (an attention mask with zeros: Titans states
are per-row streams), `inputs_embeds`, `output_attentions` (no attention weights are kept), a bare
`TitansState` as generate's cache (wrap it in a `TitansCache`), and a generate cache that has consumed every
token of `input_ids` (the cache of `forward(x)` with `x` again: transformers would feed the prompt twice).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from titans.hf.configuration import TitansHFConfig
from titans.models.decode_graph import MODES, DecoderPool, StaticDecoder, state_dtypes
from titans.models.lm import TitansLM
from titans.models.state import TitansState, expand_state, select_rows, state_batch_size

# The remote code written beside a saved model: `trust_remote_code=True` loads these modules, which take the
# classes from the installed library, so a folder and `import titans.hf` give the very same classes (a
# `titans.hf.TitansCache` passed to a model loaded either way is the one its forward expects).
REMOTE_CODE = {
    "configuration_titans.py": (
        '"""Remote code for a saved Titans model (needs `pip install titans[hf]`)."""\n\n'
        "from titans.hf.configuration import TitansHFConfig\n\n"
        '__all__ = ["TitansHFConfig"]\n'
    ),
    "modeling_titans.py": (
        '"""Remote code for a saved Titans model (needs `pip install titans[hf]`)."""\n\n'
        "from titans.hf.modeling import TitansCache, TitansForCausalLM\n\n"
        '__all__ = ["TitansCache", "TitansForCausalLM"]\n'
    ),
}
AUTO_MAP = {
    "AutoConfig": "configuration_titans.TitansHFConfig",
    "AutoModelForCausalLM": "modeling_titans.TitansForCausalLM",
}


# transformers >= 5.24 names the output's cache field `cache` (and warns on `past_key_values`)
_OUTPUT_CACHE = (
    "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"
)


class TitansCache:
    """`past_key_values` for transformers: a `TitansState` and the position it had when wrapped.

    get_seq_length(): tokens consumed since wrapping (what `generate()` expects `input_ids` to repeat).
    A live cache (`config.decode_graph`, see the module docstring) holds its state in a `StaticDecoder`'s
    buffers; `state` copies it out.
    """

    is_compileable = False
    is_croppable = False
    # transformers >= 5.24 slices `input_ids` by get_seq_length() only for caches that are not all "linear"
    # (a Mamba-style cache); ours counts tokens since wrapping so that slicing is the one we want
    is_linear = (False,)

    def __init__(self, state: TitansState | None = None, base_position: int | None = None):
        if state is not None and not isinstance(state, TitansState):
            raise TypeError(f"TitansCache: expected a TitansState, got {type(state).__name__}")
        self._state = state
        self.position = 0 if state is None else state.position
        if base_position is None:
            base_position = self.position
        self.base_position = base_position
        self._decoder: StaticDecoder | None = None  # live: the state is in this decoder's buffers
        self._version = -1  # the decoder's version that holds this cache's state

    @classmethod
    def live(cls, decoder: StaticDecoder, base_position: int) -> TitansCache:
        """The cache whose state is `decoder`'s current buffers; the decoder remembers it as their holder."""
        cache = cls(None, base_position)
        cache.position, cache._decoder, cache._version = decoder.position, decoder, decoder.version
        decoder.holder = weakref.ref(cache)
        return cache

    def is_live(self) -> bool:
        """Whether the state is the decoder's current buffers (the next step may move them on in place)."""
        return self._decoder is not None and self._decoder.version == self._version

    @property
    def state(self) -> TitansState | None:
        if self._state is None and self._decoder is not None:
            if not self.is_live():
                raise RuntimeError(
                    "TitansCache: this cache's state was moved on in place by the static decoder "
                    "(config.decode_graph); continue from the cache the later forward returned"
                )
            self._state = self._decoder.state()  # a copy, valid after the buffers move on
        return self._state

    @state.setter
    def state(self, state: TitansState | None) -> None:
        self._state, self._decoder = state, None
        self.position = 0 if state is None else state.position

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.position - self.base_position

    def advanced(self, state: TitansState) -> TitansCache:
        """The cache after a forward pass produced `state` (same base)."""
        return TitansCache(state, self.base_position)

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Beam search's hook (transformers calls the cache's, as the model defines no `_reorder_cache`)."""
        if self.state is not None:
            self.state = select_rows(self.state, beam_idx)

    def __repr__(self) -> str:
        pos = None if self._state is None and self._decoder is None else self.position
        return f"TitansCache(position={pos}, base_position={self.base_position})"


class TitansForCausalLM(PreTrainedModel, GenerationMixin):
    """A `TitansLM` (as `.model`) under the transformers API: from_pretrained, save_pretrained, generate.

    forward(input_ids (B, T), past_key_values (or cache)=None | TitansCache | TitansState, labels=None)
        -> CausalLMOutputWithPast(loss, logits (B, T, vocab), past_key_values=TitansCache, hidden_states)
    labels follow the transformers convention (same as input_ids, shifted inside; -100 is ignored); the
    loss is their mean, or with `num_items_in_batch` (the Trainer's) their sum divided by it.
    output_hidden_states: depth + 1 tensors (B, T, dim), the embedding output and each block's output, the
    last after the final norm (the head's input), as transformers' models give them.
    """

    config_class = TitansHFConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _tied_weights_keys = {"model.head.weight": "model.embed.weight"}
    _is_stateful = True  # no assisted decoding: a state cannot be rolled back
    supports_gradient_checkpointing = True  # `TitansLM.gradient_checkpointing`: each block recomputed

    def __init__(self, config: TitansHFConfig):
        super().__init__(config)
        config.check_mirrors()  # an override of a mirrored name would be ignored by the model built here
        self.model = TitansLM(config.to_titans())
        if not next(self.model.parameters()).is_meta:  # initialised by TitansLM: `_init_weights` keeps them
            for tensor in (*self.model.parameters(), *self.model.buffers()):
                tensor._is_hf_initialized = True
        self.post_init()

    def _init_weights(self, module) -> None:
        """Initialise ``module``'s own tensors that were not loaded (transformers calls it for those a
        checkpoint lacks, or whose shape it changed: ``ignore_mismatched_sizes``) as a fresh TitansLM
        initialises them: copied from one built for this config, so that every kind of tensor (projections,
        norms, the memory's gates and initial weights, persistent tokens) gets its own initialisation."""
        own = [
            (name, t)
            for name, t in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
            if t is not None and not getattr(t, "_is_hf_initialized", False)
        ]
        if not own:
            return
        fresh = self.__dict__.get("_fresh_tensors")
        if fresh is None:  # one fresh model per loading, dropped when `initialize_weights` ends
            with torch.device("cpu"):
                reference = TitansLM(self.config.to_titans())
            fresh = {f"model.{k}": v for k, v in reference.state_dict().items()}
            fresh.update({f"model.{k}": v for k, v in reference.named_buffers()})
            self.__dict__["_fresh_tensors"] = fresh
            self.__dict__["_module_names"] = {id(m): n for n, m in self.named_modules()}
        prefix = self.__dict__["_module_names"][id(module)]
        with torch.no_grad():
            for name, tensor in own:
                tensor.copy_(fresh[f"{prefix}.{name}" if prefix else name])

    def initialize_weights(self) -> None:
        try:
            super().initialize_weights()
        finally:
            self.__dict__.pop("_fresh_tensors", None)
            self.__dict__.pop("_module_names", None)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # our forward creates and returns its own cache (a TitansCache)

    @classmethod
    def from_titans(cls, model: TitansLM, **config_kwargs) -> TitansForCausalLM:
        """Wrap an existing TitansLM; the wrapper shares its parameters. config_kwargs: e.g. eos_token_id."""
        if not isinstance(model, TitansLM):
            raise TypeError(f"from_titans: expected a TitansLM, got {type(model).__name__}")
        hf = cls(TitansHFConfig.from_titans(model.config, **config_kwargs))
        hf.model = model
        return hf.to(next(model.parameters()).dtype)

    def to_titans(self) -> TitansLM:
        return self.model

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """transformers' save_pretrained, plus the remote code and `auto_map` that let
        `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` load the folder in a process
        that has not imported `titans.hf`."""
        if kwargs.get("push_to_hub"):  # transformers would upload before the remote code is written
            raise ValueError(
                "TitansForCausalLM.save_pretrained: push_to_hub is not supported; save the folder, then "
                "upload it whole (huggingface_hub.upload_folder)"
            )
        self.config.auto_map = dict(AUTO_MAP)
        # loaded through remote code, transformers marks both with the class it loaded and, saving, copies
        # that class's module file beside the weights and points auto_map at the copy: a folder saved twice
        # then loaded frozen copies of titans' classes (titans.hf.TitansCache was refused as not a
        # TitansCache). Our remote code imports the installed classes: it is written below, as always.
        marks = (self.__dict__.get("_auto_class"), self.config.__dict__.get("_auto_class"))
        self._auto_class = self.config._auto_class = None
        try:
            super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self._auto_class, self.config._auto_class = marks
        if kwargs.get("is_main_process", True):
            for name, text in REMOTE_CODE.items():
                (Path(save_directory) / name).write_text(text)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' from_pretrained, refusing weights it left on the meta device: the embedding is
        tied to the head by one shared parameter, and transformers counts it as loaded through the tie
        when the checkpoint lacks it, so it was neither reported missing nor initialised (generate then
        failed on a meta tensor). With a device_map (accelerate may offload weights to meta) it is not
        checked."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True
        if kwargs.get("device_map") is None:
            meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
            if meta:
                raise ValueError(
                    f"TitansForCausalLM.from_pretrained: the checkpoint lacks {', '.join(meta[:5])}"
                    + (f" and {len(meta) - 5} more" if len(meta) > 5 else "")
                    + ", which transformers left uninitialised (on the meta device): the folder's weights "
                    "are incomplete; export it again"
                )
        return loaded

    def _set_gradient_checkpointing(self, enable=True, gradient_checkpointing_func=None, every_n_layers=1):
        """transformers' switch, on `TitansLM.gradient_checkpointing` (every block or none):
        ``every_n_layers`` other than 1 is refused (it was ignored, every block recomputed)."""
        if enable and every_n_layers != 1:
            raise ValueError(
                f"TitansForCausalLM: every_n_layers={every_n_layers} is not supported: activation "
                "checkpointing recomputes every block (TitansLM.gradient_checkpointing); use every_n_layers=1"
            )
        kwargs = (
            {}
            if gradient_checkpointing_func is None
            else {"gradient_checkpointing_func": gradient_checkpointing_func}
        )
        super()._set_gradient_checkpointing(enable=enable, **kwargs)

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """transformers' resize (the embedding, and the head when untied), with the Titans configs following,
        so that the model accepts the new ids and a saved folder loads at the new size."""
        embed = super().resize_token_embeddings(*args, **kwargs)
        n = self.model.embed.weight.shape[0]
        # a new TitansConfig: the one the model was built from may be shared with other models
        self.model.config = dataclasses.replace(self.model.config, vocab_size=n)
        self.model._config_dict = None  # TitansLM.config_dict caches the dict states carry; built anew
        self.config.titans = {**self.config.titans, "vocab_size": n}
        self.config.vocab_size = n
        self.__dict__.pop("_decoders", None)  # static decoders hold the old embedding and head
        return embed

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`. Refused: a bare `TitansState` as the cache (generate reads attributes
        of the cache that only a `TitansCache` has), and a cache that has already consumed every token of
        `input_ids` (transformers would then feed the whole prompt again: it would be read into the memory
        twice)."""
        for key in ("past_key_values", "cache"):
            if isinstance(kwargs.get(key), TitansState):
                raise TypeError(
                    f"TitansForCausalLM.generate: {key} is a bare TitansState; wrap it as "
                    f"{key}=TitansCache(state) (titans.hf.TitansCache)"
                )
            cache = kwargs.get(key)
            if isinstance(cache, TitansCache):
                _check_cache_leaves_new_tokens(cache, key, args, kwargs)
        return super().generate(*args, **kwargs)

    def _expand_inputs_for_generation(self, expand_size: int = 1, is_encoder_decoder: bool = False, **kwargs):
        """transformers' expansion of the batch to `num_return_sequences` / `num_beams` copies per row
        (`repeat_interleave`: row i's copies are rows i*k ... i*k + k-1), with the cache's state expanded
        the same way: a state of b > 1 rows becomes k*b rows, row i's copies starting from row i's state (a
        batch-1 state is shared by every row, see forward). The cache passed in is left as it was."""
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size=expand_size, is_encoder_decoder=is_encoder_decoder, **kwargs
        )
        if expand_size > 1:
            for key in ("cache", "past_key_values"):
                cache = model_kwargs.get(key)
                state = cache.state if isinstance(cache, TitansCache) else None
                if state is not None and (rows := state_batch_size(state)) > 1:
                    index = torch.arange(rows).repeat_interleave(expand_size)
                    model_kwargs[key] = TitansCache(select_rows(state, index), cache.base_position)
        return input_ids, model_kwargs

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value) -> None:
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.head

    def set_output_embeddings(self, value) -> None:
        self.model.head = value

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: TitansCache | TitansState | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        cache: TitansCache | TitansState | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        num_items_in_batch: Tensor | int | None = None,
        **kwargs,  # position_ids, cache_position, ...: positions live in the state
    ):
        # transformers >= 5.24 passes the cache as `cache`; earlier versions as `past_key_values`
        if cache is not None and past_key_values is not None:
            raise ValueError("TitansForCausalLM: pass the state as `cache` or as `past_key_values`, not both")
        past_key_values = cache if cache is not None else past_key_values
        if inputs_embeds is not None:
            raise ValueError("TitansForCausalLM: inputs_embeds is not supported; pass input_ids")
        if input_ids is None:
            raise ValueError("TitansForCausalLM: input_ids is required")
        if input_ids.dim() == 2 and input_ids.shape[1] == 0:
            raise ValueError(
                "TitansForCausalLM: input_ids is empty; give at least one token (the next-token logits come "
                "from the last input token, a saved state does not hold them)"
            )
        if output_attentions is None:
            output_attentions = getattr(self.config, "output_attentions", False)
        if output_attentions:
            raise ValueError(
                "TitansForCausalLM: output_attentions is not supported (the attention weights are not kept; "
                "the memory has none)"
            )
        if output_hidden_states is None:
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(
                "TitansForCausalLM: padded batches are not supported (the attention mask has zeros); Titans "
                "states are per-row streams: batch prompts of equal length or generate them one by one"
            )
        if isinstance(past_key_values, TitansState):
            past_key_values = TitansCache(past_key_values)
        elif past_key_values is not None and not isinstance(past_key_values, TitansCache):
            raise TypeError(
                f"TitansForCausalLM: past_key_values must be a TitansCache or TitansState, got "
                f"{type(past_key_values).__name__}"
            )
        cache = past_key_values or TitansCache()
        use_cache = True if use_cache is None else use_cache
        mode = getattr(self.config, "decode_graph", None)
        if mode is not None and mode not in MODES:
            raise ValueError(
                f"TitansForCausalLM: config.decode_graph must be None or one of {MODES}, got {mode!r}"
            )
        if (
            mode is not None
            and input_ids.shape[1] == 1
            and cache.position >= 1
            and labels is None
            and use_cache
            and not torch.is_grad_enabled()
            and not output_hidden_states  # the static step keeps no hidden states: those steps run eagerly
        ):
            logits, decoder = self._static_step(input_ids, cache, mode)
            logits, new_cache = logits[:, None], TitansCache.live(decoder, cache.base_position)
            out = CausalLMOutputWithPast(logits=logits, **{_OUTPUT_CACHE: new_cache})
            return out.to_tuple() if return_dict is False else out
        state = cache.state
        if state is not None and input_ids.shape[0] > 1 and state_batch_size(state) == 1:
            state = expand_state(state, input_ids.shape[0])  # one read document, many rows
        logits, new_state, hidden_states = self._run(input_ids, state, output_hidden_states)
        loss = None
        if labels is not None:
            # as transformers' causal LMs: the Trainer passes the count of labelled tokens over all the
            # batches it accumulates, and then leaves the loss undivided by their number
            reduction = "mean" if num_items_in_batch is None else "sum"
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
                reduction=reduction,
            )
            if num_items_in_batch is not None:
                if torch.is_tensor(num_items_in_batch):
                    num_items_in_batch = num_items_in_batch.to(loss.device)
                loss = loss / num_items_in_batch
        new_cache = cache.advanced(new_state) if use_cache else None
        out = CausalLMOutputWithPast(
            loss=loss, logits=logits, hidden_states=hidden_states, **{_OUTPUT_CACHE: new_cache}
        )
        return out.to_tuple() if return_dict is False else out

    def _run(
        self, input_ids: Tensor, state: TitansState | None, output_hidden_states: bool
    ) -> tuple[Tensor, TitansState, tuple[Tensor, ...] | None]:
        """The model on input_ids (B, T) -> (logits (B, T, vocab), state, hidden states or None): with
        `output_hidden_states`, the embedding output, each block's output and the final norm's in place of
        the last block's, each (B, T, dim), read by forward hooks (each module's first call: a checkpointed
        block runs again in the backward pass)."""
        if not output_hidden_states:
            logits, new_state = self.model(input_ids, state)
            return logits, new_state, None
        modules = [self.model.embed, *self.model.blocks, self.model.norm]
        seen: dict[int, Tensor] = {}

        def keep(module: nn.Module, args, out) -> None:
            seen.setdefault(id(module), out[0] if isinstance(out, tuple) else out)  # a block: (x, state)

        hooks = [m.register_forward_hook(keep) for m in modules]
        try:
            logits, new_state = self.model(input_ids, state)
        finally:
            for hook in hooks:
                hook.remove()
        hidden = [seen[id(m)] for m in modules]
        return logits, new_state, (*hidden[:-2], hidden[-1])

    def _static_step(self, input_ids: Tensor, cache: TitansCache, mode: str) -> tuple[Tensor, StaticDecoder]:
        """input_ids (B, 1) from `cache` through the static decoder of (B, mode) -> (logits (B, vocab), the
        decoder). A live cache steps its decoder in place; any other state is loaded into the decoder (its
        current holder, if any, first copies its state out, so it stays valid)."""
        decoders = self.__dict__.setdefault("_decoders", DecoderPool())
        like = next(self.model.parameters())
        decoder = cache._decoder if cache.is_live() else None
        same = decoder is not None and decoder.model is self.model and decoder.mode == mode
        if not (same and decoder.batch == input_ids.shape[0]):
            state = cache.state
            if input_ids.shape[0] > 1 and state_batch_size(state) == 1:
                state = expand_state(state, input_ids.shape[0])  # one read document, many rows
            # and the state's dtypes: a decoder's buffers take them (autocast's, for a state made under it)
            key = (input_ids.shape[0], mode, like.device, like.dtype, state_dtypes(state))
            decoder = decoders.get(key)
            if decoder is None:
                decoder = decoders[key] = StaticDecoder(self.model, state, mode)
            else:
                holder = decoder.holder() if getattr(decoder, "holder", None) else None
                if holder is not None and holder.is_live():
                    _ = holder.state  # copied out before the buffers take another state
                decoder.load(state)
        return decoder.step(input_ids), decoder


def _check_cache_leaves_new_tokens(cache: TitansCache, key: str, args: tuple, kwargs: dict) -> None:
    """Refuse a `generate` call whose cache has consumed as many tokens as `input_ids` holds, or more.

    transformers takes `input_ids` to repeat the tokens the cache has seen (`get_seq_length()`) and feeds
    only the rest; with none left, transformers 5.24 feeds the whole prompt (`input_ids[:, -0:]`), which
    the memory would then read a second time, and with fewer tokens than it has seen, a slice of them or
    nothing. An attention mask longer than `input_ids` is transformers' other convention (only the new
    tokens as `input_ids`, the mask over the whole sequence): nothing is sliced then, so it is let through."""
    input_ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        return
    mask = kwargs.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape[1] > input_ids.shape[1]:
        return
    seen, length = cache.get_seq_length(), input_ids.shape[1]
    if length and seen >= length:  # (empty input_ids: the forward refuses them, saying why)
        raise ValueError(
            f"TitansForCausalLM.generate: the {key} has already consumed {seen} tokens (get_seq_length()) "
            f"and input_ids holds {length}: no token of input_ids is new to it (transformers slices "
            "input_ids by that count: it would feed the prompt again, to be read into the memory twice, or "
            "nothing). A cache returned by forward(x) has read all of x, its last token included (one "
            "returned by generate leaves the last token out). Pass the sequence the cache has read followed "
            "by at least one token it has not, or only the new tokens with "
            f"{key}=TitansCache(cache.state) (a fresh cache counts tokens from 0); to generate right after "
            "x, build the cache with forward(x[:, :-1]) and pass x"
        )


def register() -> None:
    """Register model_type "titans" with AutoConfig and AutoModelForCausalLM (idempotent)."""
    AutoConfig.register("titans", TitansHFConfig, exist_ok=True)
    AutoModelForCausalLM.register(TitansHFConfig, TitansForCausalLM, exist_ok=True)


__all__ = ["TitansCache", "TitansForCausalLM", "register"]
