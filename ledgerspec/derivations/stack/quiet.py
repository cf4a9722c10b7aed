"""Import bitsandbytes (directly, or through peft) without its one import-time warning.

On a CPU with AVX512-BF16, bitsandbytes 0.50 tries to fetch an optional kernel from the Hugging Face
``kernels`` package while it is imported and, when that package is absent, logs through the logger
``bitsandbytes.backends.cpu.ops``::

    Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. ...

With no logging configured, Python's last-resort handler prints it on stderr for every ``ledgerspec``
command that imports peft or bitsandbytes. The kernel only speeds up 4-bit matmuls on the CPU; no figure
depends on it. :func:`quiet_bitsandbytes` drops exactly that record (every other message of that logger,
and every other logger, is untouched). Call it before ``import peft`` / ``import bitsandbytes``; it is
idempotent and imports nothing heavy.
"""

from __future__ import annotations

import logging

LOGGER = "bitsandbytes.backends.cpu.ops"
MESSAGE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _DropKernelsWarning(logging.Filter):
    """Drops the one "Failed to load CPU gemm_4bit_forward" record; lets every other record through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(MESSAGE)


def quiet_bitsandbytes() -> None:
    """Install the filter on bitsandbytes' CPU-ops logger (once per process)."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, _DropKernelsWarning) for f in logger.filters):
        logger.addFilter(_DropKernelsWarning())
