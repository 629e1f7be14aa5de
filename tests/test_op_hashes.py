"""The memory op computes bit for bit what it computed when `tests/data/op_hashes.json` was saved: initial
weights, outputs, gradients and states of every variant x memory rule, and of the memory layer on each of
its paths (`tests/op_hashes.py` says what is hashed and how).

Float results depend on the machine (its vector instructions, the torch build), so the comparison runs
where the saved file's platform matches this one; elsewhere, regenerate the file on the old code first
(`python tests/op_hashes.py --write tests/data/op_hashes.json`), then compare on the new.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SAVED = HERE / "data" / "op_hashes.json"


def test_op_hashes_unchanged():
    saved = json.loads(SAVED.read_text())
    env = {**os.environ, "TITANS_CPU_KERNELS": "0", "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(HERE / "op_hashes.py")], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    now = json.loads(run.stdout)
    if now["platform"] != saved["platform"]:
        pytest.skip(f"hashes saved on {saved['platform']}, this is {now['platform']}")
    missing = sorted(set(saved["cases"]) - set(now["cases"]))
    # the Triton case needs triton installed; every other case is always computed
    assert not [m for m in missing if "/triton/" not in m], f"cases no longer computed: {missing}"
    changed = [
        f"  {case}: {part}"
        for case, parts in sorted(now["cases"].items())
        if case in saved["cases"]
        for part, value in sorted(parts.items())
        if saved["cases"][case].get(part) != value
    ]
    assert not changed, "hashes changed:\n" + "\n".join(changed)
