"""A length curriculum (`TrainConfig.curriculum_steps` / `curriculum_seq_lens`, `CurriculumBatches`): longer
windows from given steps on with the tokens per step unchanged, sharded and resumed exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from micro_train import micro_config
from titans.data.loader import CurriculumBatches, TokenBatches
from titans.training.config import TrainConfig
from titans.training.trainer import Trainer


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token-cache")


def curriculum_config(run_dir: Path, cache_dir: Path, **overrides) -> TrainConfig:
    base = dict(
        batch_size=6, steps=7, warmup_steps=2, eval_every=1000, eval_windows=2, ckpt_every=1000,
        curriculum_steps=[3, 5], curriculum_seq_lens=[64, 96],
    )  # fmt: skip
    return micro_config(run_dir, cache_dir, **{**base, **overrides})


# ------------------------------------------------------------------------------------------- batches
def test_curriculum_batches_change_shape_and_keep_tokens_per_step():
    tokens = np.arange(20_001, dtype=np.int64)
    batches = CurriculumBatches(tokens, batch_size=12, seq_len=10, steps=[4, 9], seq_lens=[30, 40])
    shapes = [tuple(batches.get_batch(s)[0].shape) for s in (0, 3, 4, 8, 9, 50)]
    assert shapes == [(12, 10), (12, 10), (4, 30), (4, 30), (3, 40), (3, 40)]
    # each phase is the TokenBatches of its shape at the run's step number: what a run resumed at that step
    # with that shape would read
    for step, (rows, n) in ((2, (12, 10)), (6, (4, 30)), (11, (3, 40))):
        plain = TokenBatches(tokens, batch_size=rows, seq_len=n)
        got, want = batches.get_batch(step), plain.get_batch(step)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(got[1][:, :-1], got[0][:, 1:])  # targets are the inputs shifted by one


def test_curriculum_batches_shard_and_resume():
    tokens = np.arange(9_001, dtype=np.int64)
    kw = dict(batch_size=6, seq_len=7, steps=[3], seq_lens=[21])
    whole = CurriculumBatches(tokens, **kw, seed=2)
    for rank in range(2):
        part = CurriculumBatches(tokens, **kw, seed=2, rank=rank, world_size=2)
        for step in (1, 3, 10):
            assert torch.equal(part.get_batch(step)[0], whole.get_batch(step)[0][rank::2])
    whole.step = 5
    again = CurriculumBatches(tokens, **kw, seed=2)
    again.load_state_dict(whole.state_dict())
    assert again.step == 5
    with pytest.raises(ValueError, match="curriculum"):
        CurriculumBatches(tokens, **{**kw, "steps": [4]}, seed=2).load_state_dict(whole.state_dict())
    with pytest.raises(ValueError, match="curriculum"):  # a plain run's state has no curriculum
        again.load_state_dict(TokenBatches(tokens, batch_size=6, seq_len=7, seed=2).state_dict())


@pytest.mark.parametrize(
    ("steps", "seq_lens", "match"),
    [
        ([3], [16, 32], "one window length per step"),
        ([0], [16], "rise from >= 1"),
        ([5, 5], [16, 32], "rise from >= 1"),
        ([4, 2], [16, 32], "rise from >= 1"),
        ([3], [25], "does not divide the 96 tokens"),
    ],
)
def test_curriculum_schedule_checked(steps, seq_lens, match):
    with pytest.raises(ValueError, match=match):
        CurriculumBatches(np.arange(1_000), batch_size=6, seq_len=16, steps=steps, seq_lens=seq_lens)
    with pytest.raises(ValueError, match=match):
        TrainConfig(batch_size=6, seq_len=16, curriculum_steps=steps, curriculum_seq_lens=seq_lens)


def test_config_checks():
    with pytest.raises(ValueError, match="not with carry_state"):
        TrainConfig(curriculum_steps=[2], curriculum_seq_lens=[512], carry_state=True)
    with pytest.raises(ValueError, match="not with cuda_graphs"):
        TrainConfig(curriculum_steps=[2], curriculum_seq_lens=[512], cuda_graphs=True)
    # 16 x 256 tokens in windows of 1024: 4 rows, which grad_accum=8 cannot split
    with pytest.raises(ValueError, match="grad_accum=8 must divide the 4 rows"):
        TrainConfig(curriculum_steps=[2], curriculum_seq_lens=[1024], grad_accum=8)
    # a run saved before these fields existed resumes as it was (no curriculum)
    saved = TrainConfig().to_dict()
    del saved["curriculum_steps"], saved["curriculum_seq_lens"]
    assert TrainConfig().resume_mismatches(saved) == []
    cur = TrainConfig(curriculum_steps=[2], curriculum_seq_lens=[512])
    assert cur.resume_mismatches(saved) == ["curriculum_seq_lens", "curriculum_steps"]


# ------------------------------------------------------------------------------------------- training
def test_curriculum_run_trains_each_phase_at_its_length_and_resumes_bit_identically(tmp_path, cache_dir):
    cfg = curriculum_config(tmp_path / "straight", cache_dir)
    straight = Trainer(cfg)
    seen: list[tuple[int, ...]] = []
    forward = straight.model.forward

    def record(input_ids, *args, **kwargs):
        seen.append(tuple(input_ids.shape))
        return forward(input_ids, *args, **kwargs)

    straight.model.forward = record
    ref = straight.train()
    train_shapes = [s for s in seen if s[0] in (6, 3, 2) and s[1] in (32, 64, 96)]
    assert train_shapes[:7] == [(6, 32)] * 3 + [(3, 64)] * 2 + [(2, 96)] * 2
    assert all(np.isfinite(ref.step_losses))

    first = Trainer(curriculum_config(tmp_path / "split", cache_dir))
    part = first.train(stop_at=4)  # stop inside the second phase
    assert part.step == 4
    del first
    torch.manual_seed(123)
    second = Trainer(curriculum_config(tmp_path / "split", cache_dir), resume=True)
    rest = second.train()
    assert part.step_losses + rest.step_losses == ref.step_losses  # bit for bit
    sa, sb = straight.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    # a resume may not change the schedule
    with pytest.raises(ValueError, match="curriculum_steps"):
        Trainer(curriculum_config(tmp_path / "split", cache_dir, curriculum_steps=[3, 6]), resume=True)


def test_curriculum_needs_rows_that_split_over_ranks_and_micro_batches(tmp_path, cache_dir):
    # 6 x 32 tokens in windows of 96: 2 rows, which grad_accum=2 splits and grad_accum=3 does not
    with pytest.raises(ValueError, match="grad_accum=3 must divide"):
        curriculum_config(tmp_path / "a", cache_dir, grad_accum=3)
