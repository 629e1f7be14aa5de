"""The training micro-step (forward, loss, backward) captured once as a CUDA graph and replayed.

The memory variants run their chunks in a Python loop: a 170M MAC step at 4 x 2048 tokens launches ~80K
small kernels, and on an H100 the GPU is busy for a fraction of the step while the CPU launches them. A
CUDA graph records the launches once; each replay issues them all from the driver. See
docs/benchmarks.md (section 6) for what it gains; `benchmarks/gpu_throughput.py` measures it.

What a graph needs, and how this step provides it:
- static shapes and addresses: the micro-batch is copied into fixed input tensors, and the gradients are
  accumulated into `.grad` tensors allocated before capture (the caller zeroes them in place);
- no host synchronisation inside: `TitansLM.forward` skips its token-range check while a capture runs
  (the check runs on every batch before it is copied in, here);
- tensors read by address must outlive the graph: modules' cached tables (the rotary cos/sin) are held.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titans.models.ids import check_token_ids


class GraphedMicroStep:
    """``step(inputs, targets)``: the micro-batch loss, with ``loss / accum``'s gradient added to every
    parameter's ``.grad``, as one CUDA graph replay. Same result as the eager

        with torch.autocast("cuda", dtype): logits, _ = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()); (loss / accum).backward()

    inputs, targets: (rows, seq) token ids, the shape given at construction. The caller zeroes the
    gradients in place (``optimizer.zero_grad(set_to_none=False)``): the graph adds into the tensors that
    existed when it was captured.
    """

    def __init__(
        self,
        model: nn.Module,
        shape: tuple[int, int],
        accum: int,
        autocast_dtype: torch.dtype | None,
        vocab_size: int,
        warmup_steps: int = 3,
    ):
        if warmup_steps < 1:
            raise ValueError(f"GraphedMicroStep: warmup_steps must be >= 1, got {warmup_steps}")
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {device}")
        self.model, self.accum, self.dtype, self.vocab_size = model, accum, autocast_dtype, vocab_size
        self.inputs = torch.zeros(shape, dtype=torch.long, device=device)
        self.targets = torch.zeros(shape, dtype=torch.long, device=device)
        # warm-up on a side stream (the allocator and lazily built tables settle), then the capture;
        # neither changes what training learns: the warm-up's gradients are zeroed, no optimizer steps
        for p in model.parameters():
            p.grad = None
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup_steps):
                self._forward_backward()
        torch.cuda.current_stream(device).wait_stream(side)
        # the parameters the loss reaches; the others keep no gradient (None), so the optimizer skips them
        # as it does in eager steps, rather than decaying them on a zero gradient
        self.params = [p for p in model.parameters() if p.grad is not None]
        for p in self.params:
            p.grad.zero_()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = self._forward_backward()
        for p in self.params:
            p.grad.zero_()
        self._held = [v for m in model.modules() for v in vars(m).values() if isinstance(v, Tensor)]

    def _forward_backward(self) -> Tensor:
        # autocast's weight-cast cache must be off: cached casts would be made once, inside the capture
        with torch.autocast("cuda", dtype=self.dtype or torch.float32, enabled=self.dtype is not None,
                            cache_enabled=False):  # fmt: skip
            logits, _ = self.model(self.inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), self.targets.flatten())
        (loss / self.accum).backward()
        return loss.detach()

    def __call__(self, inputs: Tensor, targets: Tensor) -> Tensor:
        if inputs.shape != self.inputs.shape or targets.shape != self.targets.shape:
            raise ValueError(
                f"GraphedMicroStep: captured for batches of {tuple(self.inputs.shape)}, got inputs "
                f"{tuple(inputs.shape)} and targets {tuple(targets.shape)}"
            )
        check_token_ids(inputs, self.vocab_size)
        self.inputs.copy_(inputs, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        self.graph.replay()
        return self.loss.clone()
