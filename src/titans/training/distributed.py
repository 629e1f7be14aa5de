"""Multi-process training through PyTorch's own engine (torchrun + torch.distributed).

``titans train`` under ``torchrun --nproc_per_node N`` finds RANK / WORLD_SIZE / LOCAL_RANK in the
environment and joins a process group: gloo on CPU, nccl on CUDA (one GPU per process, by local rank).
Each rank takes rows ``rank::world_size`` of the same global batch (``TokenBatches``), so N processes
take the same optimizer step one process would on the whole batch.

Wrapping (``wrap_model``):
- DDP (default): every rank holds the whole model; gradients are averaged across ranks in backward.
- FSDP (``fsdp=True``; for presets that do not fit one device): PyTorch's FSDP2 ``fully_shard`` on every
  residual block and then on the whole model, so parameters, gradients and optimizer state are sharded
  and each block's weights are gathered only while it runs. Checkpoints still hold full (unsharded)
  tensors, gathered with ``torch.distributed.checkpoint.state_dict`` (see ``titans.training.trainer``);
  the optimizer state is keyed by parameter name there, by position without FSDP, and a resume that
  switches fsdp on or off converts it (``optimizer_state_by_name`` / ``optimizer_state_by_position``).
  Meant for CUDA; on CPU it is only useful to check the code path.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titans.layers.memory import NeuralMemory
from titans.runtime.device import resolve_device


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands: rank of world_size (1 and 0 when not distributed) and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_spec: str = "auto") -> DistInfo:
    """Join the torchrun process group if the environment says so; a single process otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_spec, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def shutdown(*, clean: bool = True) -> None:
    """Tear the process group down while the interpreter is fully alive.

    Models, optimizers and FSDP state left in reference cycles would otherwise be freed during
    interpreter finalization, after the process group is gone; freeing gloo work objects that hold
    tensors with Python references then can abort the process ("terminate called without an active
    exception", seen once in CI after a successful FSDP run). So collect them first; then, after a clean
    run, wait for every rank, so that no rank tears its connections down while another still uses them.
    After an error there is no barrier: the other ranks may never reach it.
    """
    gc.collect()
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


@contextlib.contextmanager
def main_first(info: DistInfo) -> Iterator[None]:
    """Rank 0 runs the body first (e.g. builds the token cache); the others run it after a barrier."""
    if not info.is_main:
        barrier(info)
    yield
    if info.is_main:
        barrier(info)


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum of ``values`` over ranks (a copy; unchanged when not distributed)."""
    values = values.detach().clone()
    if info.enabled:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (a collective under torchrun)."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank when ``flag`` is true on some rank (so all ranks stop at the same step)."""
    if not info.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def agree_to_stop(over_budget: bool, signum: int | None, info: DistInfo) -> tuple[bool, int | None]:
    """Whether any rank is over its time budget, and the stop signal some rank got (None: none), the same
    on every rank: one all_reduce of two numbers, called by every rank after every step, so that all
    ranks stop after the same step. A signal can reach the ranks at different moments (a launcher
    forwards it to each in turn); where two ranks got different signals, the larger number wins."""
    local = [int(over_budget), int(signum or 0)]
    if info.enabled:
        t = torch.tensor(local, dtype=torch.int64, device=info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        local = t.tolist()
    return bool(local[0]), (local[1] or None)


def wrap_model(model: nn.Module, info: DistInfo, fsdp: bool = False, carried: bool = False) -> nn.Module:
    """DDP, FSDP2 or the model itself (single process without FSDP). The model is on ``info.device``.
    ``carried``: the model runs from carried states (``TrainConfig.carry_state``), where the memory's learned
    initial weights get no gradient except on the steps that start fresh."""
    if fsdp:
        if not info.enabled:
            raise ValueError("TrainConfig.fsdp needs a process group: launch with torchrun")
        import warnings

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # the mesh on the run's device type: left to itself, FSDP picks the machine's accelerator even for a
        # CPU run (on a one-GPU machine, rank 1 then asks for a second GPU)
        mesh = init_device_mesh(info.device.type, (info.world_size,))
        # The returned memory/attention states hold views; training discards them and nothing writes
        # into them in place, which is the case this warning is about.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [info.device.index] if info.device.type == "cuda" else None
    # a frozen memory (write=False) never uses its gate projection: DDP must not wait for its gradient
    frozen = any(isinstance(m, NeuralMemory) and not m.write for m in model.modules())
    return DDP(model, device_ids=device_ids, find_unused_parameters=frozen or carried)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a DDP wrapper (FSDP2 shards in place: nothing to unwrap)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def no_sync(model: nn.Module, skip: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce of a micro-batch that is not the last one (DDP only)."""
    if skip and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------- optimizer state forms
# Checkpoints hold the optimizer state in one of two forms: without FSDP ``optimizer.state_dict()``, whose
# ``state`` and ``param_groups[i]["params"]`` name each parameter by its position in the optimizer's groups
# (0, 1, ... across the groups in turn), and under FSDP the full state of
# ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``, which names it by its name in
# ``model.named_parameters()`` (FSDP2 keeps the module's names). The tensors are the same full tensors in
# both; a resume that switches fsdp on or off converts the form (`optimizer_state_by_name` /
# `optimizer_state_by_position`), so the run goes on with the very same moments.


def optimizer_param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Per group of ``optimizer``, the names of its parameters in ``model``, in the group's order (the
    names ``get_optimizer_state_dict`` keys them by: ``named_parameters``, a shared tensor under its first
    name)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    if any(id(p) not in name_of for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("the optimizer holds parameters that are not the model's")
    return [[name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def optimizer_state_form(state: dict[str, Any]) -> str:
    """How a saved optimizer state names its parameters: "name" (FSDP's full state dict) or "position"
    (``optimizer.state_dict()``)."""
    ids = [p for g in state["param_groups"] for p in g["params"]] + list(state["state"])
    if ids and all(isinstance(p, str) for p in ids):
        return "name"
    if all(isinstance(p, int) for p in ids):
        return "position"
    raise ValueError("the checkpoint's optimizer state names its parameters neither by name nor by position")


def _check_groups(saved: list[list[Any]], names: list[list[str]]) -> None:
    sizes, want = [len(g) for g in saved], [len(g) for g in names]
    if sizes != want:
        raise ValueError(
            f"the checkpoint's optimizer has groups of {sizes} parameters, this run's of {want}: it was "
            "written for another model"
        )


def optimizer_state_by_name(state: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """``state`` in the form FSDP loads (``set_optimizer_state_dict(..., full_state_dict=True)``): keyed
    by parameter name. ``names``: `optimizer_param_names` of the optimizer it is for. A state already in
    that form is returned as it is."""
    if optimizer_state_form(state) == "name":
        return state
    saved = [list(g["params"]) for g in state["param_groups"]]
    _check_groups(saved, names)
    # positions map to parameters as optimizer.load_state_dict maps them: in the groups' order
    name_at = dict(zip((p for g in saved for p in g), (n for g in names for n in g)))
    return {
        "state": {name_at[k]: v for k, v in state["state"].items()},
        "param_groups": [{**g, "params": [name_at[p] for p in g["params"]]} for g in state["param_groups"]],
    }


def optimizer_state_by_position(state: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """``state`` in the form ``optimizer.load_state_dict`` takes: keyed by position in the groups of the
    optimizer whose parameter names are ``names`` (`optimizer_param_names`). A state already in that form
    is returned as it is; one keyed by name must name, group by group, the same parameters."""
    if optimizer_state_form(state) == "position":
        return state
    saved = [list(g["params"]) for g in state["param_groups"]]
    _check_groups(saved, names)
    for i, (theirs, ours) in enumerate(zip(saved, names)):
        if set(theirs) != set(ours):
            odd = sorted(set(theirs) ^ set(ours))[:4]
            raise ValueError(
                f"the checkpoint's optimizer group {i} holds other parameters than this run's ({odd}): it "
                "was written for another model"
            )
    position = {n: i for i, n in enumerate(n for g in names for n in g)}
    return {
        "state": {position[k]: v for k, v in state["state"].items()},
        # each group lists its parameters in this optimizer's order, so that load_state_dict, which pairs
        # the listed positions with the group's parameters in turn, gives every state to its parameter
        "param_groups": [
            {**g, "params": [position[n] for n in ours]} for g, ours in zip(state["param_groups"], names)
        ],
    }
