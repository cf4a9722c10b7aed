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


def test_compile_is_deferred_to_the_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the block ``torch.compile`` only wraps; the real one runs at the first call, once, with the same
    options (as a call and as a decorator factory), and is itself again after the block."""
    torch = pytest.importorskip("torch")
    from ledgerspec.derivations.stack.quiet import deferred_compile

    calls: list[tuple[object, dict[str, object]]] = []

    def real(model: object = None, **options: object) -> object:
        calls.append((model, options))
        return lambda *a: ("compiled", a)

    monkeypatch.setattr(torch, "compile", real)

    def double(x: int) -> int:
        return 2 * x

    with deferred_compile():
        plain = torch.compile(double, dynamic=False)
        factory = torch.compile(fullgraph=True)(double)
    assert torch.compile is real and calls == []
    assert plain.__name__ == "double"
    assert plain(3) == ("compiled", (3,)) and plain(4) == ("compiled", (4,))
    assert factory(5) == ("compiled", (5,))
    assert calls == [(double, {"dynamic": False}), (double, {"fullgraph": True})]


@pytest.mark.slow
def test_importing_peft_loads_no_compiler() -> None:
    """bitsandbytes 0.50 wraps kernels in ``torch.compile`` at import: through :func:`quiet_bitsandbytes` that loads
    no TorchInductor compiler (``torch._inductor.compile_fx``), which a plain ``import peft`` does."""
    probe = "import sys; {}import peft; print('torch._inductor.compile_fx' in sys.modules)"
    plain = subprocess.run([sys.executable, "-c", probe.format("")], capture_output=True, text=True, timeout=120)
    quiet = subprocess.run(
        [
            sys.executable,
            "-c",
            probe.format("from ledgerspec.derivations.stack.quiet import quiet_bitsandbytes; quiet_bitsandbytes(); "),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.stdout.split()[-1] == "True", plain.stderr
    assert quiet.stdout.split()[-1] == "False", quiet.stderr
