"""What a trained model needs to run, below both training and inference (which never import each other):

- `titans.runtime.device`: `resolve_device` (``auto`` -> this process's GPU when there is one, else cpu).
- `titans.runtime.checkpoint`: the crash-safe checkpoint folder the trainer writes and everyone reads.
- `titans.runtime.loading`: a model and its tokenizer back from a checkpoint (``load_trained``).
- `titans.runtime.sampling`: the sampling defaults shared by `titans generate`, the server and the sample
  printed after training.
"""
