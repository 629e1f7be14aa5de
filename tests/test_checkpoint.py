"""Checkpoints: round trip, RNG restore, damage detection, fallback, pruning, crash safety."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from titans.runtime import checkpoint as ckpt
from titans.runtime.checkpoint import (
    CheckpointError,
    capture_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    verify_checkpoint,
)

SRC = str(Path(__file__).resolve().parents[1] / "src")


class TiedLM(nn.Module):
    """Embedding and output head share one weight (the case safetensors refuses as shared storage)."""

    def __init__(self, vocab: int = 37, dim: int = 12):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.embed(x))))


class Opaque:
    """Not allow-listed for weights_only unpickling."""


def _trained_state(seed: int = 0):
    torch.manual_seed(seed)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for _ in range(2):
        x = torch.randint(0, 37, (3, 5))
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    trainer = {
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "data": {"step": 2, "seed": 0, "batch_size": 3, "seq_len": 5, "n_tokens": 1000},
        "rng": capture_rng_state(),
        "best_loss": np.float64(1.25),
        "history": np.arange(4, dtype=np.float32),
    }
    return model, opt, trainer


def _save(run_dir, step, model, trainer, **kw):
    return save_checkpoint(
        run_dir,
        step,
        model_state=model.state_dict(),
        trainer_state=trainer,
        config={"dim": 12, "step": step},
        **kw,
    )


def test_round_trip_tensors_optimizer_and_ties(tmp_path):
    model, opt, trainer = _trained_state()
    path = _save(tmp_path, 7, model, trainer)
    assert path == tmp_path / "checkpoints" / "step_00000007"
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "model.safetensors", "trainer.pt"]
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 7 and meta["config"] == {"dim": 12, "step": 7}
    assert meta["files"]["model.safetensors"]["size"] == (path / "model.safetensors").stat().st_size
    assert len(meta["files"]["trainer.pt"]["sha256"]) == 64

    ck = load_checkpoint(path)
    assert ck.step == 7 and ck.config == {"dim": 12, "step": 7} and ck.path == path
    ref = model.state_dict()
    assert ck.model_state.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(ck.model_state[k], v), k
    assert ck.model_state["head.weight"] is ck.model_state["embed.weight"]  # the tie survives
    restored = TiedLM()
    restored.load_state_dict(ck.model_state)
    assert restored.head.weight is restored.embed.weight
    opt2 = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    opt2.load_state_dict(ck.trainer_state["optimizer"])
    for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))
    assert ck.trainer_state["data"] == trainer["data"]
    assert ck.trainer_state["scheduler"] == trainer["scheduler"]
    # numpy values were converted so that weights_only loading accepts them
    assert ck.trainer_state["best_loss"] == 1.25 and isinstance(ck.trainer_state["best_loss"], float)
    assert torch.equal(ck.trainer_state["history"], torch.arange(4, dtype=torch.float32))


def test_partial_views_are_saved_as_copies(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"base": base, "row": base[1], "col": base[:, 2], "same": base, "empty": torch.empty(0, 3)}
    path = save_checkpoint(tmp_path, 0, model_state=state, trainer_state={}, config={})
    loaded = load_checkpoint(path).model_state
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    assert loaded["same"] is loaded["base"] and loaded["row"].data_ptr() != loaded["base"].data_ptr()


def test_rng_restore_reproduces_random_numbers(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    save_checkpoint(tmp_path, 1, model_state={}, trainer_state={"rng": capture_rng_state()}, config={})
    expected = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(load_checkpoint(latest_checkpoint(tmp_path)).trainer_state["rng"])
    got = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3))
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])


def test_truncated_and_bit_flipped_files_are_refused(tmp_path):
    model, _, trainer = _trained_state()
    path = _save(tmp_path, 1, model, trainer)
    weights = path / "model.safetensors"
    good = weights.read_bytes()

    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        verify_checkpoint(path)

    flipped = bytearray(good)
    flipped[len(flipped) - 10] ^= 0x01
    weights.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*corrupted"):
        load_checkpoint(path)

    weights.write_bytes(good)
    load_checkpoint(path)
    (path / "meta.json").write_text('{"step": 1, "files": ')
    with pytest.raises(CheckpointError, match=r"meta\.json"):
        load_checkpoint(path)
    (path / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=r"meta\.json.*missing"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")


def test_an_edited_config_in_meta_json_is_refused(tmp_path):
    """The files' hashes did not cover meta.json's config: a checkpoint whose config was edited (another
    attention window) loaded and ran as another model; another width failed in torch with a traceback.
    A meta.json of a checkpoint saved before the config's digest was recorded loads as before."""
    model, _, trainer = _trained_state()
    path = _save(tmp_path, 1, model, trainer)
    meta = json.loads((path / "meta.json").read_text())
    edited = dict(meta, config={**meta["config"], "dim": 13})
    (path / "meta.json").write_text(json.dumps(edited))
    with pytest.raises(CheckpointError, match=r"meta\.json.*config does not match the sha256 it records"):
        load_checkpoint(path)
    del edited["config_sha256"]
    (path / "meta.json").write_text(json.dumps(edited))
    assert load_checkpoint(path).config["dim"] == 13
    (path / "meta.json").write_text(json.dumps(dict(edited, config={**edited["config"], "tokenizer": None})))
    assert load_checkpoint(path).config["tokenizer"] is None  # null: the train config's tokenizer
    for config in ([1, 2], {"model": [1, 2]}, {"train": "x"}):  # a TypeError / AttributeError later
        (path / "meta.json").write_text(json.dumps(dict(edited, config=config)))
        with pytest.raises(CheckpointError, match=r"meta\.json.*corrupted: its (config|model|train) must be"):
            load_checkpoint(path)


def test_a_config_with_number_keys_saves_and_loads(tmp_path):
    """The config's digest was of its keys as given: number keys sort otherwise once meta.json holds them
    as strings (a checkpoint refused as edited at once), and mixed keys could not be sorted at all."""
    model, _, trainer = _trained_state()
    for config in ({"schedule": {2: 1e-3, 10: 1e-4}}, {"m": {1: "a", "b": 2}}):
        path = save_checkpoint(
            tmp_path, 1, model_state=model.state_dict(), trainer_state=trainer, config=config
        )
        assert load_checkpoint(path).config == json.loads(json.dumps(config))


def test_weights_that_do_not_fit_the_config_are_one_line():
    from tiny_lm import tiny_model
    from titans.runtime.loading import load_weights

    small, wide = tiny_model("mac"), tiny_model("mac", dim=32)
    with pytest.raises(ValueError, match=r"^the weights do not fit .*size mismatch for embed\.weight") as e:
        load_weights(wide, small.state_dict())
    assert "\n" not in str(e.value) and "more)" in str(e.value)


def test_run_folder_checkpoint_is_hashed_once(tmp_path, monkeypatch):
    """latest_checkpoint hashes the files; loading what it picked (verified=True) does not hash them
    again, but still refuses a file whose size no longer matches."""
    from titans.runtime.loading import load_checkpoint_from

    model, _, trainer = _trained_state()
    path = _save(tmp_path, 1, model, trainer)
    hashed: list[str] = []
    file_hash, bytes_hash = ckpt._sha256_file, ckpt.hashlib.sha256

    def count_file(p):
        hashed.append(Path(p).name)
        return file_hash(p)

    def count_bytes(*data):  # hashlib.sha256(data): a whole file in memory (_sha256_file streams)
        if data and not data[0].startswith(b"{"):  # not meta.json's config (its digest is checked too)
            hashed.append("bytes")
        return bytes_hash(*data)

    monkeypatch.setattr(ckpt, "_sha256_file", count_file)
    monkeypatch.setattr(ckpt, "hashlib", SimpleNamespace(sha256=count_bytes))
    assert load_checkpoint_from(tmp_path).step == 1
    assert sorted(hashed) == ["model.safetensors", "trainer.pt"]
    hashed.clear()
    assert load_checkpoint_from(path).step == 1  # a folder named directly: hashed by the load itself
    assert hashed == ["bytes", "bytes"]
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        load_checkpoint(path, verified=True)


def test_latest_falls_back_to_previous_good_checkpoint(tmp_path, caplog):
    assert latest_checkpoint(tmp_path) is None
    model, _, trainer = _trained_state()
    for step in (10, 20, 30):
        _save(tmp_path, step, model, trainer)
    assert latest_checkpoint(tmp_path).name == "step_00000030"
    trainer_file = tmp_path / "checkpoints" / "step_00000030" / "trainer.pt"
    trainer_file.write_bytes(trainer_file.read_bytes()[:-7])
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path).name == "step_00000020"
    assert "step_00000030" in caplog.text and "trainer.pt" in caplog.text
    (tmp_path / "checkpoints" / "step_00000020" / "meta.json").unlink()
    assert latest_checkpoint(tmp_path).name == "step_00000010"
    assert load_checkpoint(latest_checkpoint(tmp_path)).step == 10


def test_keep_last_prunes_oldest(tmp_path):
    model, _, trainer = _trained_state()
    for step in range(5):
        _save(tmp_path, step * 100, model, trainer, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000300", "step_00000400"]
    _save(tmp_path, 500, model, trainer, keep_last=None)
    assert len(list_checkpoints(tmp_path)) == 3
    # re-saving an existing step replaces it in place
    _save(tmp_path, 500, model, {"replaced": True}, keep_last=None)
    assert load_checkpoint(list_checkpoints(tmp_path)[-1]).trainer_state == {"replaced": True}
    assert len(list_checkpoints(tmp_path)) == 3


def test_exception_mid_write_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    model, _, trainer = _trained_state()
    _save(tmp_path, 1, model, trainer)

    def half_then_fail(obj, f, *args, **kwargs):
        f.write(b"\x80\x02partial pickle")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt.torch, "save", half_then_fail)
    with pytest.raises(OSError, match="simulated"):
        _save(tmp_path, 2, model, trainer)
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000001"]  # no step_2, no temp folder
    assert latest_checkpoint(tmp_path).name == "step_00000001"


def test_kill_mid_write_keeps_last_good_checkpoint(tmp_path):
    # A separate process dies (os._exit: no cleanup, like SIGKILL) after writing the weights of step 2.
    script = textwrap.dedent(
        f"""
        import os, sys, torch
        sys.path.insert(0, {SRC!r})
        from titans.runtime import checkpoint as ckpt
        state = {{"w": torch.ones(1000, 100)}}
        ckpt.save_checkpoint({str(tmp_path)!r}, 1, model_state=state, trainer_state={{}}, config={{}})
        ckpt.torch.save = lambda *a, **k: os._exit(9)
        ckpt.save_checkpoint({str(tmp_path)!r}, 2, model_state=state, trainer_state={{}}, config={{}})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert "step_00000001" in leftovers and "step_00000002" not in leftovers
    assert any(n.startswith(".tmp-step_00000002") for n in leftovers)  # the killed write, hidden
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    ck = load_checkpoint(latest_checkpoint(tmp_path))
    assert ck.step == 1 and torch.equal(ck.model_state["w"], torch.ones(1000, 100))
    save_checkpoint(tmp_path, 2, model_state={"w": torch.zeros(2)}, trainer_state={}, config={})
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000001", "step_00000002"]  # cleaned up


def test_weights_only_refusal_is_explained(tmp_path):
    path = save_checkpoint(tmp_path, 3, model_state={}, trainer_state={"thing": Opaque()}, config={})
    with pytest.raises(CheckpointError, match="weights_only=False"):
        load_checkpoint(path)
    assert isinstance(load_checkpoint(path, weights_only=False).trainer_state["thing"], Opaque)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(TypeError, match="'w'"):
        save_checkpoint(tmp_path, 0, model_state={"w": [1.0]}, trainer_state={}, config={})
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(tmp_path, 0, model_state={}, trainer_state={}, config={"f": object()})
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 0, model_state={}, trainer_state={}, config={}, keep_last=0)
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, -1, model_state={}, trainer_state={}, config={})
    assert not (tmp_path / "checkpoints").exists() or not os.listdir(tmp_path / "checkpoints")


def test_a_checkpoint_pruned_while_it_is_read_is_no_damage(tmp_path, monkeypatch, caplog):
    """A reader (eval, generate, --resume) of a run whose writer keeps one checkpoint: the newest one it
    listed can be pruned before it is verified or loaded, once the writer saved the next. It was reported
    as damaged ("trainer.pt is missing"), or the command failed though a good checkpoint existed."""
    from titans.runtime import loading

    model, _, trainer = _trained_state()
    _save(tmp_path, 1, model, trainer, keep_last=1)
    real_verify, real_load = ckpt.verify_checkpoint, loading.load_checkpoint

    def the_writer_moves_on(real, step_it_saves):
        writes = iter([step_it_saves])

        def call(path, *args, **kwargs):
            step = next(writes, None)
            if step is not None:  # the run saves its next checkpoint and prunes the one being read
                _save(tmp_path, step, model, trainer, keep_last=1)
            return real(path, *args, **kwargs)

        return call

    monkeypatch.setattr(ckpt, "verify_checkpoint", the_writer_moves_on(real_verify, 2))
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path).name == "step_00000002"
    assert "damaged" not in caplog.text
    monkeypatch.setattr(ckpt, "verify_checkpoint", real_verify)
    monkeypatch.setattr(loading, "load_checkpoint", the_writer_moves_on(real_load, 3))
    assert loading.load_checkpoint_from(tmp_path).step == 3
