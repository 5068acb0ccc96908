"""Lines a user cannot act on, kept off the run's output.

torchao 0.18 registers two of its enums as pytree constants when it is imported, and torch
2.13-2.15 logs a deprecation warning for each (``<enum 'KernelPreference'> is an Enum subclass
and is now natively supported by torch.compile ...``). transformers imports torchao whenever it
is installed, so every Hugging Face model built by a run (and every ``--precision fp8`` run)
printed both lines on every rank. The filter sits on torch's pytree logger by name, so it is in
place before torch or torchao is imported; any other message of that logger still shows.

torchao's wheels hold CUDA kernels (``_C_mxfp8``, ``_C_cutlass_90a``) that a CPU build of torch
cannot load, and torchao logs a warning naming each file at import: two lines on every CPU run
that imports transformers with the ``lora`` extra installed. They are dropped where torch has no
CUDA (nothing there could run those kernels); on a CUDA build they still show, since there a
kernel that does not load is worth knowing.

PEFT 0.21 asks transformers 5's models ``is_gradient_checkpointing``, which warns that the name
is deprecated (a FutureWarning per adapter loaded, in `meshrun generate` and export's checks):
PEFT's to change, not the user's."""

from __future__ import annotations

import logging
import sys
import warnings

PYTREE_LOGGER = "torch.utils._pytree"
ENUM_NOTICE = "is an Enum subclass and is now natively supported by torch.compile"


class _EnumConstantNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return ENUM_NOTICE not in record.getMessage()


TORCHAO_LOGGER = "torchao"
KERNEL_NOTICE = "Failed to load "


class _CudaKernelsOnCpu(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        torch = sys.modules.get("torch")
        cpu_build = torch is not None and getattr(getattr(torch, "version", None), "cuda", "") is None
        return not (cpu_build and record.getMessage().startswith(KERNEL_NOTICE) and ".so" in record.getMessage())


DEPRECATED_NAME = r"`is_gradient_checkpointing` is deprecated"


def quiet_library_notices() -> None:
    """Install the filters (once per process)."""
    warnings.filterwarnings("ignore", message=DEPRECATED_NAME, category=FutureWarning)
    for name, kind in ((PYTREE_LOGGER, _EnumConstantNotice), (TORCHAO_LOGGER, _CudaKernelsOnCpu)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
