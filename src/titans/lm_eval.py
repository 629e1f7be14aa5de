"""``python -m titans.lm_eval ARGS``: lm-eval's command line with the ``titans`` model type registered (the
same as ``titans lm-eval ARGS``; see ``titans.evaluation.lm_eval_adapter``)."""

from __future__ import annotations

import sys

from titans.evaluation.lm_eval_adapter import main

if __name__ == "__main__":
    sys.exit(main())
