"""The upstream GPTQ ``QuantLinear`` that fms-acceleration trains through, loaded from its own source files.

``tests/data/gptq/fms_gptq/`` holds files copied unchanged from fms-acceleration at commit 876e2ed
(``plugins/accelerated-peft/src/fms_acceleration_peft/gptqmodel/``, Apache-2.0, adapted there from GPTQModel), four
of them the layer:
``nn_modules/qlinear/__init__.py`` (``BaseQuantLinear``), ``nn_modules/qlinear/qlinear_tritonv2.py`` (``QuantLinear``),
``nn_modules/triton_utils/dequant.py`` (``QuantLinearFunction``, ``quant_matmul_248``, ``dequant248`` and the
triton kernel) and ``nn_modules/triton_utils/mixin.py``; beside them, from the same commit, ``models/mixtral.py`` (the
Mixtral definition: which Linear layers GPTQModel quantizes, read as text) and the plugin's ``autogptq_utils.py``
(``plugins/accelerated-peft/src/fms_acceleration_peft/``: its FSDP preparation of a QuantLinear, :func:`fsdp_patch`).
The layer's files are loaded here as they are, with two stand-ins for what a CPU machine lacks:

- ``triton``: a stub module. ``@triton.jit`` makes the kernel a launcher whose ``kernel[grid](...)`` runs nothing:
  the triton kernel writes its output buffer and allocates no tensor, so every allocation of the layer is the
  Python code's own (the ``torch.empty`` of ``dequant248``, the matmuls, what autograd keeps). The dequantized values
  are left uninitialised; memory does not depend on them.
- ``device="cuda"``: the ``torch`` name of ``dequant.py`` is a proxy of torch whose ``empty`` creates on the CPU what
  the source asks to create on ``cuda`` (``dequant248``'s ``torch.empty((infeatures, outfeatures), device="cuda",
  ...)``, its only tensor); everything else is torch itself.

Nothing of ledgerspec is imported: the figures counted on these layers are the truth for
:mod:`ledgerspec.derivations.engine.gptq`.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

from tests.support import modules_in_place

ROOT = Path(__file__).resolve().parent.parent / "data" / "gptq" / "fms_gptq"
PACKAGE = "_fms_gptq_truth"
#: the fms-acceleration commit the files were copied from
COMMIT = "876e2ed6fc4e966785e3f4315f5ee3cdf8e3d097"


def _triton_stub() -> tuple[types.ModuleType, types.ModuleType]:
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")

    class Config:
        def __init__(self, kwargs: dict[str, Any], num_warps: int = 4, **_: Any) -> None:
            self.kwargs, self.num_warps = kwargs, num_warps

    class Launcher:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kwargs: None  # the kernel writes its output; it allocates no tensor

    triton.Config = Config  # type: ignore[attr-defined]
    triton.jit = lambda fn=None, **_: Launcher(fn) if fn is not None else Launcher  # type: ignore[attr-defined]
    triton.autotune = lambda *a, **k: lambda fn: fn  # type: ignore[attr-defined]
    triton.cdiv = lambda a, b: -(-a // b)  # type: ignore[attr-defined]
    language.constexpr = object  # type: ignore[attr-defined]
    triton.language = language  # type: ignore[attr-defined]
    return triton, language


def _load(name: str, path: Path, package: bool = False) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(path.parent)] if package else None
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _package(name: str, path: Path) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    sys.modules[name] = module
    return module


_LOADED: dict[str, Any] = {}


def upstream() -> dict[str, Any]:
    """``{"QuantLinear": ..., "QuantLinearFunction": ..., "dequant248": ...}`` from the upstream files."""
    if _LOADED:
        return _LOADED
    triton, language = _triton_stub()
    with modules_in_place({"triton": triton, "triton.language": language}):
        _package(PACKAGE, ROOT)
        _package(f"{PACKAGE}.nn_modules", ROOT / "nn_modules")
        _package(f"{PACKAGE}.nn_modules.triton_utils", ROOT / "nn_modules" / "triton_utils")
        _load(f"{PACKAGE}.nn_modules.qlinear", ROOT / "nn_modules" / "qlinear" / "__init__.py", package=True)
        dequant = _load(
            f"{PACKAGE}.nn_modules.triton_utils.dequant", ROOT / "nn_modules" / "triton_utils" / "dequant.py"
        )
        _load(f"{PACKAGE}.nn_modules.triton_utils.mixin", ROOT / "nn_modules" / "triton_utils" / "mixin.py")
        tritonv2 = _load(
            f"{PACKAGE}.nn_modules.qlinear.qlinear_tritonv2", ROOT / "nn_modules" / "qlinear" / "qlinear_tritonv2.py"
        )
    setattr(dequant, "torch", _torch_on_cpu())  # noqa: B010
    _LOADED.update(
        QuantLinear=tritonv2.QuantLinear,
        QuantLinearFunction=dequant.QuantLinearFunction,
        dequant248=dequant.dequant248,
    )
    return _LOADED


def fsdp_patch() -> Any:
    """fms-acceleration's ``build_patch_to_view_tensor_to_parameter_for_fsdp_gptq(module, torch_dtype)`` from its own
    ``autogptq_utils.py`` (copied unchanged from 876e2ed, ``tests/data/gptq/fms_gptq/autogptq_utils.py``): it turns a
    QuantLinear's ``qweight``/``qzeros`` into float parameters for FSDP and returns the forward that views them back.
    Its one import this machine lacks, ``fms_acceleration.model_patcher`` (only to register the rule), is a stub."""
    if "fsdp_patch" in _LOADED:
        return _LOADED["fsdp_patch"]
    stub = types.ModuleType("fms_acceleration.model_patcher")
    for name in ("ModelPatcher", "ModelPatcherRule", "ModelPatcherTrigger"):
        setattr(stub, name, type(name, (), {}))
    with modules_in_place(
        {"fms_acceleration": types.ModuleType("fms_acceleration"), "fms_acceleration.model_patcher": stub}
    ):
        utils = _load(f"{PACKAGE}_autogptq_utils", ROOT / "autogptq_utils.py")
    _LOADED["fsdp_patch"] = utils.build_patch_to_view_tensor_to_parameter_for_fsdp_gptq
    return _LOADED["fsdp_patch"]


def _torch_on_cpu() -> types.ModuleType:
    """torch, but ``empty(..., device="cuda")`` creates on the CPU."""
    import torch

    proxy = types.ModuleType("torch_on_cpu")

    def empty(*args: Any, **kwargs: Any) -> Any:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.empty(*args, **kwargs)

    setattr(proxy, "__getattr__", lambda name: getattr(torch, name))  # noqa: B010
    proxy.empty = empty  # type: ignore[attr-defined]
    return proxy
