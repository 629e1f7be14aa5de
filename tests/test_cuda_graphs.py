"""`TrainConfig.cuda_graphs`: each micro-step replayed as a CUDA graph trains exactly like eager steps.

The equality tests need a CUDA device (skipped without one); the config checks run everywhere."""

from __future__ import annotations

import pytest
import torch

from micro_train import MICRO_MODEL, micro_config
from titans import TitansConfig, TitansLM
from titans.training.config import TrainConfig
from titans.training.cuda_graphs import GraphedMicroStep
from titans.training.trainer import Trainer

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("token-cache")


def test_config_refuses_what_a_graph_cannot_do(tmp_path, cache_dir):
    with pytest.raises(ValueError, match="cuda_graphs: expected a bool"):
        TrainConfig(cuda_graphs="yes")
    with pytest.raises(ValueError, match="cuda_graphs: not with fsdp"):
        TrainConfig(cuda_graphs=True, fsdp=True)
    with pytest.raises(ValueError, match="needs one process on one CUDA device; this run has cpu"):
        Trainer(micro_config(tmp_path, cache_dir, cuda_graphs=True, device="cpu"))
    model = TitansLM(TitansConfig(dim=32, depth=1, heads=2, segment_len=16, window=16, chunk_size=8))
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device"):
        GraphedMicroStep(model, (2, 16), 1, None, 256)


def run(tmp_path, cache_dir, name: str, stop_at: int | None = None, resume: bool = False, **overrides):
    # exact float32 matmuls (tf32 off): eager and replayed steps may pick different cuBLAS kernels, whose
    # TF32 roundings would differ by more than the float rounding the comparisons allow
    cfg = micro_config(tmp_path / name, cache_dir, device="cuda", batch_size=4, steps=4, warmup_steps=1,
                       eval_every=1000, eval_windows=2, ckpt_every=2, tf32=False, **overrides)  # fmt: skip
    trainer = Trainer(cfg, resume=resume)
    return trainer, trainer.train(stop_at=stop_at)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "variant, accum, dtype, every",
    [
        ("mac", 1, "float32", None),
        ("mac", 2, "float32", None),
        ("mag", 1, "float32", None),
        ("mac", 1, "bfloat16", None),
        ("lmm", 1, "float32", 2),  # the memory's checkpointed backward recomputes inside the graph
    ],
)
def test_graphed_steps_match_eager_steps(tmp_path, cache_dir, variant, accum, dtype, every):
    """Same losses and weights after 4 steps. In float32 to float rounding (the GPU's eager backward
    itself is not bitwise reproducible); in bf16, where that rounding is coarser, to 1e-2."""
    model = {**MICRO_MODEL, "memory_checkpoint_every": every}
    kw = dict(variant=variant, grad_accum=accum, dtype=dtype, model=model)
    eager, eager_result = run(tmp_path, cache_dir, "eager", **kw)
    graphed, graphed_result = run(tmp_path, cache_dir, "graphed", cuda_graphs=True, **kw)
    assert graphed.graphed_step is not None and eager.graphed_step is None
    tol = 1e-5 if dtype == "float32" else 1e-2
    assert graphed_result.step_losses == pytest.approx(eager_result.step_losses, rel=tol), (
        eager_result.step_losses,
        graphed_result.step_losses,
    )
    for (name, a), b in zip(eager.model.state_dict().items(), graphed.model.state_dict().values()):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 10 * tol * (1 + a.float().abs().max().item()), (name, err)


@pytest.mark.cuda
@needs_cuda
def test_graphed_resume_matches_uninterrupted(tmp_path, cache_dir):
    _, straight = run(tmp_path, cache_dir, "straight", cuda_graphs=True)
    _, first = run(tmp_path, cache_dir, "split", stop_at=2, cuda_graphs=True)
    _, rest = run(tmp_path, cache_dir, "split", resume=True, cuda_graphs=True)
    assert first.step_losses + rest.step_losses == pytest.approx(straight.step_losses, rel=1e-5, abs=1e-6)


@pytest.mark.cuda
@needs_cuda
def test_graphed_step_checks_its_batches():
    torch.manual_seed(0)
    cfg = TitansConfig(dim=32, depth=1, heads=2, segment_len=16, window=16, chunk_size=8)
    model = TitansLM(cfg).cuda()
    step = GraphedMicroStep(model, (2, 16), 1, torch.bfloat16, cfg.vocab_size)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    loss = step(tokens[:, :-1], tokens[:, 1:])
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in step.params)
    with pytest.raises(ValueError, match=r"captured for batches of \(2, 16\)"):
        step(tokens[:1, :-1], tokens[:1, 1:])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\), got \[256, 256\]"):
        step(torch.full((2, 16), 256), tokens[:, 1:])
