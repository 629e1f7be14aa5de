"""Crash-safe training checkpoints.

Layout: ``run_dir/checkpoints/step_XXXXXXXX/`` (step zero-padded to 8 digits) holding

- ``model.safetensors``: the model weights. Tensors that are exact aliases of an earlier entry (tied
  weights: same storage, offset, shape, strides) are stored once and listed in the file's metadata
  (``titans.aliases``), and come back as the very same tensor object; other tensors that share storage or
  are non-contiguous views are saved as contiguous copies (safetensors refuses shared storage).
- ``trainer.pt``: ``trainer_state`` via ``torch.save`` (optimizer, scheduler, data position, RNG states
  from ``capture_rng_state()``, ...). numpy arrays become tensors and numpy scalars Python numbers, so the
  file loads with ``torch.load(weights_only=True)``.
- ``meta.json``: ``{"format", "step", "config", "files": {name: {"size", "sha256"}}, "torch", "created"}``.

Atomicity: everything is written into a hidden temp folder in ``checkpoints/`` (same filesystem), each
file and the folder are fsynced, then the folder is renamed into place with ``os.replace``; a kill at any
moment leaves either the complete new checkpoint or none (a leftover ``.tmp-*`` folder is ignored by
every reader and removed by the next successful save). A write that fails (a full disk) raises
``CheckpointWriteError`` naming the folder and the cause, and leaves nothing of the new checkpoint.

Pruning, only after the new checkpoint is in place, keeps it and the newest undamaged older ones, up to
``keep_last`` in all. Damaged checkpoints never count toward ``keep_last``: older damaged ones are
deleted, and ones with a higher step than the new checkpoint (left by an earlier, longer run whose last
checkpoints were damaged) are left alone until the run reaches their step and replaces them. One
process (rank 0) writes a run's checkpoints.

Public API (names are stable): ``save_checkpoint``, ``load_checkpoint``, ``verify_checkpoint``,
``latest_checkpoint``, ``list_checkpoints``, ``Checkpoint``, ``CheckpointError``, ``CheckpointWriteError``,
``capture_rng_state``, ``restore_rng_state``.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titans._fs import ordinary_mode, save_safetensors

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
# what `titans eval ppl` / `eval context` write into a run folder by default (the context's PNG beside its
# JSON): a run started again with --overwrite removes them with its own files
EVAL_PPL_FILE = "eval_ppl.json"
EVAL_CONTEXT_FILE = "eval_context.json"
MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_ALIASES_KEY = "titans.aliases"
log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, truncated or corrupted (the message names the file)."""


class CheckpointWriteError(OSError, CheckpointError):
    """A checkpoint could not be written (the disk is full, ...); nothing of it was kept. An OSError whose
    ``errno`` is the OS error number when known (``errno.ENOSPC`` for a full disk), else None."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(*((errno, message) if errno is not None else (message,)))
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return type(self), (self.message, self.errno)


_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


class _KeepWriteError:
    """A file for ``torch.save`` that keeps the OSError of a write that failed: torch's zip writer reports
    it as a failed assertion of its own ("inline_container.cc ... unexpected pos"), without the errno that
    tells a full disk (ENOSPC), a used-up quota (EDQUOT) or a file-size limit (EFBIG) apart."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _write_failure(e: BaseException, where: Path) -> CheckpointWriteError:
    """Why writing into ``where`` failed, in words. safetensors reports the OS error inside its own
    exception's text, and torch.save's zip writer can report a full disk as a failed assertion of its
    own ("inline_container.cc ... unexpected pos"), so besides the errno the text is read and the free
    space looked at (before the failed write's files are removed)."""
    code = e.errno if isinstance(e, OSError) else None
    text = str(e)
    if code is None and ("os error 28" in text or "No space left" in text):
        code = errno.ENOSPC
    if code is None:
        try:
            if shutil.disk_usage(where.parent).free < 1 << 20:  # what a non-root user may still write
                code = errno.ENOSPC
        except OSError:
            pass
    if code in _DISK_FULL:
        cause = "the disk is full" + (" (or the quota is used up)" if code != errno.ENOSPC else "")
    else:
        cause = f"the write failed ({type(e).__name__}: {text})"
    return CheckpointWriteError(
        f"could not write checkpoint {str(where)!r}: {cause}; nothing of it was kept, and the checkpoints "
        "already there are untouched",
        errno=code,
    )


@dataclass
class Checkpoint:
    step: int
    model_state: dict[str, torch.Tensor]
    trainer_state: dict[str, Any]
    config: dict[str, Any]
    path: Path
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def weights_id(self) -> str | None:
        """What identifies the weights: the SHA-256 meta.json records for model.safetensors (None in a
        checkpoint without one). Saved states and sessions record it, to refuse other weights' memory."""
        return (self.meta.get("files") or {}).get(MODEL_FILE, {}).get("sha256")


# --------------------------------------------------------------------------------------------- RNG state
def capture_rng_state() -> dict[str, Any]:
    """The state of Python ``random``, numpy's global RNG, torch CPU and (if available) every CUDA device."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np.asarray(np_state["state"]["key"]).astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``capture_rng_state`` captured; the CUDA part only where CUDA is available."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_state["bit_generator"],
            "state": {"key": np.asarray(np_state["key"], dtype=np.uint32), "pos": int(np_state["pos"])},
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        }
    )
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda")
    if cuda is not None:
        if not torch.cuda.is_available():
            log.warning("checkpoint holds CUDA RNG states but CUDA is not available; not restored")
        else:
            if len(cuda) != torch.cuda.device_count():
                log.warning(
                    "checkpoint has %d CUDA RNG states, %d devices", len(cuda), torch.cuda.device_count()
                )
            for i, s in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s.cpu(), i)


# --------------------------------------------------------------------------------------------- helpers
def _fsync(path: Path, directory: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        if directory:  # some platforms cannot open folders; the rename is still atomic there
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _prepare_tensors(model_state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors safetensors accepts, {alias name: stored name}); see the module docstring."""
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[tuple] = set()
    for name, t in model_state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"model_state[{name!r}] is a {type(t).__name__}, not a tensor")
        t = t.detach()
        if t.numel() == 0:
            out[name] = t.cpu().clone()
            continue
        storage = (t.device, t.untyped_storage().data_ptr())
        view = (storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if view in seen:
            aliases[name] = seen[view]
            continue
        seen[view] = name
        whole = (
            t.is_contiguous()
            and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        )
        if whole and storage not in storages:
            out[name] = t.cpu()
        else:  # a view into, or a second view of, some storage: save an independent copy
            out[name] = t.cpu().contiguous().clone()
        storages.add(storage)
    return out, aliases


def _numpy_free(obj: Any) -> Any:
    """numpy arrays -> tensors, numpy scalars -> Python numbers, recursively (for weights_only loading)."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj).copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return type(obj)((k, _numpy_free(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_numpy_free(v) for v in obj)
    return obj


def _step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def run_folder_of(checkpoint: str | Path) -> Path:
    """The run folder of a checkpoint a run saved (``<run>/checkpoints/step_N``), else the checkpoint's own
    folder (one copied out of its run): where results about it go by default."""
    path = Path(checkpoint)
    return path.parent.parent if path.parent.name == CHECKPOINTS else path


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders of a run, oldest step first (not verified)."""
    return [p for _, p in _step_dirs(Path(run_dir))]


# --------------------------------------------------------------------------------------------- save
def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    config: dict[str, Any],
    keep_last: int | None = 3,
) -> Path:
    """Write the checkpoint for ``step`` atomically and prune to the newest ``keep_last`` (None: keep all).

    Returns the checkpoint folder ``run_dir/checkpoints/step_XXXXXXXX``. Saving a step that already has a
    checkpoint replaces it.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    try:  # as meta.json will hold it (keys as strings), so that its digest is the one a load computes
        config = json.loads(json.dumps(config))
    except (TypeError, ValueError) as e:
        raise ValueError(f"config must be JSON-serializable: {e}") from e
    tensors, aliases = _prepare_tensors(model_state)
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    except OSError as e:
        raise _write_failure(e, final) from e
    ordinary_mode(tmp)  # mkdtemp's folder is private; the checkpoint is an ordinary folder
    old = None
    try:
        save_safetensors(tensors, tmp / MODEL_FILE, {"format": "pt", _ALIASES_KEY: json.dumps(aliases)})
        with open(tmp / TRAINER_FILE, "wb") as f:
            writer = _KeepWriteError(f)
            try:
                torch.save(_numpy_free(trainer_state), writer)
            except RuntimeError as e:  # its own assertion, "unexpected pos": the OS error says why
                raise (writer.error or e) from e
        files = {}
        for name in (MODEL_FILE, TRAINER_FILE):
            ordinary_mode(tmp / name)  # safetensors writes its file private (0600)
            _fsync(tmp / name)
            files[name] = {"size": (tmp / name).stat().st_size, "sha256": _sha256_file(tmp / name)}
        meta = {
            "format": FORMAT_VERSION,
            "step": step,
            "config": config,
            "config_sha256": _config_digest(config),
            "files": files,
            "torch": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        _fsync(tmp / META_FILE)
        _fsync(tmp, directory=True)
        if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
            old = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=root))
            os.replace(final, old / final.name)
        os.replace(tmp, final)
        _fsync(root, directory=True)
    except BaseException as e:
        failure = _write_failure(e, final) if isinstance(e, Exception) else None  # before freeing tmp
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not final.exists():
            os.replace(old / final.name, final)  # put the previous checkpoint of this step back
        if failure is not None:
            raise failure from e
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    _remember_good(final)
    _prune(root, keep_last, step)
    return final


# Checkpoints this process wrote or hashed and found good, by folder and its files' sizes and modification
# times: pruning asks whether a checkpoint is damaged, and hashing a large checkpoint at every save would
# be slow. (A file rewritten since changes its key; bits that rot in place do not.)
_GOOD: set[tuple] = set()


def _meta_key(path: Path) -> tuple | None:
    try:
        stats = [(path / name).stat() for name in (META_FILE, MODEL_FILE, TRAINER_FILE)]
    except OSError:
        return None
    return (str(path.resolve()), *((st.st_size, st.st_mtime_ns) for st in stats))


def _remember_good(path: Path) -> None:
    key = _meta_key(path)
    if key is not None:
        _GOOD.add(key)


def _is_good(path: Path) -> bool:
    key = _meta_key(path)
    if key is None:
        return False
    if key not in _GOOD:
        try:
            verify_checkpoint(path)
        except CheckpointError:
            return False
        _GOOD.add(key)
    return True


def _prune(root: Path, keep_last: int | None, step: int) -> None:
    """Keep checkpoint ``step`` (just written) and the newest good older ones, ``keep_last`` in all;
    delete the other older ones. Checkpoints with higher steps are left alone and not counted."""
    if keep_last is not None:
        kept = 1
        for s, path in reversed(_step_dirs(root.parent)):
            if s >= step:
                continue
            if kept < keep_last and _is_good(path):
                kept += 1
            else:
                shutil.rmtree(path, ignore_errors=True)
    for p in root.iterdir():  # leftovers of writes killed mid-way (one writer per run)
        if p.name.startswith((".tmp-step_", ".old-step_")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def _config_digest(config: Any) -> str:
    """sha256 of a config in canonical JSON: the files' hashes do not cover meta.json's own config."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# --------------------------------------------------------------------------------------------- load
def _read_meta(path: Path) -> dict[str, Any]:
    meta_path = path / META_FILE
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {str(path)!r} does not exist")
    if not meta_path.is_file():
        raise CheckpointError(f"{str(meta_path)!r} is missing: incomplete checkpoint")
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
        for name in (MODEL_FILE, TRAINER_FILE):
            int(files[name]["size"]), str(files[name]["sha256"])
        int(meta["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{str(meta_path)!r} is corrupted or incomplete ({type(e).__name__}: {e})"
        ) from e
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{str(meta_path)!r}: unsupported checkpoint format {meta.get('format')!r}")
    config = meta.get("config") or {}
    if not isinstance(config, dict):
        wrong = ["config"]
    else:  # a list or a string here failed later with a TypeError or AttributeError
        wrong = [k for k in ("train", "model") if k in config and not isinstance(config[k], dict)]
        wrong += [] if isinstance(config.get("tokenizer") or {}, dict) else ["tokenizer"]  # null: the default
    if wrong:
        raise CheckpointError(
            f"{str(meta_path)!r} is corrupted: its {', '.join(wrong)} must be a JSON object"
        )
    # a config edited or damaged since the save (another window, another width) was loaded as the run's
    if "config_sha256" in meta and _config_digest(meta.get("config")) != meta["config_sha256"]:
        raise CheckpointError(
            f"{str(meta_path)!r}: its config does not match the sha256 it records (edited or damaged since "
            "the checkpoint was written)"
        )
    return meta


def _check_file(path: Path, expected: dict, data: bytes | None = None, hash_it: bool = True) -> None:
    if not path.is_file():
        raise CheckpointError(f"{str(path)!r} is missing")
    size = path.stat().st_size if data is None else len(data)
    if size != expected["size"]:
        raise CheckpointError(
            f"{str(path)!r} is truncated or damaged: {size} bytes, expected {expected['size']}"
        )
    if not hash_it:
        return
    digest = _sha256_file(path) if data is None else hashlib.sha256(data).hexdigest()
    if digest != expected["sha256"]:
        raise CheckpointError(f"{str(path)!r} is corrupted: sha256 {digest[:16]}... does not match meta.json")


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check a checkpoint's files against the sizes and hashes in its meta.json; returns the meta."""
    path = Path(path)
    meta = _read_meta(path)
    for name in (MODEL_FILE, TRAINER_FILE):
        _check_file(path / name, meta["files"][name])
    return meta


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    # safetensors layout: 8-byte little-endian header length, then a JSON header
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]).get("__metadata__") or {}


def load_checkpoint(
    path: str | Path,
    *,
    map_location: str | torch.device = "cpu",
    weights_only: bool = True,
    verified: bool = False,
) -> Checkpoint:
    """Load and verify a checkpoint folder; raises CheckpointError naming the damaged file.

    ``weights_only=False`` (unpickling arbitrary objects in trainer.pt) only for checkpoints you trust.
    ``verified=True``: the caller has just passed this folder through ``verify_checkpoint`` (or got it
    from ``latest_checkpoint``), so the files are not hashed a second time; their sizes still are checked.
    """
    path = Path(path)
    meta = _read_meta(path)
    blobs = {}
    for name in (MODEL_FILE, TRAINER_FILE):
        try:
            blobs[name] = (path / name).read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"{str(path / name)!r} is missing") from None
        _check_file(path / name, meta["files"][name], blobs[name], hash_it=not verified)
    try:
        from safetensors.torch import load as load_safetensors

        model_state = load_safetensors(blobs[MODEL_FILE])
        aliases = json.loads(_safetensors_metadata(blobs[MODEL_FILE]).get(_ALIASES_KEY, "{}"))
    except Exception as e:  # the hash matched, so this is a file written by something else
        raise CheckpointError(f"{str(path / MODEL_FILE)!r} is not a readable safetensors file: {e}") from e
    if str(map_location) != "cpu":
        model_state = {k: v.to(map_location) for k, v in model_state.items()}
    for alias, target in aliases.items():
        model_state[alias] = model_state[target]
    try:
        trainer_state = torch.load(
            io.BytesIO(blobs[TRAINER_FILE]), map_location=map_location, weights_only=weights_only
        )
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{str(path / TRAINER_FILE)!r} holds objects that weights_only loading refuses ({e}); "
            "if you trust this checkpoint, load it with weights_only=False"
        ) from e
    return Checkpoint(
        step=int(meta["step"]),
        model_state=model_state,
        trainer_state=trainer_state,
        config=meta.get("config") or {},
        path=path,
        meta=meta,
    )


_RELISTS = 5  # listings of a run folder whose writer prunes what a reader picked


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint of ``run_dir`` that passes ``verify_checkpoint``; damaged ones are skipped
    with a warning. None when there is no good checkpoint. A checkpoint that vanishes while it is read
    (the run's writer pruned it after saving a newer one, `keep_last`) is no damage: the folder is listed
    again."""
    for _ in range(_RELISTS):
        for _, path in reversed(_step_dirs(Path(run_dir))):
            try:
                verify_checkpoint(path)
            except (CheckpointError, OSError) as e:
                if not path.exists():
                    break  # pruned since it was listed: list again
                if not isinstance(e, CheckpointError):
                    raise
                log.warning("skipping damaged checkpoint %s: %s", path, e)
                continue
            _remember_good(path)
            return path
        else:
            return None
    return None
