"""Import bitsandbytes (directly, or through peft) without its one import-time warning, and without compiling.

On a CPU with AVX512-BF16, bitsandbytes 0.50 tries to fetch an optional kernel from the Hugging Face
``kernels`` package while it is imported and, when that package is absent, logs through the logger
``bitsandbytes.backends.cpu.ops``::

    Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. ...

With no logging configured, Python's last-resort handler prints it on stderr for every ``ledgerspec``
command that imports peft or bitsandbytes. The kernel only speeds up 4-bit matmuls on the CPU; no figure
depends on it. :func:`quiet_bitsandbytes` drops exactly that record (every other message of that logger,
and every other logger, is untouched). Call it before ``import peft`` / ``import bitsandbytes``; it is
idempotent.

It also imports bitsandbytes itself, with ``torch.compile`` deferred (:func:`deferred_compile`): bitsandbytes 0.50
wraps four of its default kernels in ``torch.compile`` while it is imported
(``bitsandbytes/backends/default/ops.py``, ``_try_torch_compile``), which loads TorchInductor's compiler (about
0.5 s of a cold ``ledgerspec estimate``) whether or not a kernel ever runs; peft imports bitsandbytes whenever it
is installed (``peft/helpers.py``). Deferred, each kernel is compiled when it is first called, with the same
arguments: nothing changes but when the compiler is loaded.

And it imports bitsandbytes without reaching the network: where the ``kernels`` package is installed (transformers
5.25 requires it), that same import-time attempt is a real one, ``kernels.get_kernel(
"kernels-community/quantization-bitsandbytes")``: Hub requests (an organisation lookup, the user agent's registry)
and a download, on every command, ``--offline`` or not. ledgerspec never runs that kernel (it is the CPU's 4-bit
matrix-vector product of batch-one inference), so the import sees ``kernels`` as absent (:func:`without_hub_kernels`)
and takes bitsandbytes' own fallback, exactly as on a machine without the package; ``kernels`` itself is importable
again right after.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

LOGGER = "bitsandbytes.backends.cpu.ops"
MESSAGE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _DropKernelsWarning(logging.Filter):
    """Drops the one "Failed to load CPU gemm_4bit_forward" record; lets every other record through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(MESSAGE)


def quiet_bitsandbytes() -> None:
    """Install the filter on bitsandbytes' CPU-ops logger (once per process), then import bitsandbytes (if
    installed) with ``torch.compile`` deferred."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, _DropKernelsWarning) for f in logger.filters):
        logger.addFilter(_DropKernelsWarning())
    import sys

    if "bitsandbytes" in sys.modules:
        return
    with deferred_compile(), without_hub_kernels():
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:  # not installed: what needs it says so where it is used
            pass


@contextlib.contextmanager
def without_hub_kernels() -> Iterator[None]:
    """Inside the block ``import kernels`` fails with ImportError (as if the package were not installed); after it,
    ``sys.modules`` holds for ``kernels`` what it held before (the module, or nothing)."""
    import sys

    missing = object()
    before = sys.modules.get("kernels", missing)
    sys.modules["kernels"] = None  # type: ignore[assignment]  # the import system's "not importable" marker
    try:
        yield
    finally:
        if before is missing:
            sys.modules.pop("kernels", None)
        else:
            sys.modules["kernels"] = before  # type: ignore[assignment]


@contextlib.contextmanager
def deferred_compile() -> Iterator[None]:
    """Inside the block, ``torch.compile(fn, **options)`` returns ``fn`` wrapped so that the real
    ``torch.compile(fn, **options)`` runs at the first call (and its compiled function from then on); as a
    decorator factory (``torch.compile(**options)``) likewise. ``torch.compile`` is itself again after the block."""
    import torch

    real = torch.compile

    def deferred(model: Any = None, **options: Any) -> Any:
        if model is None:
            return lambda fn: deferred(fn, **options)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **options))
            return compiled[0](*args, **kwargs)

        return call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real
