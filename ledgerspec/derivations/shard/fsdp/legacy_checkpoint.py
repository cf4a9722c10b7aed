"""transformers < 4.52's gradient checkpointing around an FSDP1 unit, for a simulation whose ledger declares that stack.

Where the checkpoint sits decides what FSDP1 sees. transformers 4.48.1 checkpoints a decoder layer from the model's
loop, ``self._gradient_checkpointing_func(decoder_layer.__call__, hidden_states, ...)``
(``models/mistral/modeling_mistral.py`` 4.48.1 line 549, the same in every Llama-family model): under FSDP1 the
decoder layer is the ``FullyShardedDataParallel`` unit, so the checkpoint wraps the unit and FSDP1's pre-forward runs
inside it. 4.52.0 moved checkpointing into the layer (``GradientCheckpointingLayer``, huggingface/transformers PR
37223, Llama-family models first; PR 38913 the rest), inside the unit's forward.

With the checkpoint outside, a reentrant recompute in backward calls the unit with the checkpoint's detached inputs,
leaves that require grad. A unit whose flat parameter requires no gradient (a decoder layer under PEFT's
``fsdp_auto_wrap_policy``: its LoRA modules are units of their own) gets FSDP1's reshard-only hook,
``register_multi_grad_hook`` on those inputs (torch ``distributed/fsdp/_runtime_utils.py``,
``_register_post_backward_reshard_only_hook``, 2.4.1 lines 1461-1503, unchanged in 2.13). Its closure holds each
input's ``AccumulateGrad`` node, which holds the input, and the input holds the hook: the layer's input and the
gradient accumulated into it stay alive until ``_post_backward_final_callback`` removes the hook at the end of
backward. So every decoder layer's input and its gradient, one hidden state each per token, stay until backward
ends (measured with the declared stack on the CPU: benchmarks/results/published-multi-gpu-cpu-repro.md).

:func:`checkpoint_outside_units` reproduces that placement on the installed transformers (known difference
``transformers-checkpoint-outside-fsdp-unit``): for every FSDP1 unit that wraps a ``GradientCheckpointingLayer``,
the layer's own checkpointing is switched off and the unit's forward is run through the model's own checkpoint
function (``_gradient_checkpointing_func``: ``use_reentrant`` as declared), as 4.48.1's loop did.

:func:`depth_plan`: a step with this placement is simulated at the model's full depth, never extrapolated from two
shallow probes. The held inputs and gradients make the backward peak move with depth: with two or three layers it is
where the loss's backward starts (the logits' gradients, a constant), with many it is the first layer's recompute,
where every layer's input and gradient are alive (two hidden states per layer and token, a slope the shallow probes'
backward peak does not have). Each phase peak is then the larger of two affine functions of depth, and extending the
probes' figures linearly keeps the shallow one. On the published Mistral-7B QLoRA FSDP1 run at 2 x 4,096 tokens per
rank (benchmarks/results/published-multi-gpu.md) the probes of 2 and 3 layers, extended to 32, gave 8.70 GB (the loss
in forward) where the 32 layers traced give 9.49 GB (late in backward); the published peak is 9.42 GB. Imports torch
only inside functions.
"""

from __future__ import annotations

import functools
from typing import Any

KEY = "transformers-checkpoint-outside-fsdp-unit"


def models_outside_checkpoint(doc: Any) -> bool:
    """The declared transformers checkpoints the FSDP1 unit from outside and the installed one does not, and the
    checkpoint is transformers' own: one applied inside each unit by FSDP (``parallelism.activation_checkpointing``,
    torch's ``apply_activation_checkpointing``) sits there whatever the transformers version."""
    from ledgerspec.contract.differences import OLDER
    from ledgerspec.derivations.shard.options import fsdp1_options
    from ledgerspec.derivations.stack.versions import declared_side, installed_side

    if fsdp1_options(doc).activation_checkpointing:
        return False
    return declared_side(doc, KEY) == OLDER and installed_side(KEY) != OLDER


def checkpoint_outside_units(wrapped: Any) -> int:
    """Move each checkpointed layer's checkpoint outside its FSDP1 unit (in place); returns how many units."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from transformers.modeling_layers import GradientCheckpointingLayer

    moved = 0
    for unit in FullyShardedDataParallel.fsdp_modules(wrapped):
        layer = unit.module
        if not isinstance(layer, GradientCheckpointingLayer):
            continue
        unit.forward = functools.partial(_outside, unit, layer)  # type: ignore[method-assign]
        moved += 1
    return moved


def _outside(unit: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
    """The unit's forward as transformers 4.48 called it: ``checkpoint(unit.__call__, *args)``, the layer unchecked."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not (layer.gradient_checkpointing and layer.training and torch.is_grad_enabled()):
        return FullyShardedDataParallel.forward(unit, *args, **kwargs)

    def run(*inputs: Any) -> Any:
        saved = layer.gradient_checkpointing
        layer.gradient_checkpointing = False  # the checkpoint is this one, outside the unit
        try:
            return FullyShardedDataParallel.forward(unit, *inputs, **kwargs)
        finally:
            layer.gradient_checkpointing = saved

    return layer._gradient_checkpointing_func(run, *args)


#: why a step with the checkpoint outside its FSDP1 units is traced at full depth (the plan's reason, in the method)
FULL_DEPTH_REASON = (
    "the checkpoint around each FSDP1 unit keeps every layer's input and gradient until backward ends, so the backward "
    "peak moves with depth (shallow probes peak at the loss's backward, deep stacks at the first layer's recompute) "
    "and is not extrapolated"
)


def depth_plan(doc: Any, spec: Any, est_plan: Any) -> Any:
    """The depth plan of a simulated FSDP1 step (``est_plan``, a
    :class:`ledgerspec.derivations.estimate.extrapolate.Plan`): every layer traced when the checkpoint placement is
    modelled (gradient checkpointing on, the declared transformers older than the installed placement, frozen decoder
    units: an adapter method), else ``est_plan`` as it is."""
    import dataclasses

    if est_plan.probes is None or not (spec.gradient_checkpointing and models_outside_checkpoint(doc)):
        return est_plan
    if getattr(spec, "full", False):  # every unit trains: no reshard-only hook on its inputs, nothing held
        return est_plan
    return dataclasses.replace(est_plan, probes=None, reason=FULL_DEPTH_REASON)


def method_note(doc: Any) -> str:
    """What the method text says when the declared checkpoint placement is modelled."""
    return (
        f"transformers {doc.get('software', 'transformers').value} as declared: gradient checkpointing wraps each "
        "FSDP1 unit from outside (before 4.52.0; with reentrant checkpointing each layer's input and its gradient "
        "then stay until backward ends)"
    )


__all__ = [
    "FULL_DEPTH_REASON",
    "KEY",
    "checkpoint_outside_units",
    "depth_plan",
    "method_note",
    "models_outside_checkpoint",
]
