"""bitsandbytes' import-time "Failed to load CPU gemm_4bit_forward" line is dropped, and nothing else is."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from ledgerspec.derivations.stack.quiet import LOGGER, MESSAGE, quiet_bitsandbytes

NOISY = "Failed to load CPU gemm_4bit_forward"


def _stderr(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


@pytest.mark.slow
def test_import_is_quiet() -> None:
    """``import peft`` imports bitsandbytes, which logs the line on this machine's CPU."""
    plain = _stderr("import peft")
    if NOISY not in plain:
        pytest.skip("this CPU/bitsandbytes does not log the kernels-community line (no AVX512-BF16?)")
    quiet = _stderr(
        "from ledgerspec.derivations.stack.quiet import quiet_bitsandbytes; quiet_bitsandbytes(); import peft"
    )
    assert NOISY not in quiet, quiet


@pytest.mark.slow
def test_derivations_import_peft_quietly() -> None:
    """A derivation that imports peft (``lora_config``, used by resolve, estimate, measure) prints nothing."""
    text = "ledgerspec: intake/v1\\nmethod: {kind: LoRA, rank: 8, target_modules: [q_proj]}\\n"
    code = (
        "from ledgerspec.derivations.stack.build import lora_config; "
        "from ledgerspec.contract.document import from_text; "
        f"lora_config(from_text('{text}', 'x.yaml'))"
    )
    assert NOISY not in _stderr(code)


def test_only_that_record_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    quiet_bitsandbytes()
    quiet_bitsandbytes()  # idempotent: one filter
    logger = logging.getLogger(LOGGER)
    assert sum(type(f).__name__ == "_DropKernelsWarning" for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        logger.warning(MESSAGE + ": %s. Please make sure ...", "No module named 'kernels'")
        logger.warning("some other bitsandbytes warning")
        logging.getLogger("bitsandbytes.other").warning(MESSAGE + " (another logger)")
    assert [r.getMessage() for r in caplog.records] == [
        "some other bitsandbytes warning",
        MESSAGE + " (another logger)",
    ]
