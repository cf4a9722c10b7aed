"""A GPTQ base in the training step: the ``QuantLinear`` a GPTQ checkpoint loads, tensor by tensor, and its kernel.

:func:`replace_with_gptq_linear` replaces the ``nn.Linear`` layers of the decoder blocks (what optimum's
``GPTQQuantizer.convert_model`` converts: the Linear layers under ``block_name_to_quantize``; the LM head and the
embeddings stay dense, as :mod:`ledgerspec.derivations.stack.census` counts them) by :class:`GptqQuantLinear`, whose
buffers are those of the upstream ``QuantLinear`` and whose forward/backward allocate what the declared kernel
allocates. The layer holds plain tensors (int32 codes, float16 scales), so the same module runs on real CPU
tensors (``measure --device cpu``) and under ``FakeTensorMode`` (``estimate``). PEFT's ``GPTQLoraLinear``
(``peft/tuners/lora/gptq.py``) wraps it, through LoRA's custom-module dispatch (:data:`lora_custom_modules`),
exactly as ``dispatch_gptq`` wraps a GPTQModel ``BaseQuantLinear``.

Buffers (fms-acceleration's vendored GPTQModel ``nn_modules/qlinear/qlinear_tritonv2.py`` ``QuantLinear.__init__``
at 876e2ed, lines 63-95; AutoGPTQ ``qlinear_tritonv2.py`` is the same): ``qweight`` int32 ``(in / 32 * bits,
out)``, ``qzeros`` int32 ``(ceil(in / group), out / 32 * bits)``, ``scales`` float16 ``(ceil(in / group), out)``,
``g_idx`` int32 ``(in,)`` (with and without ``desc_act``), ``bias`` float16 ``(out,)`` when the Linear had one (a
buffer, not a parameter). :func:`ledgerspec.derivations.stack.quant_storage.gptq_bytes` gives the same bytes.

Kernels (``base_model.quantization.kernel``):

- ``triton_v2``: ``QuantLinear.forward`` -> ``QuantLinearFunction.apply`` (``triton_utils/dequant.py`` at 876e2ed):
  ``quant_matmul_248`` dequantizes the whole weight into a new float16 ``(in, out)`` tensor (``dequant248``:
  ``out = torch.empty((infeatures, outfeatures), device="cuda", dtype=torch.float16)``) and returns ``input @ W``;
  ``ctx.save_for_backward(qweight, scales, qzeros, g_idx)`` keeps only the layer's own buffers; backward
  dequantizes again and returns ``grad_output @ W.t()``. Then ``out.half()`` and ``+ bias``.
- ``torch``: GPTQModel 7.x ``TorchLinear._forward_eager`` (``gptqmodel/nn_modules/qlinear/torch.py`` at f4c327a,
  lines 326-347; its ``TritonV2Linear`` subclasses ``TorchLinear`` and calls this forward in training mode,
  ``tritonv2.py`` lines 53 and 176-180): ``weights = self.dequantize_weight()`` (on CUDA with triton:
  ``_dequantize_weight_triton``, one ``(in, out)`` tensor in the scales' dtype), ``torch.matmul(x, weights)``: plain
  autograd, so the matmul keeps the dequantized weight for backward (its input requires grad under LoRA) until the
  layer's backward has run, and ``out.add_(bias)``. The eager CPU dequantization's intermediates (unpacked int8
  codes, gathered scales and zeros) are not modelled: the CUDA path's one workspace is.
"""

from __future__ import annotations

import math
from typing import Any

#: the kernels the step models (``base_model.quantization.kernel``)
KERNELS = ("triton_v2", "torch")


def _classes() -> tuple[Any, Any]:
    import torch

    def dequantize(qweight: Any, scales: Any, g_idx: Any) -> Any:
        """The dense ``(in, out)`` weight in the scales' dtype: one new tensor, as the CUDA dequant kernels write it
        (``dequant248``'s ``torch.empty((infeatures, outfeatures))``). Its values do not matter to memory: it is
        filled in place from a broadcast view of the first group's scales, without another tensor."""
        w = torch.empty((g_idx.shape[0], scales.shape[1]), dtype=scales.dtype, device=qweight.device)
        w.copy_(scales[0].expand_as(w))
        return w

    def _as_int32(t: Any) -> Any:
        return t if t.dtype == torch.int32 else t.view(torch.int32)

    class QuantLinearFunction(torch.autograd.Function):
        """``triton_utils/dequant.py`` ``QuantLinearFunction`` (fms-acceleration 876e2ed), with the same tensors."""

        @staticmethod
        def forward(ctx: Any, x: Any, qweight: Any, scales: Any, qzeros: Any, g_idx: Any) -> Any:
            w = dequantize(qweight, scales, g_idx)  # quant_matmul_248: W = dequant248(...)
            out = x @ w
            del w
            ctx.save_for_backward(qweight, scales, qzeros, g_idx)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            qweight, scales, _qzeros, g_idx = ctx.saved_tensors
            grad_x = None
            if ctx.needs_input_grad[0]:
                w = dequantize(qweight, scales, g_idx)  # quant_matmul_248(..., transpose=True)
                grad_x = grad @ w.t()
                del w
            return grad_x, None, None, None, None

    class GptqQuantLinear(torch.nn.Module):
        """A GPTQ ``QuantLinear`` (the buffers of the upstream layer; see the module docstring)."""

        def __init__(
            self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool, kernel: str
        ) -> None:
            super().__init__()
            if bits not in (2, 4, 8):
                raise ValueError(f"the GPTQ kernels pack 2, 4 or 8 bits, got {bits}")
            self.in_features, self.out_features = in_features, out_features
            self.infeatures, self.outfeatures = in_features, out_features  # the upstream names
            self.bits, self.kernel = bits, kernel
            self.group_size = group_size if group_size not in (-1, 0) else in_features
            groups = math.ceil(in_features / self.group_size)
            self.register_buffer("qweight", torch.zeros((in_features // 32 * bits, out_features), dtype=torch.int32))
            self.register_buffer("qzeros", torch.zeros((groups, out_features // 32 * bits), dtype=torch.int32))
            self.register_buffer("scales", torch.zeros((groups, out_features), dtype=torch.float16))
            self.register_buffer("g_idx", torch.zeros(in_features, dtype=torch.int32))
            if bias:
                self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float16))
            else:
                self.bias = None

        def forward(self, x: Any) -> Any:
            out_shape = (*x.shape[:-1], self.out_features)
            x2 = x.reshape(-1, x.shape[-1])
            if self.kernel == "triton_v2":
                # as float parameters under FSDP (:func:`as_fsdp_parameters`): viewed back as int32 first, as the
                # plugin's patched forward does (a view: no new memory)
                qweight, qzeros = _as_int32(self.qweight), _as_int32(self.qzeros)
                out = QuantLinearFunction.apply(x2, qweight, self.scales, qzeros, self.g_idx)
                out = out.half().reshape(out_shape)
                return out + self.bias if self.bias is not None else out
            w = dequantize(self.qweight, self.scales, self.g_idx)  # TorchLinear._forward_eager
            if w.dtype != x2.dtype:
                w = w.to(x2.dtype)
            out = torch.matmul(x2, w).reshape(out_shape)
            if self.bias is not None:
                out.add_(self.bias if self.bias.dtype == out.dtype else self.bias.to(out.dtype))
            return out

    return GptqQuantLinear, QuantLinearFunction


_CLASSES: tuple[Any, Any] | None = None


def quant_linear_class() -> Any:
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _classes()
    return _CLASSES[0]


def lora_custom_modules() -> dict[Any, Any]:
    """LoRA's custom-module mapping that makes PEFT wrap :class:`GptqQuantLinear` in its ``GPTQLoraLinear``."""
    from peft.tuners.lora.gptq import GPTQLoraLinear

    return {quant_linear_class(): GPTQLoraLinear}


def older_lora_forward(self: Any, x: Any) -> Any:
    """PEFT 0.13.2's ``GPTQLoraLinear.forward`` (``peft/tuners/lora/gptq.py`` at v0.13.2, unchanged until 0.16.0):
    the declared stack's LoRA on a QuantLinear (known difference ``peft-gptq-lora-input-cast``)."""
    import torch

    result = self.quant_linear_module(x)
    if self.disable_adapters:
        return result
    for active_adapter in self.active_adapters:
        if active_adapter not in self.lora_A.keys():
            continue
        lora_A = self.lora_A[active_adapter]
        lora_B = self.lora_B[active_adapter]
        dropout = self.lora_dropout[active_adapter]
        scaling = self.scaling[active_adapter]
        requires_conversion = not torch.is_autocast_enabled()
        if requires_conversion:
            expected_dtype = result.dtype
            x = x.to(lora_A.weight.dtype)
        output = lora_B(lora_A(dropout(x)))
        if requires_conversion:
            output = output.to(expected_dtype)
        output = output * scaling
        result += output
    return result


def use_older_lora_forward(model: Any) -> int:
    """Give every ``GPTQLoraLinear`` of ``model`` PEFT 0.13.2's forward (:func:`older_lora_forward`); how many."""
    import types

    from peft.tuners.lora.gptq import GPTQLoraLinear

    count = 0
    for module in model.modules():
        if isinstance(module, GPTQLoraLinear):
            module.forward = types.MethodType(older_lora_forward, module)
            count += 1
    return count


def replace_decoder_linears(model: Any, make: Any, skip_modules: tuple[str, ...] = ()) -> int:
    """Replace every ``nn.Linear`` of the decoder blocks by ``make(linear)``, created on the linear's device (the
    meta device while the model is there), but those whose name contains one of ``skip_modules`` and the routers of a
    declared transformers 4's MoE blocks (float16 in GPTQ checkpoints; kept dense for AWQ too,
    :func:`ledgerspec.derivations.stack.legacy_moe.routers`); how many."""
    import torch

    from ledgerspec.derivations.stack.build import decoder_layers
    from ledgerspec.derivations.stack.legacy_moe import routers

    found = decoder_layers(model)
    if found is None:
        return 0
    dense = routers(model)
    count = 0
    for parent_name, parent in list(found[1].named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is not torch.nn.Linear or id(child) in dense or any(s and s in full for s in skip_modules):
                continue
            with torch.device(child.weight.device):
                new = make(child)
            setattr(parent, name, new)
            count += 1
    return count


def as_fsdp_parameters(model: Any, dtype: Any) -> int:
    """fms-acceleration's FSDP preparation of a GPTQ model: every ``QuantLinear``'s ``qweight`` and ``qzeros`` become
    frozen ``nn.Parameter`` views in the loaded float ``dtype`` (the same bytes), so that FSDP flattens and shards them
    with the layer's other parameters, and the forward views them back as int32; ``scales``, ``g_idx`` and ``bias``
    stay buffers, whole on every rank (``autogptq_utils.py`` at 876e2ed: ``PATCH_FOR_FSDP_TRITON_V2 = ["qweight",
    "qzeros"]`` line 34, ``build_patch_to_view_tensor_to_parameter_for_fsdp_gptq`` lines 68-85 and
    ``patch_forward_to_view_attributes_before_call``, registered by ``framework_plugin_autogptq.py``'s
    ``model_loader`` when ``world_size > 1`` and ``ACCELERATE_USE_FSDP``). Returns how many layers."""
    import torch

    cls = quant_linear_class()
    count = 0
    for module in model.modules():
        if not isinstance(module, cls):
            continue
        for name in ("qweight", "qzeros"):
            t = getattr(module, name)
            setattr(module, name, torch.nn.Parameter(t.view(dtype), requires_grad=False))
        count += 1
    return count


def replace_with_gptq_linear(
    model: Any, bits: int, group_size: int, kernel: str, skip_modules: tuple[str, ...] = ()
) -> int:
    """Replace the ``nn.Linear`` layers of the decoder blocks by :class:`GptqQuantLinear` (on the meta device when
    the model is there); returns how many. The model is marked as transformers/fms mark a GPTQ model
    (``quantization_method = "gptq"``: PEFT's ``prepare_model_for_kbit_training`` then upcasts nothing)."""
    cls = quant_linear_class()
    count = replace_decoder_linears(
        model,
        lambda child: cls(child.in_features, child.out_features, bits, group_size, child.bias is not None, kernel),
        skip_modules,
    )
    model.quantization_method = "gptq"
    model.is_loaded_in_4bit = bits == 4
    return count


__all__ = [
    "KERNELS",
    "as_fsdp_parameters",
    "lora_custom_modules",
    "older_lora_forward",
    "quant_linear_class",
    "replace_decoder_linears",
    "replace_with_gptq_linear",
    "use_older_lora_forward",
]
