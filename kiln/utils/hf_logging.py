"""The Hugging Face logger a warning goes to when it is one of HF's own warnings.

An HF user's log filters, `logging.set_verbosity_*` and tests (`patch("transformers.trainer.logger.warning")`)
look for HF's warnings on HF's logger names (`transformers.trainer`, `transformers.trainer_callback`,
`transformers.trainer_utils`). Where kiln gives one of those warnings, it goes there when transformers is
already imported, and to kiln's own logger otherwise; transformers is never imported for it."""

from __future__ import annotations

import logging
import sys


def hf_logger(name: str, own: logging.Logger) -> logging.Logger:
    """HF's logger `name` when transformers is imported, else `own`."""
    return logging.getLogger(name) if "transformers" in sys.modules else own
