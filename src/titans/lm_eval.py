"""``python -m titans.lm_eval ARGS``: lm-eval's command line with the ``titans`` model type registered (the
same as ``titans lm-eval ARGS``; see ``titans.evaluation.lm_eval_adapter``).

``python -m titans.lm_eval --install-hook`` (``--remove-hook``) makes a plain ``lm_eval --model titans``
work in this Python environment (``titans.evaluation.lm_eval_hook``)."""

from __future__ import annotations

import sys


def _hook_command(argv: list[str]) -> int | None:
    """--install-hook / --remove-hook; None for anything else (lm-eval's arguments)."""
    # imported here: only the two hook commands need it, lm-eval's own arguments do not
    from titans.evaluation.lm_eval_hook import install_hook, remove_hook

    if argv == ["--install-hook"]:
        for path in install_hook():
            print(f"wrote {path}")
        print("`lm_eval --model titans ...` now works in this environment")
        return 0
    if argv == ["--remove-hook"]:
        for path in remove_hook():
            print(f"removed {path}")
        return 0
    return None


if __name__ == "__main__":
    code = _hook_command(sys.argv[1:])
    if code is None:
        from titans.evaluation.lm_eval_adapter import main

        code = main()
    sys.exit(code)
