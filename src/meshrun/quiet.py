"""Lines a user cannot act on, kept off the run's output.

torchao 0.18 registers two of its enums as pytree constants when it is imported, and torch
2.13-2.15 logs a deprecation warning for each (``<enum 'KernelPreference'> is an Enum subclass
and is now natively supported by torch.compile ...``). transformers imports torchao whenever it
is installed, so every Hugging Face model built by a run (and every ``--precision fp8`` run)
printed both lines on every rank. The filter sits on torch's pytree logger by name, so it is in
place before torch or torchao is imported; any other message of that logger still shows."""

from __future__ import annotations

import logging

PYTREE_LOGGER = "torch.utils._pytree"
ENUM_NOTICE = "is an Enum subclass and is now natively supported by torch.compile"


class _EnumConstantNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return ENUM_NOTICE not in record.getMessage()


def quiet_library_notices() -> None:
    """Install the filter (once per process)."""
    logger = logging.getLogger(PYTREE_LOGGER)
    if not any(isinstance(f, _EnumConstantNotice) for f in logger.filters):
        logger.addFilter(_EnumConstantNotice())
