"""`titans train` under faults: SIGTERM / SIGINT to a real process, damaged checkpoints from an earlier run,
a diverging run, a full disk, a data file too short to split."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from micro_train import micro_config
from tiny_lm import tiny_config
from titans.models.lm import TitansLM
from titans.models.state import load_state, map_state
from titans.runtime import checkpoint as ckpt
from titans.runtime.checkpoint import (
    CheckpointWriteError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from titans.training import signals as sig
from titans.training.model_io import load_model
from titans.training.trainer import Trainer

SRC = Path(__file__).resolve().parents[1] / "src"
ENV = {
    **os.environ,
    "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    "OMP_NUM_THREADS": "1",
}
TITANS = [sys.executable, "-m", "titans"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    from titans.ops.cpu_kernels import kernels

    kernels()  # build the fused CPU kernels here, once, not inside a run the test waits for
    return tmp_path_factory.mktemp("token-cache")


def long_config(run_dir: Path, cache_dir: Path, **overrides):
    """A run far longer than any test waits for, at a constant lr: a resume may then shorten it
    (`--steps`) and still take the very steps an uninterrupted run of that length takes."""
    base = dict(batch_size=4, steps=5000, warmup_steps=0, min_lr_ratio=1.0, eval_every=10**6)
    base.update(eval_windows=2, ckpt_every=10**6)
    return micro_config(run_dir, cache_dir, **{**base, **overrides})


def start(cmd: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENV, **kw
    )


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int, timeout: float = 180) -> None:
    """Until metrics.jsonl logs `steps` training steps (the run is in its loop)."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended early ({proc.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
        if metrics.is_file() and metrics.read_text().count('"train"') >= steps:
            return
        time.sleep(0.05)
    proc.kill()
    out, err = proc.communicate()
    pytest.fail(f"the run made no progress in {timeout} s:\n{out[-2000:]}\n{err[-3000:]}")


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ------------------------------------------------------------------------------------------- signals
def test_sigterm_stops_after_the_step_with_a_checkpoint_and_resume_is_exact(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    cfg_file = tmp_path / "run.json"
    long_config(run_dir, cache_dir).save(cfg_file)
    cmd = [*TITANS, "train", "--config", str(cfg_file), "--no-progress"]
    proc = start(cmd)
    wait_for_steps(proc, run_dir, 2)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc)

    assert code == 143, err[-3000:]
    assert "Traceback" not in err
    report = json.loads((run_dir / "report.json").read_text())
    k = report["step"]
    assert 2 <= k < 5000 and report["stopped_by"] == "SIGTERM" and report["eval"]["bpb"] > 0
    assert report["checkpoint"] == str(run_dir / "checkpoints" / f"step_{k:08d}")
    assert latest_checkpoint(run_dir).name == f"step_{k:08d}"
    assert err.strip().splitlines()[-1] == (
        f"titans: stopped by SIGTERM at step {k}; checkpoint saved to {report['checkpoint']}; "
        "run the same command with --resume to continue"
    )
    assert "(stopped by SIGTERM)" in out

    # --resume to k + 2 steps gives the weights of an uninterrupted run of k + 2 steps, bit for bit
    resumed = subprocess.run(
        [*cmd, "--resume", "--steps", str(k + 2)], capture_output=True, text=True, env=ENV, timeout=180
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed {run_dir} at step {k}" in resumed.stdout
    reference = Trainer(long_config(tmp_path / "straight", cache_dir, steps=k + 2))
    reference.train()
    model, _, _ = load_model(run_dir)
    assert weights_equal(model, reference.model)


def test_sigint_stops_cleanly_and_a_second_one_stops_at_once(tmp_path, cache_dir):
    # a final evaluation of thousands of windows: the process is still in it when the second SIGINT comes
    run_dir = tmp_path / "run"
    cfg = long_config(run_dir, cache_dir, eval_windows=9000, eval_batch_size=64)
    cfg_file = tmp_path / "run.json"
    cfg.save(cfg_file)
    proc = start([*TITANS, "train", "--config", str(cfg_file), "--no-progress"])
    wait_for_steps(proc, run_dir, 2)
    proc.send_signal(signal.SIGINT)
    # the checkpoint is written first, before the (long) final evaluation
    while not list_checkpoints(run_dir):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    # the repeat window runs from when the handler ran, which is before the checkpoint, however late
    # the process got to it: timed from here, the second SIGINT is outside the window
    first = time.monotonic()
    time.sleep(max(0.0, first + sig.REPEAT_WINDOW_S + 0.3 - time.monotonic()))
    assert proc.poll() is None, "the final evaluation ended before the second signal"
    proc.send_signal(signal.SIGINT)
    second = time.monotonic()
    code, _, err = finish(proc)

    assert code == 130, err[-3000:]
    assert time.monotonic() - second < 15
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "titans: got SIGINT" in err and "titans: second SIGINT: stopping at once" in err
    assert "--resume" in err.strip().splitlines()[-1]
    assert not (run_dir / "report.json").exists()  # stopped in the evaluation, before the report
    (path,) = list_checkpoints(run_dir)
    verify_checkpoint(path)
    k = int(path.name.split("_")[1])
    assert k >= 2
    assert Trainer(cfg, resume=True).step == k


def test_a_repeated_signal_within_the_window_is_the_same_request(monkeypatch):
    """SLURM signals every process of a job step and torchrun forwards the signal again: a repeat within
    REPEAT_WINDOW_S must not turn the clean stop into an abrupt one; a later one stops at once."""
    now = [100.0]
    monkeypatch.setattr(sig.time, "monotonic", lambda: now[0])
    before = signal.getsignal(signal.SIGINT)
    with sig.StopSignals(announce=False) as stop:
        assert stop.signum is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        now[0] += sig.REPEAT_WINDOW_S / 2
        os.kill(os.getpid(), signal.SIGINT)  # ignored: the same request
        assert stop.signum == signal.SIGTERM
        now[0] += sig.REPEAT_WINDOW_S
        with pytest.raises(KeyboardInterrupt):  # SIGINT's own behaviour, as before StopSignals
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is before  # handlers are back
    assert signal.getsignal(signal.SIGINT) is before
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell starts a background job
    try:
        with sig.StopSignals(announce=False):
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    assert sig.exit_status(signal.SIGTERM) == 143 and sig.exit_status(signal.SIGINT) == 130


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_torchrun_ranks_stop_at_the_same_step_on_sigterm(tmp_path, cache_dir):
    """SIGTERM to the launcher: torchrun forwards it to each rank in turn; the ranks agree on the step
    (one all_reduce per step), so rank 0 writes one checkpoint and no rank waits for another."""
    run_dir = tmp_path / "run"
    cfg = long_config(run_dir, cache_dir, batch_size=8)
    cfg_file = tmp_path / "run.json"
    cfg.save(cfg_file)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    # torchelastic's folder per launch in the test's own
    proc = start(
        [*cmd, "-m", "titans", "train", "--config", str(cfg_file), "--no-progress"],
        {**ENV, "TMPDIR": str(tmp_path)},
    )
    wait_for_steps(proc, run_dir, 2, timeout=240)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, timeout=120)

    assert code != 0  # torchrun reports its own signal
    assert "world size 2" in out
    report = json.loads((run_dir / "report.json").read_text())
    k = report["step"]
    assert report["stopped_by"] == "SIGTERM" and k >= 2
    assert err.count(f"titans: stopped by SIGTERM at step {k};") == 1  # rank 0 only
    assert [p.name for p in list_checkpoints(run_dir)] == [f"step_{k:08d}"]
    verify_checkpoint(list_checkpoints(run_dir)[0])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == list(range(1, k + 1))
    assert Trainer(cfg, resume=True).step == k


# ------------------------------------------------------------------------------------------- damaged
def _damaged_run(run_dir: Path) -> None:
    """Checkpoints 10, 20 and 30 of an earlier run, each damaged in its own way."""
    for step in (10, 20, 30):
        save_checkpoint(run_dir, step, model_state={"w": torch.ones(64)}, trainer_state={}, config={})
    root = run_dir / "checkpoints"
    weights = root / "step_00000010" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-9])  # truncated
    trainer = root / "step_00000020" / "trainer.pt"
    data = bytearray(trainer.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped bit
    trainer.write_bytes(bytes(data))
    (root / "step_00000030" / "meta.json").unlink()  # incomplete


def test_damaged_newer_checkpoints_never_push_out_new_ones(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    _damaged_run(run_dir)
    cfg = micro_config(run_dir, cache_dir, batch_size=4, steps=8, warmup_steps=2, eval_windows=2)
    cfg_file = tmp_path / "run.json"
    cfg.save(cfg_file)
    cmd = [*TITANS, "train", "--config", str(cfg_file), "--no-progress", "--resume", "--set", "ckpt_every=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "are damaged (step_00000010, step_00000020, step_00000030); starting from scratch" in proc.stdout

    report = json.loads((run_dir / "report.json").read_text())
    assert report["checkpoint"] == str(run_dir / "checkpoints" / "step_00000008")
    names = [p.name for p in list_checkpoints(run_dir)]
    # keep_last=3 good ones; the damaged ones neither count nor go
    assert names == [f"step_{s:08d}" for s in (4, 6, 8, 10, 20, 30)]
    assert latest_checkpoint(run_dir).name == "step_00000008"
    assert Trainer(cfg, resume=True).step == 8  # the next --resume


def test_prune_keeps_the_new_checkpoint_and_good_ones_over_damaged(tmp_path):
    state = {"w": torch.arange(5.0)}

    def save(step: int) -> Path:
        return save_checkpoint(tmp_path, step, model_state=state, trainer_state={}, config={}, keep_last=2)

    save(2), save(4)
    bad = tmp_path / "checkpoints" / "step_00000004" / "model.safetensors"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0x01
    bad.write_bytes(bytes(data))  # same size, other bytes: only the hash shows it
    save(6)
    # step 4 is damaged: it does not count, so step 2 (good) stays; the damaged one goes
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000006"]
    save_checkpoint(tmp_path, 9, model_state=state, trainer_state={}, config={})
    (tmp_path / "checkpoints" / "step_00000009" / "meta.json").write_text("{")  # damaged, newer
    save(7)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000006", "step_00000007", "step_00000009"]
    assert latest_checkpoint(tmp_path).name == "step_00000007"


# ------------------------------------------------------------------------------------------- NaN
def test_a_diverging_run_never_calls_nan_weights_good(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    cfg = micro_config(run_dir, cache_dir, batch_size=4, steps=30, warmup_steps=10, eval_windows=2)
    cfg_file = tmp_path / "run.json"
    cfg.save(cfg_file)
    # lr 500 without clipping: a few good steps (checkpointed), then NaN
    cmd = [*TITANS, "train", "--config", str(cfg_file), "--no-progress", "--lr", "500"]
    cmd += ["--set", "grad_clip=null", "--set", "ckpt_every=1", "--set", "log_every=10"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=180)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    # found by the checkpoint's check of the weights, or by the loss its steps log first
    assert line.startswith(
        (
            "titans train: error: the weights or the optimizer state became NaN or inf",
            "titans train: error: training loss became nan",
        )
    ), line
    checkpoints = list_checkpoints(run_dir)
    assert checkpoints, "this run was meant to write a good checkpoint before diverging"
    assert f"the last good checkpoint is {checkpoints[-1]}" in line
    for path in checkpoints:
        saved = load_checkpoint(path)
        assert all(torch.isfinite(t).all() for t in saved.model_state.values()), path.name
        for state in saved.trainer_state["optimizer"]["state"].values():
            assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()), path.name


def test_a_nonfinite_memory_state_is_not_saved(tmp_path):
    model = TitansLM(tiny_config("mac")).eval()
    with torch.no_grad():
        _, state = model(torch.randint(0, model.config.vocab_size, (1, 24)))
    state.save(tmp_path / "good.safetensors")
    poisoned = next(t for t in state.layers[0].memory.weights if t.is_floating_point())
    poisoned[(0,) * poisoned.dim()] = float("nan")
    with pytest.raises(ValueError, match=r"bad\.safetensors.*holds 1 NaN or inf"):
        state.save(tmp_path / "bad.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.safetensors"]


# ------------------------------------------------------------------------------------------- full disk
def test_a_full_disk_while_checkpointing_is_named_and_keeps_the_old_ones(tmp_path, cache_dir, monkeypatch):
    cfg = dict(batch_size=4, steps=4, warmup_steps=2, eval_windows=2, ckpt_every=2)
    trainer = Trainer(micro_config(tmp_path, cache_dir, **cfg))

    def no_space(obj, f, *args, **kwargs):
        f.write(b"\x80\x02partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    real_save = ckpt.torch.save
    calls = []

    def full_after_first(obj, f, *args, **kwargs):  # the disk fills up after the first checkpoint
        calls.append(1)
        (real_save if len(calls) == 1 else no_space)(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", full_after_first)
    with pytest.raises(CheckpointWriteError, match="disk is full") as caught:
        trainer.train()
    message = str(caught.value)
    assert caught.value.errno == errno.ENOSPC
    assert str(tmp_path / "checkpoints" / "step_00000004") in message
    assert f"the last good checkpoint is {tmp_path / 'checkpoints' / 'step_00000002'}" in message
    assert "--resume" in message
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000002"]  # no half-written step 4, no temp
    assert latest_checkpoint(tmp_path).name == "step_00000002"


def test_a_write_error_that_is_not_a_full_disk_is_named_as_such(tmp_path, monkeypatch):
    def denied(obj, f, *args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ckpt.torch, "save", denied)
    failed = r"step_00000001.*the write failed \(OSError.*Input/output"
    with pytest.raises(CheckpointWriteError, match=failed):
        save_checkpoint(tmp_path, 1, model_state={"w": torch.ones(3)}, trainer_state={}, config={})
    assert os.listdir(tmp_path / "checkpoints") == []


def test_a_failed_write_inside_torch_save_keeps_its_os_error(tmp_path):
    """torch's zip writer reported it as its own assertion ("inline_container.cc ... unexpected pos"),
    without the errno: a used-up quota or a file-size limit read as a mystery. A file-size limit
    (RLIMIT_FSIZE, in a child process) makes the write fail as a quota would."""
    script = f"""
import resource, torch
from titans.runtime.checkpoint import save_checkpoint
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # model.safetensors fits, trainer.pt not
try:
    save_checkpoint({str(tmp_path)!r}, 1, model_state={{"w": torch.ones(3)}},
                    trainer_state={{"x": torch.zeros(1 << 20)}}, config={{}})
except Exception as e:
    print(type(e).__name__, e.errno, e)
"""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.stdout.startswith(f"CheckpointWriteError {errno.EFBIG} "), done.stdout + done.stderr
    assert "File too large" in done.stdout and "unexpected pos" not in done.stdout
    assert os.listdir(tmp_path / "checkpoints") == []


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (needs root and mount; skipped where either is missing)."""
    mount = tmp_path / "small"
    mount.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("cannot run mount")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=30)


def test_a_real_full_disk(small_disk):
    small = {"w": torch.ones(1000)}
    save_checkpoint(small_disk, 1, model_state=small, trainer_state={"n": 1}, config={})
    big = {"w": torch.ones(100_000)}  # 400 KB: more than the disk holds
    with pytest.raises(CheckpointWriteError, match=r"step_00000002.*the disk is full"):
        save_checkpoint(small_disk, 2, model_state=big, trainer_state={"n": 2}, config={})
    assert os.listdir(small_disk / "checkpoints") == ["step_00000001"]
    assert load_checkpoint(latest_checkpoint(small_disk)).trainer_state == {"n": 1}
    # the trainer state is what overflows (torch.save's own writer)
    with pytest.raises(CheckpointWriteError, match="the disk is full"):
        save_checkpoint(small_disk, 3, model_state=small, trainer_state={"t": torch.ones(100_000)}, config={})
    assert os.listdir(small_disk / "checkpoints") == ["step_00000001"]

    model = TitansLM(tiny_config("mac")).eval()
    with torch.no_grad():
        _, state = model(torch.randint(0, model.config.vocab_size, (1, 24)))
    state.save(small_disk / "state.safetensors")
    wide = map_state(state, lambda t: t.repeat(64, *([1] * (t.dim() - 1))) if t.dim() else t)
    with pytest.raises(OSError, match=r"state\.safetensors.*the disk is full") as caught:
        wide.save(small_disk / "state.safetensors")
    assert caught.value.errno == errno.ENOSPC
    assert load_state(small_disk / "state.safetensors").position == state.position  # the old file stays
    assert sorted(os.listdir(small_disk)) == ["checkpoints", "state.safetensors"]


def test_tensorboard_on_a_full_disk_is_one_error_naming_its_folder(small_disk, capfd):
    """TensorBoard's writer thread fails on a full disk: no thread traceback on stderr, and the next log
    raises one OSError (ENOSPC) naming the TensorBoard folder, as the JSONL's own error names its file."""
    pytest.importorskip("tensorboard")
    from titans.training.metrics import MetricsLogger

    metrics = MetricsLogger(small_disk / "run", tensorboard=True)
    room = os.statvfs(small_disk)
    (small_disk / "filler").write_bytes(b"\0" * (room.f_bavail * room.f_frsize - 24 * 1024))
    metrics._file.close()
    metrics._file = open(os.devnull, "w")  # noqa: SIM115 (the JSONL elsewhere: only TensorBoard meets the full disk)
    deadline = time.monotonic() + 60
    tb = str(small_disk / "run" / "tb")
    with pytest.raises(OSError) as caught:
        for step in range(1_000_000):
            metrics.log("train", step, **{f"value_{i}": float(i) for i in range(50)})
            metrics._tb.flush()
            assert time.monotonic() < deadline, "TensorBoard never hit the full disk"
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == tb
    with pytest.raises(OSError) as caught:
        metrics.close()
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == tb
    assert "Traceback" not in capfd.readouterr().err


# ------------------------------------------------------------------------------------------- data
def test_data_too_short_to_hold_out_names_the_setting(tmp_path, cache_dir):
    text = tmp_path / "short.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 8)  # 232 bytes: 1% held out is 2-3 tokens
    cfg = micro_config(tmp_path / "run", cache_dir, data=str(text))
    with pytest.raises(ValueError, match=r"held-out split of .*short\.txt.*heldout_fraction.*--seq-len"):
        Trainer(cfg)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x = 1\n" * 4)
    with pytest.raises(ValueError, match=r"training split of .*tiny\.txt.*--seq-len"):
        Trainer(micro_config(tmp_path / "run2", cache_dir, data=str(tiny), heldout_fraction=0.5))
