"""`torchrun --nproc_per_node 2` (gloo on CPU) takes the same steps as one process on the whole batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from micro_train import micro_config
from tiny_lm import tiny_model
from titans.training.config import TrainConfig
from titans.training.distributed import DistInfo, wrap_model
from titans.training.model_io import load_model
from titans.training.trainer import Trainer

SRC = Path(__file__).resolve().parents[1] / "src"

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def config(run_dir: Path, cache_dir: Path, **overrides) -> TrainConfig:
    base = dict(batch_size=8, steps=3, warmup_steps=1, eval_windows=4)
    return micro_config(run_dir, cache_dir, **{**base, **overrides})


def train_losses(run_dir: Path) -> tuple[list[float], float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in rows if r["split"] == "train"]
    held_out = [r["loss"] for r in rows if r["split"] == "eval"][-1]
    return train, held_out


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The reference: one process, the whole global batch, no accumulation."""
    root = tmp_path_factory.mktemp("dist")
    cache = root / "cache"
    Trainer(config(root / "single", cache)).train()
    return root, cache


@pytest.mark.parametrize(
    "mode, overrides",
    [
        ("ddp", {"grad_accum": 2}),  # 2 ranks x 2 micro-batches of 2 rows (exercises DDP no_sync)
        ("fsdp", {"fsdp": True}),  # FSDP2 on CPU: only checks the code path
        # each block recomputed in the backward pass, under DDP's no_sync and under FSDP2's sharded blocks
        ("ddp-recompute", {"grad_accum": 2, "gradient_checkpointing": True}),
        ("fsdp-recompute", {"fsdp": True, "gradient_checkpointing": True}),
    ],
)
def test_torchrun_two_ranks_match_one_process(single_process, mode, overrides):
    root, cache = single_process
    run_dir = root / mode
    cfg_file = root / f"{mode}.json"
    config(run_dir, cache, **overrides).save(cfg_file)
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "titans", "train", "--config", str(cfg_file), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "world size 2" in proc.stdout
    assert proc.stdout.count("== mac") == 1  # only rank 0 reports

    ref_losses, ref_heldout = train_losses(root / "single")
    losses, heldout = train_losses(run_dir)
    assert len(losses) == 3
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert heldout == pytest.approx(ref_heldout, abs=1e-5)
    ref_model, _, _ = load_model(root / "single")
    model, _, _ = load_model(run_dir)  # rank 0 wrote full (unsharded) weights
    ref_state = ref_model.state_dict()
    # the ranks sum gradients in another order than one process does; with MAC writing its RMS-normalised
    # attention output (mac_norm_memory_input), that rounding reaches ~1.6e-5 in a weight after three steps
    for name, tensor in model.state_dict().items():
        assert (tensor - ref_state[name]).abs().max().item() <= 5e-5, name


def test_torchrun_carries_each_ranks_rows_like_one_process(tmp_path):
    """carry_state under torchrun: each rank carries the state of its own rows (two micro-batches each), and
    the checkpoint holds the whole batch's carried state in global row order, as one process writes it."""
    cache = tmp_path / "cache"
    single = Trainer(config(tmp_path / "single", cache, carry_state=True))
    single.train()
    cfg_file = tmp_path / "ddp.json"
    config(tmp_path / "ddp", cache, carry_state=True, grad_accum=2).save(cfg_file)
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "titans", "train", "--config", str(cfg_file), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses, _ = train_losses(tmp_path / "ddp")
    assert losses == pytest.approx(train_losses(tmp_path / "single")[0], abs=1e-5)
    from titans.models.state import state_from_bytes, state_tensors
    from titans.runtime.checkpoint import latest_checkpoint, load_checkpoint

    def carried(run):
        (saved,) = load_checkpoint(latest_checkpoint(run)).trainer_state["carried"]  # one group
        return state_tensors(state_from_bytes(saved))

    ref, got = carried(tmp_path / "single"), carried(tmp_path / "ddp")
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.allclose(ref[name], got[name], atol=1e-4), name


def test_more_ranks_than_gpus_is_a_clear_error(monkeypatch):
    """torchrun with more processes per node than GPUs: name the mismatch, not 'invalid device ordinal'."""
    import torch

    from titans.runtime.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto", local_rank=0) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"GPU 1 \(local rank 1\) but the machine has 1"):
        resolve_device("auto", local_rank=1)
    with pytest.raises(ValueError, match="GPU 3"):
        resolve_device("cuda:3")
    assert resolve_device("cpu", local_rank=5) == torch.device("cpu")


def test_ddp_trains_a_frozen_memory(tmp_path):
    """memory_write=False leaves the memory's gate projection unused: DDP (one gloo rank, in process) must
    not wait for its gradient (it raised on the second step without find_unused_parameters)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = wrap_model(tiny_model("mag", dtype=torch.float32, train=True, memory_write=False), DistInfo())
        tokens = torch.randint(0, 61, (2, 13))
        for _ in range(2):
            logits, _ = model(tokens)
            logits.logsumexp(-1).mean().backward()
        gates = [p for m in model.modules() if hasattr(m, "to_gates") for p in m.to_gates.parameters()]
        assert gates and all(p.grad is None for p in gates)
    finally:
        dist.destroy_process_group()
