"""Makes a plain ``lm_eval --model titans`` work in one Python environment.

lm-eval (0.4.13) finds models only in its own registry and loads no plugins, so the name ``titans`` is
known only where `titans.evaluation.lm_eval_adapter` was imported first (``titans lm-eval``,
``python -m titans.lm_eval``). `install_hook` writes two small files into the environment's
site-packages: a module with an import hook, and a ``.pth`` line that installs the hook at start-up. The
hook does nothing until lm-eval imports ``lm_eval.models`` (its table of lazily loaded models); then it
adds ``titans`` to that table, as a lazy entry too, so neither titans nor torch is imported unless the
``titans`` model is asked for. ``python -m titans.lm_eval --install-hook`` / ``--remove-hook``.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

HOOK_MODULE = "_titans_lm_eval_hook"
PTH_FILE = "titans-lm-eval.pth"
TARGET = "titans.evaluation.lm_eval_adapter:TitansEvalLM"

HOOK_SOURCE = f'''"""Installed by `python -m titans.lm_eval --install-hook` (titans.evaluation.lm_eval_hook):
adds the `titans` model to lm-eval's registry when lm-eval loads its table of models.
Remove with `python -m titans.lm_eval --remove-hook`."""

import importlib.abc
import sys


class TitansLmEvalHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "lm_eval.models":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            from lm_eval.api.registry import model_registry

            if model_registry.get("titans", None) is None:
                model_registry.register("titans", target="{TARGET}")

        spec.loader.exec_module = exec_module
        return spec


if not any(type(f).__name__ == "TitansLmEvalHook" for f in sys.meta_path):
    sys.meta_path.insert(0, TitansLmEvalHook())
'''


def site_packages() -> Path:
    """This environment's site-packages (the pure-Python library folder)."""
    return Path(sysconfig.get_paths()["purelib"])


def install_hook(site_dir: str | Path | None = None) -> list[Path]:
    """Write the hook module and its ``.pth`` line into `site_dir` (default: `site_packages()`); returns
    the two paths. Writing them again replaces them."""
    folder = Path(site_dir) if site_dir is not None else site_packages()
    module, pth = folder / f"{HOOK_MODULE}.py", folder / PTH_FILE
    module.write_text(HOOK_SOURCE)
    pth.write_text(f"import {HOOK_MODULE}\n")
    return [module, pth]


def remove_hook(site_dir: str | Path | None = None) -> list[Path]:
    """Delete what `install_hook` wrote; returns the paths that were there."""
    folder = Path(site_dir) if site_dir is not None else site_packages()
    gone = [p for p in (folder / f"{HOOK_MODULE}.py", folder / PTH_FILE) if p.exists()]
    for p in gone:
        p.unlink()
    return gone


__all__ = ["install_hook", "remove_hook", "site_packages"]
