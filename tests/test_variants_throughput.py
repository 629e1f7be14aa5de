"""benchmarks/variants_throughput.py: a preset with --set overrides is the model that gets measured."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from titans import TitansConfig, TitansLM

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "variants_throughput.py"
sys.path.insert(0, str(SCRIPT.parent))  # the harness the script imports, as when it runs
spec = importlib.util.spec_from_file_location("variants_throughput", SCRIPT)
variants_throughput = importlib.util.module_from_spec(spec)
spec.loader.exec_module(variants_throughput)


def _args(**overrides) -> argparse.Namespace:
    args = dict(threads=1, batch=1, steps=1, preset=None, set=[], recompute="off", dim=32, depth=1, heads=2)
    args.update(window=16, chunk_size=8, **overrides)
    return argparse.Namespace(**args)


def test_preset_and_set_choose_the_measured_model():
    row = variants_throughput.measure("mal", 48, _args(preset="tiny", set=["memory_conv_kernel=8"]))
    want = TitansLM(TitansConfig.preset("tiny", variant="mal", vocab_size=256, memory_conv_kernel=8))
    plain = TitansLM(TitansConfig.preset("tiny", variant="mal", vocab_size=256))
    assert row["params"] == want.num_parameters() != plain.num_parameters()
    assert row["seq"] == 48 and row["tokens_per_s"] > 0


def test_shape_flags_without_a_preset():
    row = variants_throughput.measure("lmm", 40, _args(set=["memory_conv_kernel=2"]))
    cfg = TitansConfig(
        variant="lmm",
        vocab_size=256,
        dim=32,
        depth=1,
        heads=2,
        segment_len=16,
        window=16,
        chunk_size=8,
        persistent_tokens=4,
        memory_conv_kernel=2,
    )
    assert row["params"] == TitansLM(cfg).num_parameters()


def test_an_unknown_field_is_refused_by_name():
    with pytest.raises(ValueError, match="--set bogus: no such TitansConfig field"):
        variants_throughput.measure("lmm", 32, _args(set=["bogus=1"]))
