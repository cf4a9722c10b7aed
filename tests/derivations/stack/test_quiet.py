"""bitsandbytes' import-time "Failed to load CPU gemm_4bit_forward" line is dropped, and nothing else is."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ledgerspec.derivations.stack.quiet import LOGGER, MESSAGE, quiet_bitsandbytes, without_hub_kernels

NOISY = "Failed to load CPU gemm_4bit_forward"
REPO = Path(__file__).resolve().parents[3]


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


#: a stand-in for the Hugging Face ``kernels`` package that records every ``get_kernel`` call on stderr
FAKE_KERNELS = (
    "import sys\n"
    "def get_kernel(repo, *a, **k):\n"
    "    print('GET_KERNEL', repo, file=sys.stderr)\n"
    "    raise OSError('no network in this test')\n"
)


@pytest.mark.slow
def test_importing_bitsandbytes_fetches_no_hub_kernel(tmp_path: Path) -> None:
    """Where ``kernels`` is installed (transformers 5.25 requires it), a plain ``import bitsandbytes`` asks the Hub
    for ``kernels-community/quantization-bitsandbytes`` on a CPU with AVX512-BF16; through :func:`quiet_bitsandbytes`
    it does not, and ``kernels`` is importable again after it. Fresh processes, a recording ``kernels`` package."""
    package = tmp_path / "kernels"
    package.mkdir()
    (package / "__init__.py").write_text(FAKE_KERNELS, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}

    def run(code: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc

    plain = run("import bitsandbytes")
    if "GET_KERNEL" not in plain.stderr:
        pytest.skip("this CPU/bitsandbytes asks for no hub kernel at import (no AVX512-BF16?)")
    quiet = run(
        "from ledgerspec.derivations.stack.quiet import quiet_bitsandbytes\n"
        "quiet_bitsandbytes()\n"
        "import kernels\n"
        "print(kernels.get_kernel.__name__)\n"
    )
    assert "GET_KERNEL" not in quiet.stderr, quiet.stderr
    assert NOISY not in quiet.stderr, quiet.stderr
    assert quiet.stdout.split() == ["get_kernel"]


def test_kernels_is_hidden_only_inside_the_block() -> None:
    """Inside :func:`without_hub_kernels` ``import kernels`` fails; after it ``sys.modules`` is as it was."""
    sentinel = object()
    for before in (None, sentinel):
        if before is None:
            sys.modules.pop("kernels", None)
        else:
            sys.modules["kernels"] = sentinel  # type: ignore[assignment]
        try:
            with without_hub_kernels():
                with pytest.raises(ImportError):
                    import kernels  # noqa: F401
            assert sys.modules.get("kernels") is before
        finally:
            sys.modules.pop("kernels", None)
