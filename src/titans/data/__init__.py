"""Training data: tokenizers, text sources, held-out splits, cached token streams and batch loaders.

Typical use::

    from titans.data import load_tokenizer, load_token_streams, TokenBatches, EvalWindows

    tok = load_tokenizer("bytes")
    streams = load_token_streams("builtin:stdlib", tok, heldout_fraction=0.01)
    train = TokenBatches(streams.train, batch_size=32, seq_len=512, seed=0, rank=0, world_size=1)
    inputs, targets = train.get_batch(step)          # (32, 512) int64 each
    evals = EvalWindows(streams.heldout, seq_len=512, num_windows=64)
    # mean NLL over evals -> evals.bits_per_byte(mean_nll)

Modules: ``tokenizers`` (Tokenizer protocol, load_tokenizer, train_bpe), ``documents`` (Document, the
TextSource interface), ``sources`` (load_source and the source specs), ``corpus`` (built-in prose:
prose_documents / prose_text), ``split`` (document-level held-out split), ``stream`` (tokenize + cache),
``loader`` (TokenBatches, EvalWindows, bits_per_byte).
"""

from titans.data.corpus import prose_documents, prose_text
from titans.data.loader import EvalWindows, TokenBatches, bits_per_byte
from titans.data.sources import Document, TextSource, load_source
from titans.data.split import DocumentSplit, split_documents
from titans.data.stream import TokenStream, TokenStreams, default_cache_dir, load_token_streams
from titans.data.tokenizers import ByteTokenizer, Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "ByteTokenizer",
    "Document",
    "DocumentSplit",
    "EvalWindows",
    "TextSource",
    "TokenBatches",
    "TokenStream",
    "TokenStreams",
    "Tokenizer",
    "bits_per_byte",
    "default_cache_dir",
    "load_source",
    "load_token_streams",
    "load_tokenizer",
    "prose_documents",
    "prose_text",
    "split_documents",
    "train_bpe",
]
