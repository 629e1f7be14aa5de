"""`torchrun --nproc_per_node 2` (gloo on CPU) takes the same steps as one process on the whole batch, and a
run resumes with FSDP switched on or off (the optimizer state converted between its two saved forms)."""

from __future__ import annotations

import json
import os
import shutil
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


def torchrun_env(tmp: Path) -> dict[str, str]:
    """The environment of a torchrun launch: this checkout's sources, and its temporary files (torchelastic
    makes a folder per launch, left behind) in the test's own folder."""
    return {
        **os.environ,
        "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "TMPDIR": str(tmp),
    }


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
    env = torchrun_env(root)
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
    env = torchrun_env(tmp_path)
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


# ----------------------------------------------------------------------------- resuming across fsdp on/off
# The trainer keeps the optimizer state keyed by parameter name under FSDP and by position without it; a
# resume that switches fsdp converts it. The two modes take the same steps to float rounding (the ranks'
# and one process's gradient sums round differently), so a switched resume matches the uninterrupted run to
# that tolerance, and the converted optimizer state equals the saved one exactly.

RESUME = dict(steps=4, ckpt_every=2, keep_last=3)  # checkpoints at steps 2 and 4; resumed from step 2

# Run under torchrun by the single -> FSDP case: resume (with FSDP), check that the sharded optimizer state
# gathered back equals the checkpoint's (saved by position) tensor for tensor, then train on.
FSDP_RESUME_SCRIPT = """
import sys
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from titans.runtime.checkpoint import load_checkpoint
from titans.training import distributed as D
from titans.training.config import TrainConfig
from titans.training.trainer import Trainer

trainer = Trainer(TrainConfig.from_file(sys.argv[1]), resume=True)
saved = load_checkpoint(trainer.last_checkpoint).trainer_state["optimizer"]
assert D.optimizer_state_form(saved) == "position"
want = D.optimizer_state_by_name(saved, D.optimizer_param_names(trainer.model, trainer.optimizer))
opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
got = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=opts)  # on rank 0
if trainer.info.is_main:
    assert got["state"].keys() == want["state"].keys()
    for name, moments in want["state"].items():
        for key, value in moments.items():
            assert torch.equal(got["state"][name][key], value), (name, key)
    print("optimizer state loaded exactly")
trainer.train(handle_signals=False)
del trainer
D.shutdown()
"""


def torchrun(cfg_file: Path, *args: str) -> subprocess.CompletedProcess:
    env = torchrun_env(cfg_file.parent)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(cmd + [*args, str(cfg_file)], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Four steps without FSDP (one process) and with FSDP (two ranks), checkpointed at steps 2 and 4."""
    root = tmp_path_factory.mktemp("fsdp_resume")
    cache = root / "cache"
    Trainer(config(root / "single", cache, **RESUME)).train(handle_signals=False)
    config(root / "fsdp", cache, fsdp=True, **RESUME).save(root / "fsdp.json")
    torchrun(root / "fsdp.json", "-m", "titans", "train", "--no-progress", "--config")
    return root, cache


def stopped_at_2(root: Path, source: str, name: str) -> Path:
    """A copy of run ``source`` as if stopped after step 2 (its step-4 checkpoint removed)."""
    run_dir = root / name
    shutil.copytree(root / source, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    return run_dir


@pytest.mark.parametrize("case", ["fsdp->single", "fsdp->ddp", "single->fsdp"])
def test_resume_switches_fsdp(uninterrupted, case):
    """A run checkpointed with FSDP resumes without it (one process; two DDP ranks) and the reverse, to the
    losses and weights of the uninterrupted runs (before the conversion, fsdp could not change on resume)."""
    from titans.runtime.checkpoint import latest_checkpoint, load_checkpoint
    from titans.training import distributed as D

    root, cache = uninterrupted
    source, target = case.split("->")
    run_dir = stopped_at_2(root, source, case.replace("->", "_to_"))
    cfg = config(run_dir, cache, fsdp=target == "fsdp", **RESUME)
    saved = load_checkpoint(latest_checkpoint(run_dir)).trainer_state["optimizer"]  # at step 2
    if target == "single":
        trainer = Trainer(cfg, resume=True)
        assert trainer.step == 2
        # the optimizer holds exactly the saved moments, each at its parameter
        names = D.optimizer_param_names(trainer.model, trainer.optimizer)
        want = D.optimizer_state_by_position(saved, names)["state"]
        got = trainer.optimizer.state_dict()["state"]
        assert got.keys() == want.keys()
        assert all(torch.equal(got[i][k], v) for i in want for k, v in want[i].items())
        trainer.train(handle_signals=False)
    elif target == "ddp":
        cfg.save(root / f"{case}.json")
        proc = torchrun(
            root / f"{case}.json", "-m", "titans", "train", "--no-progress", "--resume", "--config"
        )
        assert "resumed" in proc.stdout and "world size 2" in proc.stdout
    else:
        cfg.save(root / f"{case}.json")
        script = root / "fsdp_resume.py"
        script.write_text(FSDP_RESUME_SCRIPT)
        proc = torchrun(root / f"{case}.json", str(script))
        assert "optimizer state loaded exactly" in proc.stdout
    assert D.optimizer_state_form(saved) == ("name" if source == "fsdp" else "position")

    losses, heldout = train_losses(run_dir)
    for reference in ("single", "fsdp"):  # the two uninterrupted runs agree to rounding; so does the resume
        ref_losses, ref_heldout = train_losses(root / reference)
        assert len(losses) == 4
        assert losses == pytest.approx(ref_losses, abs=1e-5), reference
        assert heldout == pytest.approx(ref_heldout, abs=1e-5), reference
        ref_state = load_model(root / reference)[0].state_dict()
        for name, tensor in load_model(run_dir)[0].state_dict().items():
            assert (tensor - ref_state[name]).abs().max().item() <= 5e-5, (reference, name)


def test_optimizer_state_forms_convert_both_ways():
    """By position (``optimizer.state_dict()``) <-> by name (FSDP's full state dict), losslessly; a state
    for other parameters is refused."""
    from titans.training import distributed as D
    from titans.training.optim import build_optimizer

    model = tiny_model("mac", dtype=torch.float32, train=True)
    optimizer = build_optimizer(model, TrainConfig())
    model(torch.randint(0, 61, (2, 13)))[0].logsumexp(-1).mean().backward()
    optimizer.step()
    names = D.optimizer_param_names(model, optimizer)
    # every parameter once, each group in the order of the model's named_parameters (which FSDP2 keeps)
    order = [n for n, _ in model.named_parameters()]
    assert sorted(n for g in names for n in g) == sorted(order)
    assert all(group == [n for n in order if n in group] for group in names)
    by_position = optimizer.state_dict()
    by_name = D.optimizer_state_by_name(by_position, names)
    assert D.optimizer_state_form(by_position) == "position" and D.optimizer_state_form(by_name) == "name"
    assert {n for g in by_name["param_groups"] for n in g["params"]} == set(by_name["state"])
    back = D.optimizer_state_by_position(by_name, names)
    assert back["param_groups"] == by_position["param_groups"]
    assert back["state"].keys() == by_position["state"].keys()
    assert all(back["state"][i][k] is v for i, s in by_position["state"].items() for k, v in s.items())
    # a group listed in another order maps by name, not by place
    shuffled = {
        **by_name,
        "param_groups": [{**g, "params": g["params"][::-1]} for g in by_name["param_groups"]],
    }
    assert D.optimizer_state_by_position(shuffled, names)["state"].keys() == back["state"].keys()
    other = {
        **by_name,
        "param_groups": [
            by_name["param_groups"][0],
            {**by_name["param_groups"][1], "params": ["x", *by_name["param_groups"][1]["params"][1:]]},
        ],
    }
    with pytest.raises(ValueError, match="other parameters"):
        D.optimizer_state_by_position(other, names)
    with pytest.raises(ValueError, match="groups of"):
        D.optimizer_state_by_name({**by_position, "param_groups": by_position["param_groups"][:1]}, names)


def test_fsdp_may_change_on_resume():
    assert TrainConfig(fsdp=True).resume_mismatches(TrainConfig().to_dict()) == []
    assert TrainConfig().resume_mismatches(TrainConfig(fsdp=True).to_dict()) == []


FULL_DISK_SCRIPT = """
import errno, sys
import titans.runtime.checkpoint as C

def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

C.save_safetensors = full  # the main rank's checkpoint write fails as on a full disk
from titans.cli import main

raise SystemExit(main(["train", "--no-progress", "--config", sys.argv[1]]))
"""


def test_a_checkpoint_that_rank_0_cannot_write_stops_every_rank_with_the_error(tmp_path):
    """Under torchrun, rank 0's checkpoint write fails (a full disk): every rank stops with a one-line
    error (rank 0's names the disk and --resume), none waits in a barrier for it and dies of the lost
    connection with a traceback."""
    config(tmp_path / "run", tmp_path / "cache", steps=3, ckpt_every=2).save(tmp_path / "full.json")
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK_SCRIPT)
    env = torchrun_env(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        cmd + [str(script), str(tmp_path / "full.json")], capture_output=True, text=True, env=env, timeout=240
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "titans train: error:" in line]
    assert len(errors) == 2, proc.stderr[-4000:]
    assert any("free some space" in e and "--resume" in e for e in errors), errors
    assert any("rank 1: the main rank could not write the checkpoint of step 2" in e for e in errors), errors
    assert "gloo" not in proc.stderr.lower() and "Connection closed" not in proc.stderr, proc.stderr[-4000:]
