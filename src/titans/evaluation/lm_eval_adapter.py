"""The lm-evaluation-harness adapter: a ``titans`` model type for ``lm_eval`` (EleutherAI, >= 0.4.13).

    titans lm-eval --model titans --model_args checkpoint=RUN --tasks TASKS [lm-eval options]
    python -m titans.lm_eval --model titans --model_args checkpoint=RUN,device=cpu --tasks TASKS ...

lm-eval finds models only in its own registry and, in 0.4.13, loads no plugins (no entry points for models),
so a plain ``lm_eval --model titans`` does not know the name. Importing this module registers it; the two
commands above import it and then run lm-eval's own command line with the arguments given (everything
lm-eval accepts: ``--include_path``, ``--output_path``, ``--limit``, ...). From Python, import this module
and call ``lm_eval.simple_evaluate(model="titans", model_args=...)``, or pass a ``TitansEvalLM`` instance.

``--model_args``: ``checkpoint`` (a checkpoint folder or a run folder, newest checkpoint; required), and
optionally ``device`` (auto, cpu, cuda, cuda:1; default: lm-eval's ``--device``, else auto), ``dtype``
(float32, float64, bfloat16; default float32), ``max_length`` (tokens of context the model sees; default:
no limit), ``piece_len`` (tokens per forward call). The tokenizer is the checkpoint's own.

An in-memory model (``TitansEvalLM(model=..., tokenizer=...)``) is used as it is, as lm-eval's HF model
uses a model instance: it keeps its own dtype and device unless ``dtype`` / ``device`` are given (then it
is cast / moved in place, as ``torch.nn.Module.to`` does), and it is set to eval mode (dropout off), which
it stays in afterwards.

How the requests run on the stateful model (``titans.models.streaming``):

- ``loglikelihood``: the context, all but its last token, is read with chunked prefill (the state carries
  it; no truncation), then the last context token and the continuation go through the model in one call
  whose logits score the continuation. Requests that share a context token for token share its prefill,
  and continuations of the same length are scored together in one batch (the state expanded to the batch).
- ``loglikelihood_rolling``: the whole text after the document separator, read through the state in pieces,
  every token scored once. With ``max_length`` it follows lm-eval's rolling windows instead (each window
  read afresh, every token predicted once with up to ``max_length`` tokens of context).
- ``generate_until``: greedy decoding (or sampling with ``do_sample``/``temperature``/``top_k``/``top_p``)
  from the prefilled context, one token per step, until a stop string (``until``), the tokenizer's eos or
  ``max_gen_toks``. ``top_k`` 0 is no top-k filter, as in transformers; out-of-range options and a
  ``repetition_penalty`` other than 1.0 (not implemented) are refused with a ValueError.

An empty context is the document separator the model was trained with (``titans.data.stream.separator_ids``:
the eos token, or byte 0 for bytes). ``max_length`` is the most tokens the model reads for one request, as
in lm-eval's HF model: ``loglikelihood`` keeps the last ``max_length + 1`` tokens of context + continuation
(the model reads all but the last, which is only predicted; at least one context token stays), generation
the last ``max_length - max_gen_toks`` of the context; without it nothing is cut. A continuation longer than
``max_length`` tokens, or ``max_gen_toks >= max_length``, is refused with a ValueError (lm-eval's HF model
refuses both too: the continuation is never cut, and generation needs a context token).
"""

from __future__ import annotations

import logging
import sys
from collections import defaultdict
from collections.abc import Sequence

import lm_eval.models  # noqa: F401  (lm-eval's own models: its registry loads them only while empty)
import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from torch import Tensor

from titans.data.stream import separator_ids
from titans.data.tokenizers import Tokenizer
from titans.models.lm import TitansLM
from titans.models.state import TitansState, expand_state
from titans.models.streaming import check_sampling, decode_step, default_piece_len, prefill, sample_next
from titans.runtime.device import resolve_device
from titans.training.model_io import load_model

log = logging.getLogger(__name__)

_LM_EVAL_DEFAULT_DEVICE = "cuda:0"  # what lm-eval passes when --device is not given
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
_DEFAULT_GEN_TOKENS = 256


def _int_arg(name: str, value, *, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"titans lm-eval model: {name} must be a positive integer, got {value!r}") from None
    if out < 1 or str(out) != str(value).strip():
        raise ValueError(f"titans lm-eval model: {name} must be a positive integer, got {value!r}")
    return out


@register_model("titans")
class TitansEvalLM(LM):
    """A TitansLM and its tokenizer as an lm-eval ``LM``.

    Give ``checkpoint`` (what ``--model_args checkpoint=RUN`` sets), or an in-memory ``model`` and
    ``tokenizer``. ``batch_size``: rows scored together (lm-eval's ``--batch_size``; ``auto`` means 8).
    ``device`` / ``dtype``: None (the default) is "auto" / float32 for a checkpoint, and the model's own
    device / dtype for an in-memory model, which is otherwise moved / cast in place (``Module.to``). The
    model is set to eval mode, and left in it.
    """

    def __init__(
        self,
        checkpoint: str | None = None,
        *,
        model: TitansLM | None = None,
        tokenizer: Tokenizer | None = None,
        device: str | None = None,
        dtype: str | None = None,
        max_length: int | str | None = None,
        piece_len: int | str | None = None,
        batch_size: int | str | None = 8,
        max_batch_size: int | str | None = None,
    ) -> None:
        super().__init__()
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"titans lm-eval model: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if checkpoint is not None:
            if model is not None or tokenizer is not None:
                raise ValueError("titans lm-eval model: give checkpoint=... or model and tokenizer, not both")
            self._torch_device = resolve_device(device or "auto")
            model, _, tokenizer = load_model(checkpoint, map_location=self._torch_device)
            dtype = dtype or "float32"
        elif model is None or tokenizer is None:
            raise ValueError(
                "titans lm-eval model: give --model_args checkpoint=RUN (a run or checkpoint folder)"
            )
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"titans lm-eval model: the tokenizer has {tokenizer.vocab_size} ids, the model "
                f"{model.config.vocab_size}"
            )
        if checkpoint is None:
            # an in-memory model as it is (lm-eval's HF model does the same with a model instance):
            # cast or moved only when asked
            self._torch_device = resolve_device(device) if device else next(model.parameters()).device
        self.model = model.to(device=self._torch_device, dtype=None if dtype is None else _DTYPES[dtype])
        self.model.eval()
        self.tokenizer = tokenizer
        self.checkpoint = None if checkpoint is None else str(checkpoint)
        self.max_length = _int_arg("max_length", max_length)
        self.piece_len = _int_arg("piece_len", piece_len)
        if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
            batch_size = max_batch_size or 8
        self.batch_size = _int_arg("batch_size", batch_size, allow_none=False)
        self.prefix = list(separator_ids(tokenizer))

    # ----------------------------------------------------------------------------------------------------
    # lm-eval's interface

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> TitansEvalLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> TitansEvalLM:
        """``--model_args`` win over lm-eval's own ``--batch_size`` / ``--device``. lm-eval fills in
        ``cuda:0`` when ``--device`` is not given; without CUDA that means the CPU."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        if extra.get("device") == _LM_EVAL_DEFAULT_DEVICE and not torch.cuda.is_available():
            log.info("lm-eval's default device %s: CUDA is not available, running on cpu", extra["device"])
            extra["device"] = "cpu"
        return cls(**arg_dict, **extra)

    @property
    def device(self) -> torch.device:
        return self._torch_device

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name", type(self.tokenizer).__name__)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*req.args) for req in requests]
        results = self.score_pairs(pairs)
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args
            tokens = self.tokenizer.encode(text)
            if not tokens:
                out.append(0.0)
                continue
            if self.max_length is None:
                pairs = [(self.prefix, tokens)]
            else:
                windows = get_rolling_token_windows(
                    token_list=tokens,
                    prefix_token=self.prefix[-1],
                    max_seq_len=self.max_length,
                    context_len=1,
                )
                pairs = [make_disjoint_window(w) for w in windows]
            total = sum(lp for lp, _ in self.score_pairs(pairs))
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            text = self._generate(context, dict(gen_kwargs or {}))
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    # ----------------------------------------------------------------------------------------------------
    # Scoring

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids). Trailing spaces of the context go to the continuation (lm-eval's
        convention), the continuation's ids are those of context + continuation past the context's, and an
        empty context is the document separator."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return list(self.prefix), self.tokenizer.encode(continuation)
        ctx = self.tokenizer.encode(context)
        whole = self.tokenizer.encode(context + continuation)
        if whole[: len(ctx)] != ctx:  # a merge across the boundary: encode the two parts apart
            return ctx, self.tokenizer.encode(continuation)
        return ctx, whole[len(ctx) :]

    @torch.no_grad()
    def score_pairs(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation) for each
        (context ids, continuation ids) pair; the context has at least one token.

        Pairs with the same context share one prefill of it; same-length continuations run as one batch.
        """
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        groups: dict[tuple[int, ...], dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        for i, (ctx, cont) in enumerate(pairs):
            if not ctx:
                raise ValueError("titans lm-eval model: a context needs at least one token")
            if not cont:
                results[i] = (0.0, True)
                continue
            if self.max_length is not None:  # as lm-eval's HF model: (ctx + cont)[-(max_length + 1):]
                # reads max_length tokens (the last is only predicted), so a rolling window is whole
                if len(cont) > self.max_length:  # lm-eval's HF model asserts the same
                    raise ValueError(
                        f"titans lm-eval model: a continuation of {len(cont)} tokens is longer than "
                        f"max_length={self.max_length} (the most tokens the model reads per request; the "
                        "continuation is never cut): raise max_length or leave it unset"
                    )
                ctx = ctx[-max(1, self.max_length + 1 - len(cont)) :]
            groups[tuple(ctx)][len(cont)].append(i)
        for ctx, by_length in groups.items():
            # the context but its last token lives in the state: the scored call starts at that token
            _, state = prefill(
                self.model, torch.tensor([ctx[:-1]], dtype=torch.long), piece_len=self._piece_len(1)
            )
            for rows in by_length.values():
                for start in range(0, len(rows), self.batch_size):
                    chunk = rows[start : start + self.batch_size]
                    conts = torch.tensor([pairs[i][1] for i in chunk], device=self.device)
                    inputs = torch.cat(
                        [torch.full((len(chunk), 1), ctx[-1], device=self.device), conts[:, :-1]], 1
                    )
                    logprob, greedy = self._score_tokens(inputs, conts, state)
                    for i, lp, g in zip(chunk, logprob.tolist(), greedy.tolist()):
                        results[i] = (lp, g)
        return results  # type: ignore[return-value]

    def _score_tokens(
        self, inputs: Tensor, targets: Tensor, state: TitansState | None
    ) -> tuple[Tensor, Tensor]:
        """inputs, targets (B, n) with targets[:, t] the token after inputs[:, t]; state of batch 1 (or
        None) before inputs. Returns (sum of log-probabilities (B,) float64, all greedy (B,) bool), in
        pieces through the state so that long continuations need bounded memory."""
        batch = inputs.shape[0]
        if state is not None:
            state = expand_state(state, batch)
        piece = self._piece_len(batch)
        total = torch.zeros(batch, dtype=torch.float64, device=inputs.device)
        greedy = torch.ones(batch, dtype=torch.bool, device=inputs.device)
        for start in range(0, inputs.shape[1], piece):
            logits, state = self.model(inputs[:, start : start + piece], state)
            logp = F.log_softmax(logits.double(), dim=-1)
            want = targets[:, start : start + piece]
            total += logp.gather(-1, want[..., None]).squeeze(-1).sum(-1)
            greedy &= (logits.argmax(-1) == want).all(-1)
        return total, greedy

    def _piece_len(self, batch: int) -> int:
        return self.piece_len or default_piece_len(self.model, batch)

    # ----------------------------------------------------------------------------------------------------
    # Generation

    def _generate(self, context: str, kwargs: dict) -> str:
        until = kwargs.pop("until", None)
        until = [until] if isinstance(until, str) else list(until or [])
        # absent or None (a task's generation_kwargs may say so): the default
        max_new = _int_arg("max_gen_toks", kwargs.pop("max_gen_toks", None)) or _DEFAULT_GEN_TOKENS
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
        top_k = kwargs.pop("top_k", None)
        if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k == 0:
            top_k = None  # transformers' top_k=0: no top-k filter
        top_p = kwargs.pop("top_p", None)
        penalty = kwargs.pop("repetition_penalty", None)
        if penalty is not None and penalty != 1.0:
            raise ValueError(
                "titans lm-eval model: repetition_penalty is not supported (only 1.0, no penalty), "
                f"got {penalty!r}"
            )
        if kwargs:
            raise ValueError(f"titans lm-eval model: unsupported generation options {sorted(kwargs)}")
        # the options' ranges, before the context is read (sample_next checks them again at each token)
        temperature, top_k, top_p = check_sampling(temperature, top_k, top_p, "titans lm-eval model")
        greedy = not do_sample or temperature == 0
        tokens = self.tokenizer.encode(context) if context else list(self.prefix)
        if self.max_length is not None:
            if max_new >= self.max_length:  # lm-eval's HF model asserts the same
                raise ValueError(
                    f"titans lm-eval model: max_gen_toks={max_new} leaves no room for the context within "
                    f"max_length={self.max_length} (the context is cut to max_length - max_gen_toks tokens)"
                )
            tokens = tokens[-(self.max_length - max_new) :]
        logits, state = prefill(self.model, torch.tensor([tokens]), piece_len=self._piece_len(1))
        eos = getattr(self.tokenizer, "eos_id", None)
        new: list[int] = []
        text = ""
        for step in range(max_new):
            token = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy)
            if eos is not None and int(token) == eos:
                break
            new.append(int(token))
            text = self.tokenizer.decode(new)
            if any(stop and stop in text for stop in until):
                break
            if step < max_new - 1:
                logits, state = decode_step(self.model, token[:, None].to(self.device), state)
        for stop in until:  # what is returned ends before the first stop string
            if stop:
                text = text.split(stop)[0]
        return text


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the ``titans`` model registered: ``titans lm-eval ARGS`` and
    ``python -m titans.lm_eval ARGS`` run ``lm_eval ARGS``."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # lm-eval's parser reads sys.argv
    try:
        cli_evaluate()
    except SystemExit as e:  # argparse's --help and errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


__all__ = ["TitansEvalLM", "main"]
