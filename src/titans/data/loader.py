"""Batches for autoregressive language modelling from a flat token stream.

``TokenBatches`` (training): the stream is cut into windows of ``seq_len + 1`` tokens that overlap by one
(inputs = first ``seq_len``, targets = last ``seq_len``). Each epoch uses its own random start shift
(within the spare tokens past the last whole window, so boundaries move between epochs) and its own
random order of the windows; the global batch at step ``s`` holds samples ``s*B .. s*B+B-1`` of that
endless sequence. Everything is drawn from generators seeded by ``(seed, epoch)``, so the batch at step
``s`` depends only on (stream, seed, batch_size, seq_len, s): resuming at step ``s`` reproduces exactly
what an uninterrupted run sees, and no window repeats within an epoch. ``state_dict()`` holds the next
step plus the settings and the stream's digests (``TokenStream.digest``: its tokens, and the held-out
split's), which ``load_state_dict`` checks: a run resumed on text edited since (even to the same token
count) is refused. Sharding: rank ``r`` of ``world_size`` gets
rows ``r::world_size`` of the same global batch, so the ranks together see exactly the batch one process
would.

``StreamBatches`` (training with a carried state, ``TrainConfig.carry_state``): row ``b`` of the global batch
reads consecutive windows of one contiguous stretch of the stream, so a model can carry its state from one
visit to the next (truncated backprop through time). The stream is cut into ``groups * batch_size`` equal
lanes; step ``s`` reads the ``batch_size`` lanes of group ``s % groups``. An *episode* of a group is
``reset_every`` of its visits (default: as many windows as a lane holds); at its first visit each row starts
at a random offset within its lane (drawn from ``(seed, episode, group)``), then moves on by ``seq_len``
tokens a visit. ``resets(step)`` says whether step ``step`` starts an episode (the trainer then starts that
group from a fresh state). Sharded and resumed like ``TokenBatches``.

``CurriculumBatches`` (training with a length curriculum, ``TrainConfig.curriculum_steps``): from given steps
on, longer windows and proportionally fewer of them, the tokens per step unchanged.

``EvalWindows`` (evaluation): a fixed number of contiguous, non-overlapping windows of the held-out stream
(window ``i`` covers inputs ``[i*T, (i+1)*T)`` and targets shifted by one), spread evenly over the stream,
in a fixed order, sharded ``r::world_size`` like training.

Bits per byte: ``bits_per_byte(mean_loss, bytes_per_token)`` = mean token NLL (nats) / ln 2 / bytes per
token. ``bytes_per_token`` is the ratio for the WHOLE held-out stream (``TokenStream.bytes_per_token``:
its UTF-8 bytes / its tokens), not per window: for the byte tokenizer it is exactly 1; for a subword
tokenizer the evenly spread windows make it a close estimate of the evaluated windows' own ratio.

Public API (names are stable): ``TokenBatches``, ``StreamBatches``, ``CurriculumBatches``, ``EvalWindows``,
``bits_per_byte``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from functools import lru_cache

import numpy as np
import torch

from titans.data.stream import TokenStream, token_digest

log = logging.getLogger(__name__)
Batch = tuple[torch.Tensor, torch.Tensor]


def bits_per_byte(mean_loss: float, bytes_per_token: float) -> float:
    """Bits per UTF-8 byte from a mean next-token cross-entropy in nats."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    return mean_loss / math.log(2) / bytes_per_token


def _as_tokens(tokens: TokenStream | np.ndarray) -> np.ndarray:
    arr = tokens.tokens if isinstance(tokens, TokenStream) else np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token stream must be 1-D, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token stream must hold integers, got dtype {arr.dtype}")
    return arr


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")


def _check_shard(batch_size: int, rank: int, world_size: int) -> None:
    _check_rank(rank, world_size)
    if batch_size < 1 or batch_size % world_size:
        raise ValueError(
            f"global batch_size={batch_size} must be a positive multiple of world_size={world_size}"
        )


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    """(inputs, targets), each (len(starts), seq_len) int64, from windows of seq_len + 1 tokens."""
    idx = starts[:, None] + np.arange(seq_len + 1)
    w = torch.from_numpy(np.asarray(tokens[idx]).astype(np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class TokenBatches:
    """Endless training batches, deterministic from (seed, step); see the module docstring.

    Yields (inputs, targets), each (batch_size // world_size, seq_len) int64 CPU tensors.
    """

    def __init__(
        self,
        tokens: TokenStream | np.ndarray,
        *,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        step: int = 0,
    ):
        self.tokens = _as_tokens(tokens)
        _check_shard(batch_size, rank, world_size)
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        n = self.tokens.shape[0]
        if n < seq_len + 1:
            raise ValueError(f"token stream has {n} tokens; seq_len={seq_len} needs at least {seq_len + 1}")
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.step = step
        # (this stream's tokens, the held-out split's) digests; the first is computed when first needed
        self._digests = (
            (tokens.digest, tokens.split_digests[1]) if isinstance(tokens, TokenStream) else ("", "")
        )
        self.windows_per_epoch = (n - 1) // seq_len
        self._slack = (n - 1) - self.windows_per_epoch * seq_len  # room to shift the window grid
        self._epoch_plan = lru_cache(maxsize=4)(self._plan)

    def _plan(self, epoch: int) -> tuple[int, np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch])
        shift = int(rng.integers(0, self._slack + 1))
        return shift, rng.permutation(self.windows_per_epoch)

    def epoch(self, step: int | None = None) -> float:
        """Fractional epoch reached at the start of ``step`` (default: the next step)."""
        step = self.step if step is None else step
        return step * self.batch_size / self.windows_per_epoch

    def get_batch(self, step: int) -> Batch:
        """This rank's rows of the global batch at ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        sample = np.arange(step * self.batch_size, (step + 1) * self.batch_size, dtype=np.int64)
        sample = sample[self.rank :: self.world_size]
        epochs, index = np.divmod(sample, self.windows_per_epoch)
        starts = np.empty_like(sample)
        for e in np.unique(epochs):
            shift, perm = self._epoch_plan(int(e))
            sel = epochs == e
            starts[sel] = shift + perm[index[sel]] * self.seq_len
        return _windows(self.tokens, starts, self.seq_len)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = self.get_batch(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        """The next step, the settings it is valid for and the digests of the stream (``"stream"``) and of
        the held-out split beside it (``"heldout"``, "" when unknown); plain ints and strings, safe in any
        checkpoint."""
        if not self._digests[0]:
            self._digests = (token_digest(self.tokens), self._digests[1])
        return {
            "step": self.step,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "n_tokens": int(self.tokens.shape[0]),
            "stream": self._digests[0],
            "heldout": self._digests[1],
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["step"]``; refuses a state made with other settings or another stream (a
        state without digests, from an older checkpoint, is checked by its token count)."""
        mine = self.state_dict()
        for key in ("seed", "batch_size", "seq_len"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"data state mismatch: checkpoint has {key}={state[key]}, this loader has {mine[key]}"
                )
        fix = (
            "the data was edited, or documents added or removed, since the checkpoint was written (or this "
            "version of titans reads the source otherwise: docs/training.md, 'What --data reads'); restore "
            "the data the run trained on, or start a new run (--overwrite, or another --run-dir)"
        )
        n_saved = state.get("n_tokens", mine["n_tokens"])
        if n_saved != mine["n_tokens"]:
            raise ValueError(
                f"data state mismatch: the training text is not the checkpoint's (checkpoint n_tokens="
                f"{n_saved}, now {mine['n_tokens']}): {fix}"
            )
        for key, what in (("stream", "training"), ("heldout", "held-out")):
            if state.get(key) and mine[key] and state[key] != mine[key]:
                raise ValueError(
                    f"data state mismatch: the {what} text is not the checkpoint's (its tokens differ): {fix}"
                )
        self.step = int(state["step"])


class StreamBatches(TokenBatches):
    """Endless training batches whose rows continue from one visit of their lanes to the next; see the
    module docstring.

    Yields (inputs, targets), each (batch_size // world_size, seq_len) int64 CPU tensors. With ``groups``
    g, the stream is cut into g * batch_size lanes and step ``s`` reads group ``s % g``'s batch_size lanes:
    row ``b`` holds the window that follows the one it held at step ``s - g``, unless ``resets(s)``.
    Consecutive steps then draw on different stretches of the stream (g = 1: the same lanes every step).
    """

    def __init__(
        self,
        tokens: TokenStream | np.ndarray,
        *,
        batch_size: int,
        seq_len: int,
        reset_every: int | None = None,
        groups: int = 1,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        step: int = 0,
    ):
        super().__init__(
            tokens,
            batch_size=batch_size,
            seq_len=seq_len,
            seed=seed,
            rank=rank,
            world_size=world_size,
            step=step,
        )
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups must be a positive integer, got {groups!r}")
        lanes = groups * batch_size
        self.groups = groups
        self.lane_len = (self.tokens.shape[0] - 1) // lanes  # tokens of input a row can walk through
        fits = self.lane_len // seq_len
        if fits < 1:
            raise ValueError(
                f"token stream has {self.tokens.shape[0]} tokens: cut into {lanes} lanes (groups={groups} x "
                f"batch_size={batch_size}), each holds {self.lane_len}, fewer than one window of "
                f"seq_len={seq_len} (this needs {lanes * seq_len + 1} tokens)"
            )
        if reset_every is not None and (isinstance(reset_every, bool) or reset_every < 1):
            raise ValueError(f"reset_every must be a positive integer or None, got {reset_every!r}")
        if reset_every is not None and reset_every > fits:
            raise ValueError(
                f"reset_every={reset_every} windows of {seq_len} tokens do not fit in a lane of "
                f"{self.lane_len} tokens (the stream cut into {lanes} lanes): at most {fits}"
            )
        self.reset_every = reset_every
        self.episode_len = reset_every or fits  # windows a lane is walked before its rows start afresh

    def group(self, step: int) -> int:
        """The group of lanes ``step`` reads."""
        return step % self.groups

    def resets(self, step: int) -> bool:
        """Whether ``step`` starts an episode of its group: its rows do not continue that group's windows of
        step ``step - groups``."""
        return (step // self.groups) % self.episode_len == 0

    def _offsets(self, episode: int, group: int) -> np.ndarray:
        """(batch_size,) global start of each row's first window in ``episode`` of ``group``."""
        rng = np.random.default_rng([self.seed, episode, group, 1])  # 1: not TokenBatches' (seed, epoch)
        slack = self.lane_len - self.episode_len * self.seq_len
        lanes = group * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        return lanes * self.lane_len + rng.integers(0, slack + 1, size=self.batch_size)

    def get_batch(self, step: int) -> Batch:
        """This rank's rows of the global batch at ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        episode, k = divmod(step // self.groups, self.episode_len)
        starts = self._offsets(episode, self.group(step))[self.rank :: self.world_size] + k * self.seq_len
        return _windows(self.tokens, starts, self.seq_len)

    def epoch(self, step: int | None = None) -> float:
        """Fractional passes over the stream at the start of ``step`` (default: the next step)."""
        step = self.step if step is None else step
        return step * self.batch_size * self.seq_len / max(1, self.tokens.shape[0] - 1)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "reset_every": self.reset_every, "groups": self.groups}

    def load_state_dict(self, state: dict) -> None:
        for key in ("reset_every", "groups"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"data state mismatch: checkpoint has {key}={state.get(key)}, this loader has "
                    f"{getattr(self, key)}"
                )
        super().load_state_dict(state)


class CurriculumBatches(TokenBatches):
    """Training batches whose window length changes at given steps, with the tokens per step unchanged (a
    length curriculum, ``TrainConfig.curriculum_steps``): before ``steps[0]`` they are ``TokenBatches`` of
    (batch_size, seq_len); from ``steps[i]`` on, windows of ``seq_lens[i]`` tokens,
    ``batch_size * seq_len // seq_lens[i]`` of them a step. Each phase draws from a `TokenBatches` of its own
    shape at the run's step number, so the batch at step ``s`` depends only on (stream, seed, the schedule,
    s), and resuming anywhere reproduces it. Yields (inputs, targets), each (rows // world_size, that
    phase's seq_len) int64 CPU tensors.
    """

    def __init__(
        self,
        tokens: TokenStream | np.ndarray,
        *,
        batch_size: int,
        seq_len: int,
        steps: list[int],
        seq_lens: list[int],
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        step: int = 0,
    ):
        shard = dict(seed=seed, rank=rank, world_size=world_size)
        super().__init__(tokens, batch_size=batch_size, seq_len=seq_len, step=step, **shard)
        check_curriculum(batch_size, seq_len, steps, seq_lens)
        self.phases = [
            (start, TokenBatches(self.tokens, batch_size=batch_size * seq_len // n, seq_len=n, **shard))
            for start, n in zip(steps, seq_lens, strict=True)
        ]

    def phase(self, step: int) -> TokenBatches:
        """The loader of the phase that holds ``step`` (this one before the first change)."""
        current: TokenBatches = self
        for start, loader in self.phases:
            if step >= start:
                current = loader
        return current

    def get_batch(self, step: int) -> Batch:
        loader = self.phase(step)
        return super().get_batch(step) if loader is self else loader.get_batch(step)

    def state_dict(self) -> dict:
        schedule = [[start, loader.seq_len] for start, loader in self.phases]
        return {**super().state_dict(), "curriculum": schedule}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()["curriculum"]
        if state.get("curriculum") != mine:
            raise ValueError(
                f"data state mismatch: checkpoint has curriculum={state.get('curriculum')}, this loader "
                f"has {mine}"
            )
        super().load_state_dict(state)


def check_curriculum(batch_size: int, seq_len: int, steps: list[int], seq_lens: list[int]) -> None:
    """A length curriculum's schedule, checked: as many steps as lengths, steps rising from >= 1, and each
    length dividing the tokens of a step (``batch_size * seq_len``) into whole windows."""
    if len(steps) != len(seq_lens):
        raise ValueError(
            f"curriculum: {len(steps)} step(s) {steps} but {len(seq_lens)} seq_len(s) {seq_lens}; give one "
            "window length per step"
        )
    if any(s < 1 for s in steps) or any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"curriculum steps must rise from >= 1, got {steps}")
    per_step = batch_size * seq_len
    for n in seq_lens:
        if n < 1 or per_step % n:
            raise ValueError(
                f"curriculum seq_len {n} does not divide the {per_step} tokens of a step "
                f"(batch_size {batch_size} x seq_len {seq_len}) into whole windows"
            )


class EvalWindows:
    """A fixed, deterministic set of non-overlapping held-out windows; see the module docstring.

    Iterating yields (inputs, targets) batches, each (<= batch_size, seq_len) int64.
    ``num_windows``: windows on this rank; ``n_target_tokens``: targets on this rank.
    ``what`` names the tokens in errors and warnings (default "held-out stream": the trainer's split).
    """

    def __init__(
        self,
        tokens: TokenStream | np.ndarray,
        *,
        seq_len: int,
        num_windows: int | None = None,
        batch_size: int = 8,
        rank: int = 0,
        world_size: int = 1,
        bytes_per_token: float | None = None,
        what: str = "held-out stream",
    ):
        self.tokens = _as_tokens(tokens)
        _check_rank(rank, world_size)
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
        available = (self.tokens.shape[0] - 1) // seq_len
        if available < 1:
            raise ValueError(
                f"{what} has {self.tokens.shape[0]} tokens; seq_len={seq_len} needs {seq_len + 1}"
            )
        wanted = available if num_windows is None else num_windows
        if wanted < 1:
            raise ValueError(f"num_windows must be >= 1, got {num_windows}")
        if wanted > available:
            log.warning(
                "%s has room for %d windows of %d tokens; evaluating %d, not %d",
                what,
                available,
                seq_len,
                available,
                wanted,
            )
            wanted = available
        self.total_windows = wanted
        grid = (np.arange(wanted, dtype=np.int64) * available) // wanted  # evenly spread, distinct
        self.starts = (grid * seq_len)[rank::world_size]
        self.seq_len, self.batch_size = seq_len, batch_size
        if bytes_per_token is None and isinstance(tokens, TokenStream):
            bytes_per_token = tokens.bytes_per_token
        self.bytes_per_token = bytes_per_token

    @property
    def num_windows(self) -> int:
        return int(self.starts.shape[0])

    @property
    def n_target_tokens(self) -> int:
        return self.num_windows * self.seq_len

    def __len__(self) -> int:
        return math.ceil(self.num_windows / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        for i in range(0, self.num_windows, self.batch_size):
            yield _windows(self.tokens, self.starts[i : i + self.batch_size], self.seq_len)

    def bits_per_byte(self, mean_loss: float) -> float:
        """Bits per byte of a mean token NLL (nats) over these windows."""
        if self.bytes_per_token is None:
            raise ValueError("bytes_per_token unknown: pass it, or build EvalWindows from a TokenStream")
        return bits_per_byte(mean_loss, self.bytes_per_token)
