"""Training with a carried state (`TrainConfig.carry_state`, `StreamBatches`): rows continue in the stream,
the state crosses steps detached, and a resume carries it on exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from micro_train import micro_config as shared_micro_config
from titans.data.loader import StreamBatches
from titans.models.state import cat_rows, select_rows
from titans.training.config import TrainConfig
from titans.training.trainer import Trainer


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token-cache")


def carry_config(run_dir: Path, cache_dir: Path, **overrides) -> TrainConfig:
    base = dict(batch_size=4, steps=6, warmup_steps=2, eval_every=1000, eval_windows=2, ckpt_every=1000)
    return shared_micro_config(run_dir, cache_dir, **{**base, "carry_state": True, **overrides})


# ------------------------------------------------------------------------------------------- batches
def test_stream_batches_rows_continue_within_an_episode():
    tokens = np.arange(5_003, dtype=np.int64)  # a token is its position: contiguity is visible
    batches = StreamBatches(tokens, batch_size=4, seq_len=17, reset_every=5, seed=3)
    lane = (5_003 - 1) // 4
    prev = None
    for step in range(12):
        x, y = batches.get_batch(step)
        assert x.shape == (4, 17) and torch.equal(y, x + 1)
        first = x[:, 0].numpy()
        # every row stays in its own lane, so rows never read each other's text
        assert np.all(first // lane == np.arange(4)) and np.all(y[:, -1].numpy() <= (np.arange(4) + 1) * lane)
        assert batches.resets(step) == (step % 5 == 0)
        if prev is not None and not batches.resets(step):
            assert np.array_equal(first, prev + 1)  # the window right after the previous step's
        prev = x[:, -1].numpy()
    # a new episode starts elsewhere (a new random offset per row)
    assert not torch.equal(batches.get_batch(5)[0], batches.get_batch(4)[0] + 17)


def test_stream_batches_groups_take_turns():
    tokens = np.arange(9_001, dtype=np.int64)
    batches = StreamBatches(tokens, batch_size=2, seq_len=11, groups=3, reset_every=4, seed=5)
    lane = 9_000 // 6
    for step in range(3, 20):
        x = batches.get_batch(step)[0]
        group = batches.group(step)
        assert group == step % 3
        assert np.all(x[:, 0].numpy() // lane == group * 2 + np.arange(2))  # the group's own lanes
        assert batches.resets(step) == ((step // 3) % 4 == 0)
        if not batches.resets(step):  # continues the group's previous visit, three steps back
            assert torch.equal(x[:, 0], batches.get_batch(step - 3)[0][:, -1] + 1)
    with pytest.raises(ValueError, match="groups must be a positive integer"):
        StreamBatches(tokens, batch_size=2, seq_len=11, groups=0)


def test_stream_batches_shard_and_resume():
    tokens = np.arange(4_001, dtype=np.int64)
    whole = StreamBatches(tokens, batch_size=6, seq_len=13, seed=1)
    assert whole.episode_len == (4_000 // 6) // 13  # default: as many windows as a lane holds
    for rank in range(3):
        part = StreamBatches(tokens, batch_size=6, seq_len=13, seed=1, rank=rank, world_size=3)
        for step in (0, 7, whole.episode_len + 2):
            assert torch.equal(part.get_batch(step)[0], whole.get_batch(step)[0][rank::3])
    whole.step = 9
    again = StreamBatches(tokens, batch_size=6, seq_len=13, seed=1)
    again.load_state_dict(whole.state_dict())
    assert again.step == 9
    other = StreamBatches(tokens, batch_size=6, seq_len=13, seed=1, reset_every=4)
    with pytest.raises(ValueError, match="reset_every"):
        other.load_state_dict(whole.state_dict())


def test_stream_batches_refuse_episodes_longer_than_a_lane():
    with pytest.raises(ValueError, match=r"reset_every=9 .* at most 8"):
        StreamBatches(np.arange(1_001), batch_size=4, seq_len=30, reset_every=9)
    with pytest.raises(ValueError, match="fewer than one window"):
        StreamBatches(np.arange(100), batch_size=8, seq_len=30)


def test_config_checks(tmp_path):
    with pytest.raises(ValueError, match="carry_reset_every applies with carry_state"):
        TrainConfig(carry_reset_every=4)
    with pytest.raises(ValueError, match="carry_reset_every must be"):
        TrainConfig(carry_state=True, carry_reset_every=0)
    with pytest.raises(ValueError, match="carry_groups applies with carry_state"):
        TrainConfig(carry_groups=2)
    with pytest.raises(ValueError, match="carry_groups must be"):
        TrainConfig(carry_state=True, carry_groups=0)
    with pytest.raises(ValueError, match="cuda_graphs: not with carry_state"):
        TrainConfig(carry_state=True, cuda_graphs=True)
    # a run saved before these fields existed resumes as it was (no carry)
    saved = TrainConfig().to_dict()
    del saved["carry_state"], saved["carry_reset_every"], saved["carry_groups"]
    assert TrainConfig().resume_mismatches(saved) == []
    assert TrainConfig(carry_state=True).resume_mismatches(saved) == ["carry_state"]


def test_cat_rows_inverts_select_rows():
    from tiny_lm import tiny_model

    model = tiny_model("mac", dtype=torch.float32)
    _, state = model(torch.randint(0, 61, (5, 23)))
    parts = [select_rows(state, torch.tensor(rows)) for rows in ([0, 1], [2], [3, 4])]
    joined = cat_rows(parts)
    x = torch.randint(0, 61, (5, 9))
    assert torch.equal(model(x, joined)[0], model(x, state)[0])
    with pytest.raises(ValueError, match="different positions"):
        cat_rows([state, model(x, state)[1]])


# ------------------------------------------------------------------------------------------- training
def _frozen_optimizer(trainer: Trainer, grads: list[dict[str, torch.Tensor]]) -> None:
    """Record each step's gradients and leave the weights as they are (so windows can be re-scored)."""

    def step():
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})

    trainer.optimizer.step = step


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_carried_training_equals_one_long_forward_detached_at_the_windows(tmp_path, cache_dir):
    k = 4
    trainer = Trainer(carry_config(tmp_path, cache_dir, steps=k, grad_accum=2, grad_clip=None))
    grads: list[dict[str, torch.Tensor]] = []
    _frozen_optimizer(trainer, grads)  # (the scheduler warns that step was replaced)
    windows = [trainer.batches.get_batch(s) for s in range(k)]
    result = trainer.train()
    model = trainer.model.eval()
    x = torch.cat([w[0] for w in windows], dim=1)  # each row's k windows are one stretch of its lane
    y = torch.cat([w[1] for w in windows], dim=1)
    assert torch.equal(x[:, 1:], y[:, :-1])
    with torch.no_grad():
        logits, _ = model(x)  # one long forward from a fresh state
    t = trainer.config.seq_len
    nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(x.shape)
    long = [nll[:, i * t : (i + 1) * t].mean().item() for i in range(k)]
    assert result.step_losses == pytest.approx(long, abs=2e-5)
    fresh = F.cross_entropy(model(windows[-1][0])[0].flatten(0, 1), windows[-1][1].flatten()).item()
    assert abs(fresh - long[-1]) > 1e-3  # the last window's loss depends on what the state carried

    # the gradient of step j: window j's loss, from the state the earlier windows left (no gradient into them)
    model.train()
    j = k - 1
    with torch.no_grad():
        _, state = model(x[:, : j * t])
    logits, _ = model(x[:, j * t :], state)
    F.cross_entropy(logits.flatten(0, 1), y[:, j * t :].flatten()).backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(grads[j][name], p.grad, atol=2e-5, rtol=1e-3), name


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_each_group_of_lanes_carries_its_own_state(tmp_path, cache_dir):
    """carry_groups=2: steps 0, 2, 4 walk group 0's lanes, 1, 3, 5 group 1's; each group's losses are those
    of one long forward over its rows' stretches."""
    trainer = Trainer(carry_config(tmp_path, cache_dir, steps=6, carry_groups=2, grad_clip=None))
    _frozen_optimizer(trainer, [])
    windows = [trainer.batches.get_batch(s) for s in range(6)]
    losses = trainer.train().step_losses
    model = trainer.model.eval()
    t = trainer.config.seq_len
    for group in (0, 1):
        x = torch.cat([windows[s][0] for s in range(group, 6, 2)], dim=1)
        y = torch.cat([windows[s][1] for s in range(group, 6, 2)], dim=1)
        assert torch.equal(x[:, 1:], y[:, :-1])
        with torch.no_grad():
            nll = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), reduction="none").view(x.shape)
        long = [nll[:, i * t : (i + 1) * t].mean().item() for i in range(3)]
        assert losses[group::2] == pytest.approx(long, abs=2e-5)


def test_resume_with_carried_state_matches_uninterrupted_run(tmp_path, cache_dir):
    straight = Trainer(carry_config(tmp_path / "straight", cache_dir, carry_groups=2))
    ref = straight.train()
    first = Trainer(carry_config(tmp_path / "split", cache_dir, carry_groups=2))
    part = first.train(stop_at=3)
    assert part.step == 3 and first.carried[0] is not None
    del first
    torch.manual_seed(99)
    second = Trainer(carry_config(tmp_path / "split", cache_dir, carry_groups=2), resume=True)
    # after steps 0-2: group 0 has walked two windows, group 1 one
    assert [s.position for s in second.carried] == [2 * 32, 32]
    rest = second.train()
    assert part.step_losses + rest.step_losses == ref.step_losses  # bit for bit
    sa, sb = straight.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    # a resume may not change the lanes
    with pytest.raises(ValueError, match="carry_groups"):
        Trainer(carry_config(tmp_path / "split", cache_dir, carry_groups=1), resume=True)


def test_carried_state_resets_every_n_steps(tmp_path, cache_dir):
    trainer = Trainer(carry_config(tmp_path, cache_dir, steps=5, carry_reset_every=2))
    positions = []
    step = trainer.train_step

    def record(s):
        positions.append(None if trainer.batches.resets(s) else trainer.carried[0].position)
        return step(s)

    trainer.train_step = record
    trainer.train()
    assert positions == [None, 32, None, 32, None]
