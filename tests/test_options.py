"""Each config option is written once: its help text and bounds in the field's metadata (`option`), the
listings derived from them, and the neural memory built from the config's ``memory_*`` fields."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from titans.layers.memory import NeuralMemory
from titans.models import config as model_config
from titans.models.blocks import make_memory
from titans.models.config import TitansConfig
from titans.training import config as train_config
from titans.training.config import TrainConfig
from titans.validation import check_bounds, describe_bounds, field_help, option

CONFIGS = (TitansConfig, TrainConfig)


@pytest.mark.parametrize("cls", CONFIGS)
def test_every_field_carries_its_help(cls):
    for f in dataclasses.fields(cls):
        assert isinstance(f.metadata.get("help"), str) and f.metadata["help"].strip(), f.name


def test_the_help_listings_are_the_metadata():
    assert {f.name: f.metadata["help"] for f in dataclasses.fields(TitansConfig)} == model_config.FIELD_HELP
    assert {f.name: f.metadata["help"] for f in dataclasses.fields(TrainConfig)} == train_config.FIELD_HELP
    assert list(model_config.FIELD_HELP) == [f.name for f in dataclasses.fields(TitansConfig)]


def _outside(f: dataclasses.Field) -> list[float]:
    """Values just past each bound of a field's metadata (whole numbers for an int field)."""
    meta, step = f.metadata, 1 if "int" in str(f.type).replace(" ", "").split("|") else 0.5
    out = []
    if "min" in meta:
        out.append(meta["min"] - step)
    if "above" in meta:
        out.append(meta["above"])
    if "max" in meta:
        out.append(meta["max"] + step)
    if "below" in meta:
        out.append(meta["below"])
    return out


def _bounded(cls):
    return [
        f for f in dataclasses.fields(cls) if any(k in f.metadata for k in ("min", "above", "max", "below"))
    ]


def _build(cls, **kw):
    if cls is TrainConfig and {"carry_reset_every", "carry_groups"} & set(kw):
        kw["carry_state"] = True  # those apply with a carried state only
    return cls(**kw)


@pytest.mark.parametrize("cls", CONFIGS)
def test_bounds_from_the_metadata_are_enforced(cls):
    """Every bounded field refuses a value just outside its bounds with an error naming the field and the
    bound, and takes its default."""
    bounded = _bounded(cls)
    assert len(bounded) >= 10  # the bounds are in the metadata, not only in __post_init__
    for f in bounded:
        for bad in _outside(f):
            with pytest.raises(ValueError, match=rf"{cls.__name__}\.{f.name} must be") as e:
                _build(cls, **{f.name: bad})
            assert str(e.value).endswith((f"got {bad!r}", f"got {float(bad)!r}"))
        _build(cls, **{f.name: f.default})


def test_a_bound_refuses_what_it_should():
    @dataclasses.dataclass
    class Made:
        count: int = option(1, help="a count", min=1)
        rate: float = option(0.5, help="a rate", above=0, below=1)
        cap: float | None = option(None, help="a cap", min=0)
        clip: float | None = option(1.0, help="a clip", above=0)  # null allowed, not the default

    check_bounds(Made())
    check_bounds(Made(clip=None))
    for kw, message in (
        ({"count": 0}, "Made.count must be a positive integer, got 0"),
        ({"count": 2.0}, "Made.count must be a positive integer, got 2.0"),
        ({"count": True}, "Made.count must be a positive integer, got True"),
        ({"rate": 1.0}, r"Made.rate must be a number in \(0, 1\), got 1.0"),
        ({"rate": math.nan}, "Made.rate must be a number in"),
        ({"cap": -0.1}, "Made.cap must be a number >= 0 or null, got -0.1"),
    ):
        with pytest.raises(ValueError, match=message):
            check_bounds(Made(**kw))
    assert field_help(Made) == {"count": "a count", "rate": "a rate", "cap": "a cap", "clip": "a clip"}
    assert describe_bounds({"min": 0, "max": 1}) == "in [0, 1]"


def _old_make_memory(cfg: TitansConfig) -> NeuralMemory:
    """The hand-kept list `make_memory` used to be: the reference the derived arguments must match."""
    heads = cfg.memory_heads or cfg.heads
    return NeuralMemory(
        cfg.dim,
        heads=heads,
        head_dim=cfg.memory_head_dim or cfg.dim // heads,
        depth=cfg.memory_depth,
        expansion=cfg.memory_expansion,
        chunk_size=cfg.chunk_size,
        activation=cfg.memory_activation,
        conv_kernel=cfg.memory_conv_kernel,
        momentum=cfg.memory_momentum,
        forgetting=cfg.memory_forgetting,
        forget_to=cfg.memory_forget_to,
        max_lr=cfg.memory_max_lr,
        theta_init=cfg.memory_theta_init,
        eta_init=cfg.memory_eta_init,
        alpha_init=cfg.memory_alpha_init,
        surprise_clip=cfg.memory_surprise_clip,
        residual=cfg.memory_residual,
        write=cfg.memory_write,
        checkpoint_every=cfg.memory_checkpoint_every,
        rule=cfg.memory_rule,
        backend=cfg.memory_backend,
        surprise_threshold=cfg.memory_surprise_threshold,
        max_norm=cfg.memory_max_norm,
    )


def test_memory_arguments_come_from_the_memory_fields():
    params = set(inspect.signature(NeuralMemory.__init__).parameters) - {"self", "dim"}
    kwargs = TitansConfig().memory_kwargs()
    assert set(kwargs) <= params
    memory_fields = {f.name for f in dataclasses.fields(TitansConfig) if f.name.startswith("memory_")}
    not_arguments = {"memory_layers", "memory_monitor_max_norm"}  # where the memory goes; monitoring
    assert {n.removeprefix("memory_") for n in memory_fields - not_arguments} | {"chunk_size"} == set(kwargs)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(
            memory_heads=2, memory_head_dim=8, memory_depth=1, memory_momentum=False, memory_forget_to="init"
        ),
        dict(memory_rule="moneta", memory_surprise_clip=None, memory_residual=True, memory_conv_kernel=0),
        dict(
            memory_surprise_threshold=0.5, memory_max_norm=3.0, memory_write=False, memory_checkpoint_every=2
        ),
    ],
)
def test_derived_memory_matches_the_hand_kept_list(overrides):
    """Same hyperparameters, same initial weights, same outputs as the explicit argument list."""
    cfg = TitansConfig(dim=32, heads=4, chunk_size=4, segment_len=8, window=8, **overrides)
    torch.manual_seed(3)
    new = make_memory(cfg)
    torch.manual_seed(3)
    old = _old_make_memory(cfg)
    assert new.extra_repr() == old.extra_repr()
    new_state, old_state = new.state_dict(), old.state_dict()
    assert list(new_state) == list(old_state)
    assert all(torch.equal(new_state[k], old_state[k]) for k in old_state)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        assert torch.equal(new(x)[0], old(x)[0])
