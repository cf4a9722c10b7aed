"""bitsandbytes' import-time "Failed to load CPU gemm_4bit_forward" line is dropped, and nothing else is."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from ledgerspec.derivations.stack.quiet import LOGGER, MESSAGE, quiet_bitsandbytes

NOISY = "Failed to load CPU gemm_4bit_forward"


COMPILER = "torch._inductor.compile_fx"
#: a derivation that imports peft (``lora_config``, used by resolve, estimate, measure), in a fresh process
THROUGH_A_DERIVATION = (
    "import sys\n"
    "from ledgerspec.derivations.stack.build import lora_config\n"
    "from ledgerspec.contract.document import from_text\n"
    "lora_config(from_text('ledgerspec: intake/v1\\nmethod: {kind: LoRA, rank: 8, target_modules: [q_proj]}\\n', "
    "'x.yaml'))\n"
    f"print({COMPILER!r} in sys.modules)\n"
)


@pytest.fixture(scope="module")
def imports() -> dict[str, subprocess.CompletedProcess[str]]:
    """``import peft`` in a fresh process, plainly and through a derivation: what each printed, and whether it
    loaded TorchInductor's compiler."""
    out = {}
    for name, code in (
        ("plain", f"import sys, peft; print({COMPILER!r} in sys.modules)"),
        ("quiet", THROUGH_A_DERIVATION),
    ):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out[name] = proc
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("quiet-imports")  # its module fixture, once
def test_import_is_quiet(imports: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """``import peft`` imports bitsandbytes, which logs the line on this machine's CPU; a derivation that imports
    peft prints nothing."""
    if NOISY not in imports["plain"].stderr:
        pytest.skip("this CPU/bitsandbytes does not log the kernels-community line (no AVX512-BF16?)")
    assert NOISY not in imports["quiet"].stderr, imports["quiet"].stderr


@pytest.mark.slow
@pytest.mark.xdist_group("quiet-imports")  # its module fixture, once
def test_importing_peft_loads_no_compiler(imports: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """bitsandbytes 0.50 wraps kernels in ``torch.compile`` at import: a plain ``import peft`` loads TorchInductor's
    compiler, a derivation (through :func:`quiet_bitsandbytes`) does not."""
    assert imports["plain"].stdout.split()[-1] == "True"
    assert imports["quiet"].stdout.split()[-1] == "False"


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
