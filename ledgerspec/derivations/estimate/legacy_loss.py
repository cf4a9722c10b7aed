"""transformers < 4.49's causal-LM loss, for an estimate whose ledger declares that stack (``software.transformers``).

transformers 4.46-4.48's ``ForCausalLMLoss`` (``src/transformers/loss/loss_utils.py``, 4.48.1 lines 36-39) upcast the
logits to float32 and then made a shifted contiguous copy of them for the cross-entropy; 4.49.0 pads and shifts the
labels instead and only views the float32 logits. The copy is one more float32 tensor of
``batch x (length - 1) x vocab`` elements at the loss, and its gradient goes through the slice's backward (a full-size
float32 gradient) at the start of backward: 1.05 GB for 2 x 4,096 tokens of a 32,000-token vocabulary
(known difference ``transformers-causal-lm-loss-shift-copy``, :mod:`ledgerspec.contract.differences`).

:func:`declared_loss` replaces the installed ``ForCausalLM`` entry of transformers' ``LOSS_MAPPING`` (what
``PreTrainedModel.loss_function`` returns) by :func:`shifted_copy_loss` while a simulation runs, when the ledger
declares a transformers older than 4.49.0 and the installed one is newer. Imports torch only inside functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

KEY = "transformers-causal-lm-loss-shift-copy"
#: before 4.46 the model upcast its head's output itself (the 16-bit logits freed at once)
FLOAT_KEY = "transformers-causal-lm-float-logits-in-model"


def models_shift_copy(doc: Any) -> bool:
    """The declared transformers copies the shifted logits and the installed one does not."""
    from ledgerspec.contract.differences import OLDER
    from ledgerspec.derivations.stack.versions import declared_side, installed_side

    return declared_side(doc, KEY) == OLDER and installed_side(KEY) != OLDER


def models_float_logits(doc: Any) -> bool:
    """The declared transformers upcasts the head's output in the model (< 4.46) and the installed one does not."""
    from ledgerspec.contract.differences import OLDER
    from ledgerspec.derivations.stack.versions import declared_side, installed_side

    return declared_side(doc, FLOAT_KEY) == OLDER and installed_side(FLOAT_KEY) != OLDER


def _output_head(model: Any) -> Any:
    """The causal-LM head of ``model`` (a PeftModel, an FSDP1 wrapper or a plain model), None if it has none."""
    seen = 0
    while seen < 8:  # unwrap FSDP1's ``module`` and PEFT's ``base_model.model``
        seen += 1
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if head is not None:
            return head
        model = getattr(model, "module", None) or getattr(getattr(model, "base_model", None), "model", None)
        if model is None:
            return None
    return None


@contextlib.contextmanager
def float_logits(workload: Any) -> Iterator[None]:
    """transformers < 4.46's causal-LM forward: the head's output upcast to float32 at once (``logits =
    self.lm_head(...).float()``, 4.45.2 ``LlamaForCausalLM.forward``/``MistralForCausalLM.forward``), so the
    16-bit logits are freed before the loss: a forward hook on the workload's head (found when it first runs)
    returns ``output.float()``; the loss then upcasts nothing (``.float()`` of a float32 tensor is itself)."""
    import torch

    found: list[Any] = []

    def hook(module: Any, args: Any, output: Any) -> Any:
        if not found:
            model = getattr(workload, "model", None)
            found.append(_output_head(model) if model is not None else None)
        if module is found[0] and isinstance(output, torch.Tensor) and output.dtype in (torch.bfloat16, torch.float16):
            return output.float()
        return None

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def shifted_copy_loss(
    logits: Any,
    labels: Any,
    vocab_size: int,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: Any = None,
    **kwargs: Any,
) -> Any:
    """The causal-LM loss as transformers < 4.49 computed it: float32 logits, then a shifted contiguous copy.

    Line for line what 4.48.1 holds: ``logits = logits.float()`` rebinds the name, so the full float32 logits stay
    referenced until the function returns, i.e. alive together with the shifted copy and the cross-entropy's
    float32 log-softmax (two float32 logits-sized tensors besides the caller's logits, three at the cross-entropy).
    Measured on the CPU with transformers 4.48.1 (benchmarks/fsdp1_cpu_repro.py): the forward peak is at that
    cross-entropy and holds all three.
    """
    from transformers.loss.loss_utils import fixed_cross_entropy

    logits = logits.float()  # kept alive until the loss returns, as in 4.48.1
    if shift_labels is None:
        shift_logits = logits[..., :-1, :].contiguous()  # the copy that 4.49.0 removed
        shift_labels = labels[..., 1:].contiguous()
    else:
        shift_logits = logits
    flat = shift_logits.view(-1, vocab_size)
    target = shift_labels.reshape(-1).to(flat.device)
    loss = fixed_cross_entropy(flat, target, num_items_in_batch, ignore_index, **kwargs)
    return loss


def method_note(doc: Any) -> str:
    """What the method text says when the declared loss is modelled."""
    text = (
        f"transformers {doc.get('software', 'transformers').value} as declared: the causal-LM loss copies the shifted "
        "float32 logits (ForCausalLMLoss before 4.49.0)"
    )
    if models_float_logits(doc):
        text += ", and the model upcasts its head's output to float32 itself (before 4.46.0: the 16-bit logits freed)"
    return text


@contextlib.contextmanager
def declared_loss(doc: Any, workload: Any = None) -> Iterator[bool]:
    """While inside, transformers' causal-LM loss is the declared one (yields whether it was replaced); with the
    ``workload`` whose model runs, before 4.46 its head's output is upcast in the forward too (:func:`float_logits`)."""
    if not models_shift_copy(doc):
        yield False
        return
    from transformers.loss import loss_utils

    saved = loss_utils.LOSS_MAPPING["ForCausalLM"]
    loss_utils.LOSS_MAPPING["ForCausalLM"] = shifted_copy_loss
    try:
        if workload is not None and models_float_logits(doc):
            with float_logits(workload):
                yield True
        else:
            yield True
    finally:
        loss_utils.LOSS_MAPPING["ForCausalLM"] = saved


__all__ = [
    "FLOAT_KEY",
    "KEY",
    "declared_loss",
    "float_logits",
    "method_note",
    "models_float_logits",
    "models_shift_copy",
    "shifted_copy_loss",
]
