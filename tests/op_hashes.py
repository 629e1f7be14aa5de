"""Bit-exact fingerprints of the memory op through every way the library reaches it.

    python tests/op_hashes.py [--write tests/data/op_hashes.json]

For every model variant x memory rule preset (and the memory options that change the op's path), at a
tiny size with a fixed seed: sha256 of the initial weights, of the logits and of every parameter's
gradient after one forward + backward on a fixed batch, and of the returned state. For the memory layer
alone (`NeuralMemory`): the chunked path, the float64 reference (`impl="reference"`) and, where triton is
installed, the Triton path under its CPU interpreter, each over two calls (the second continues the
first's state, so pending tokens and a windowed rule's history rows are read).

A refactor that must not change behaviour keeps every hash. The hashes hold for one machine's float
arithmetic: run on one thread, the fused CPU kernels off (`TITANS_CPU_KERNELS=0`), denormals flushed
(as the `titans` commands and the tests do). `tests/test_op_hashes.py` runs this in a subprocess and
compares with the saved file where the platform matches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys

# before torch (and triton) are imported: the fused kernels' build off, Triton's interpreter on
os.environ["TITANS_CPU_KERNELS"] = "0"
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from titans import NeuralMemory, TitansConfig, TitansLM  # noqa: E402
from titans.models import MEMORY_VARIANTS, VARIANTS  # noqa: E402

RULES = ("titans", "moneta", "yaad", "memora", "atlas")
# options that take another branch of the op (the "titans" rule only, for the last two)
MODEL_OPTIONS = {
    "threshold": dict(memory_surprise_threshold=1.0),
    "checkpoint": dict(memory_checkpoint_every=2),
    "max_norm": dict(memory_max_norm=0.5),
    "forget_init": dict(memory_forget_to="init"),
}
# a threshold inside each rule's range of surprises at this size, so that some tokens are not written
THRESHOLDS = {"titans": 1.4, "moneta": 0.25, "yaad": 1.4, "memora": 0.25, "atlas": 3.0}
LAYER_OPTIONS = {
    "plain": {},
    "threshold": {},
    "max_norm": dict(max_norm=0.5),
    "forget_init": dict(forget_to="init"),
}


def digest(tensors) -> str:
    """sha256 over the tensors' dtypes, shapes and bytes, in order (None counts as a marker)."""
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def platform_key() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    return {"torch": torch.__version__.split("+")[0], "cpu": cpu, "machine": platform.machine()}


def _model_case(variant: str, **overrides) -> dict:
    cfg = dict(
        variant=variant,
        vocab_size=53,
        dim=32,
        depth=2,
        heads=2,
        segment_len=8,
        window=6,
        chunk_size=4,
        persistent_tokens=2,
        memory_backend="torch",
    )
    torch.manual_seed(0)
    model = TitansLM(TitansConfig(**{**cfg, **overrides})).train()
    params = dict(model.named_parameters())
    init = digest(params[n] for n in sorted(params))
    tokens = torch.randint(0, 53, (2, 19), generator=torch.Generator().manual_seed(1))
    logits, state = model(tokens)
    logits.float().square().mean().backward()
    grads = digest(params[n].grad for n in sorted(params))
    leaves = [t for t in _tensors(state)]
    return {"init": init, "output": digest([logits]), "grads": grads, "state": digest(leaves)}


def _tensors(obj):
    """The tensors of a nested state (dataclasses, tuples, lists, dicts), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k])
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name))


def _layer_case(rule: str, impl: str, backend: str = "torch", **options) -> dict:
    dtype = torch.float64 if impl == "reference" else torch.float32
    torch.manual_seed(0)
    mem = NeuralMemory(16, heads=2, depth=2, chunk_size=4, rule=rule, impl=impl, backend=backend, **options)
    mem = mem.to(dtype)
    params = dict(mem.named_parameters())
    init = digest(params[n] for n in sorted(params))
    g = torch.Generator().manual_seed(1)
    x1 = torch.randn(2, 7, 16, generator=g, dtype=dtype)
    x2 = torch.randn(2, 6, 16, generator=g, dtype=dtype)
    out1 = mem.forward_with_stats(x1)
    out2 = mem.forward_with_stats(x2, out1.state)
    loss = out1.output.square().mean() + out2.output.square().mean()
    loss.backward()
    grads = digest(params[n].grad for n in sorted(params))
    outputs = [out1.output, out2.output, out1.stats.surprise, out2.stats.surprise, out2.stats.written]
    return {
        "init": init,
        "output": digest(outputs),
        "grads": grads,
        "state": digest(list(_tensors(out2.state))),
    }


def compute(with_triton: bool | None = None) -> dict:
    """Every case's hashes: {"platform": ..., "cases": {name: {"init", "output", "grads", "state"}}}."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    cases: dict[str, dict] = {}
    for variant in VARIANTS:
        rules = RULES if variant in MEMORY_VARIANTS else ("-",)
        for rule in rules:
            extra = {} if rule == "-" else {"memory_rule": rule}
            cases[f"model/{variant}/{rule}"] = _model_case(variant, **extra)
    for variant in ("mac", "lmm"):
        for name, options in MODEL_OPTIONS.items():
            cases[f"model/{variant}/titans/{name}"] = _model_case(variant, **options)
    for rule in RULES:
        for impl in ("chunked", "reference"):
            for name, options in LAYER_OPTIONS.items():
                if name in ("max_norm", "forget_init") and rule != "titans":
                    continue
                if name == "threshold":
                    options = dict(surprise_threshold=THRESHOLDS[rule])
                cases[f"layer/{rule}/{impl}/{name}"] = _layer_case(rule, impl, **options)
    if with_triton is None:
        import importlib.util

        with_triton = importlib.util.find_spec("triton") is not None
    if with_triton:
        cases["layer/titans/triton/plain"] = _layer_case("titans", "chunked", backend="triton")
    return {"platform": platform_key(), "cases": cases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", help="save the hashes (JSON) to this file")
    args = parser.parse_args(argv)
    result = compute()
    text = json.dumps(result, indent=1, sort_keys=True) + "\n"
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
