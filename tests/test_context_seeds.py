"""benchmarks/context_seeds.py: `titans eval context` results summarised over seeds, matched by role."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "context_seeds.py"
sys.path.insert(0, str(SCRIPT.parent))  # the harness the script imports, as when it runs
spec = importlib.util.spec_from_file_location("context_seeds", SCRIPT)
context_seeds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(context_seeds)

LABELS = ["0-256", "256-1K", "1K-2K"]


def _result(writing, frozen, baseline, run):
    def curve(variant, losses, is_frozen=False):
        return {"variant": variant, "frozen": is_frozen, "bucket_loss": losses}

    return {
        "bucket_labels": LABELS,
        "models": {  # labels differ between seeds: roles come from the order and the frozen flag
            f"mac ({run})": curve("mac", writing),
            "mac frozen twin": curve("mac", frozen, True),
            f"swa (runs/swa_{run})": curve("swa", baseline),
        },
    }


def test_means_ranges_and_worst_margins(tmp_path):
    files = []
    for seed, (w, f, b) in enumerate(
        [
            ([1.0, 1.1, 1.2], [1.1, 1.1, 1.3], [1.05, 1.2, 1.25]),
            ([1.2, 1.3, 1.0], [1.1, 1.4, 1.5], [1.3, 1.2, 1.1]),
        ]
    ):
        path = tmp_path / f"s{seed}.json"
        path.write_text(json.dumps(_result(w, f, b, f"s{seed}")))
        files.append(str(path))
    summary = context_seeds.summarise([json.loads(Path(p).read_text()) for p in files])
    assert summary["roles"]["writing"]["mean"] == pytest.approx([1.1, 1.2, 1.1])
    assert summary["roles"]["frozen"]["min"] == pytest.approx([1.1, 1.1, 1.3])
    assert summary["roles"]["baseline"]["variant"] == "swa"
    # the worst seed's margin per bucket: a bucket where one seed is above its twin shows it
    assert summary["margins"]["writing - frozen"]["max"] == pytest.approx([0.1, 0.0, -0.1])
    assert summary["margins"]["writing - baseline"]["max"] == pytest.approx([-0.05, 0.1, -0.05])
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *files, "--out", str(out)], capture_output=True, text=True, check=True
    )
    assert "1.100 [1.000-1.200]" in proc.stdout and json.loads(out.read_text())["files"] == 2


def test_files_with_other_buckets_are_refused():
    a = _result([1.0] * 3, [1.0] * 3, [1.0] * 3, "a")
    b = {**_result([1.0] * 3, [1.0] * 3, [1.0] * 3, "b"), "bucket_labels": ["0-256", "256-1K", "1K-4K"]}
    with pytest.raises(ValueError, match="different position buckets"):
        context_seeds.summarise([a, b])


def test_baseline_from_other_files_on_the_same_windows():
    """A baseline read beside another model replaces the files' own, seed by seed; other windows refused."""
    own = [
        {**_result([1.0, 1.1, 1.2], [1.1] * 3, [9.0] * 3, f"s{s}"), "window_origins": [0, 7]} for s in (0, 1)
    ]
    other = [
        {**_result([5.0] * 3, [5.0] * 3, [1.1, 1.0, 1.3 + s], f"o{s}"), "window_origins": [0, 7]}
        for s in (0, 1)
    ]
    summary = context_seeds.summarise(own, other)
    assert summary["roles"]["baseline"]["mean"] == pytest.approx([1.1, 1.0, 1.8])
    per_seed = summary["margins"]["writing - baseline"]["per_seed"]
    assert per_seed[0] == pytest.approx([-0.1, 0.1, -0.1]) and per_seed[1] == pytest.approx([-0.1, 0.1, -1.1])
    with pytest.raises(ValueError, match="other windows"):
        context_seeds.summarise(own, [other[0], {**other[1], "window_origins": [0, 8]}])
    with pytest.raises(ValueError, match="one per file"):
        context_seeds.summarise(own, other[:1])
