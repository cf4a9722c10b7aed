"""AutoAWQ's GEMM ``QuantLinear`` (``WQLinear_GEMM``, ``WQLinearMMFunction``), loaded from its own source file.

``tests/data/awq/gemm.py`` is ``awq/modules/linear/gemm.py`` of AutoAWQ (https://github.com/casper-hansen/AutoAWQ,
commit 88e4c76b20755db275574e6a03c83c84ba3bece5, MIT), copied unchanged. It is loaded as it is, with stand-ins for
the modules it imports that a CPU machine lacks:

- ``awq.utils.module.try_import("awq_ext")`` returns a stub of the CUDA extension whose ``dequantize_weights_cuda``
  returns a new uninitialised float16 ``(in, out)`` tensor: the one tensor the CUDA op allocates (its output); the
  values do not matter to memory. Its ``gemm_forward_cuda`` (the fused path below 1,024 rows) is not stubbed: the
  truth covers the dequantizing path only.
- ``awq.utils.utils`` and ``awq.utils.packing_utils``: the names the file imports, unused on this path.
- ``awq.modules.triton.gemm`` is absent (the file then takes ``TRITON_AVAILABLE = False``, as without triton).

Nothing of ledgerspec is imported: the figures counted on this layer are the truth for
:mod:`ledgerspec.derivations.engine.awq`.
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path
from typing import Any

from tests.support import modules_in_place

SOURCE = Path(__file__).resolve().parent.parent / "data" / "awq" / "gemm.py"
COMMIT = "88e4c76b20755db275574e6a03c83c84ba3bece5"

_LOADED: dict[str, Any] = {}


def _awq_ext() -> types.ModuleType:
    import torch

    ext = types.ModuleType("awq_ext")

    def dequantize_weights_cuda(qweight: Any, scales: Any, qzeros: Any, *_: Any) -> Any:
        return torch.empty((qweight.shape[0], qweight.shape[1] * 8), dtype=torch.float16, device=qweight.device)

    setattr(ext, "dequantize_weights_cuda", dequantize_weights_cuda)  # noqa: B010
    return ext


def upstream() -> dict[str, Any]:
    """``{"WQLinear_GEMM": ..., "WQLinearMMFunction": ...}`` from the upstream file."""
    if _LOADED:
        return _LOADED
    ext = _awq_ext()
    stubs = {
        "awq": types.ModuleType("awq"),
        "awq.utils": types.ModuleType("awq.utils"),
        "awq.utils.module": types.ModuleType("awq.utils.module"),
        "awq.utils.utils": types.ModuleType("awq.utils.utils"),
        "awq.utils.packing_utils": types.ModuleType("awq.utils.packing_utils"),
    }
    stubs["awq"].__path__ = []
    stubs["awq.utils"].__path__ = []
    setattr(stubs["awq.utils.module"], "try_import", lambda name: (ext, ""))  # noqa: B010
    setattr(stubs["awq.utils.utils"], "get_best_device", lambda: "cpu")  # noqa: B010
    setattr(stubs["awq.utils.packing_utils"], "dequantize_gemm", None)  # noqa: B010
    with modules_in_place(stubs):
        spec = importlib.util.spec_from_file_location("_autoawq_gemm_truth", SOURCE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    assert module.awq_ext is ext and not module.TRITON_AVAILABLE
    _LOADED.update(WQLinear_GEMM=module.WQLinear_GEMM, WQLinearMMFunction=module.WQLinearMMFunction)
    return _LOADED
