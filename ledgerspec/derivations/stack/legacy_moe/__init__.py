"""The MoE layout of transformers < 5, built when a ledger declares that stack (known difference
``transformers-moe-fused-experts``, :mod:`ledgerspec.contract.differences`).

transformers 5.0.0 (first in 5.0.0rc0; 4.57.6, the last 4.x, still has the old layout) fused each MoE block's experts
into 3-D parameters (``MixtralExperts.gate_up_proj``/``down_proj``) that bitsandbytes' ``nn.Linear`` replacement leaves
in the loaded dtype. Before, every expert was a module of ``nn.Linear`` projections (Mixtral's
``MixtralBlockSparseTop2MLP.w1/w2/w3``) that bitsandbytes quantized like any other linear layer, and the MoE block
looped over the experts in Python. When ``software.transformers`` declares a version before 5.0.0 and the installed
one is 5 or later, :func:`swap` replaces each MoE block of the freshly built model (on the meta device; resolve, the
estimate and ``shard``: the measurement runs the installed stack, as it does with the loss) by the block of that
version, with its name (``block_sparse_moe``), its per-expert ``nn.Linear`` modules and its forward, so that
resolve's frozen base, PEFT's targets and estimate's step are that version's. One module per model family:

- :mod:`.mixtral`: Mixtral (transformers 4.36-4.57.6; the modules and forward of 4.48.1);
- :mod:`.qwen_moe`: Qwen2-MoE (4.40-4.57.6) and Qwen3-MoE (4.51-4.57.6);
- :mod:`.loop`: the routing loop Mixtral and Qwen share;
- :mod:`.deepseek`: DeepSeek-V3 (4.51-4.57.6) and DeepSeek-V2 (4.54-4.57.6), their routers and loops;
- :mod:`.gpt_oss`: gpt-oss (4.55-4.57.6), whose experts were 3-D parameters from its first release (nothing to
  rebuild): the installed modules get 4.57.6's forwards (dense router scores, the Python loop over the experts).

The model is marked (:data:`MARK`) even when no block was swapped (a DeepSeek whose layers are all dense), so that
PEFT names its modules as for transformers 4.

:func:`peft_as_v4` makes the installed PEFT wrap those modules as PEFT for transformers 4 did: PEFT >= 0.18 on
transformers 5 rewrites the v4 expert names of ``target_modules`` (``w1``, ``w2``, ``w3``, ``gate``) into
``target_parameters`` on the fused tensors (``peft/utils/transformers_weight_conversion.py``,
``_MOE_TARGET_MODULE_MAPPING``, called from ``BaseTuner.inject_adapter`` when ``is_transformers_ge_v5``); on the v4
layout the names are modules again and are wrapped as ``nn.Linear`` (or bitsandbytes ``Linear4bit``) layers. PEFT
0.21 converts DeepSeek-V2/V3's (and Qwen3-MoE's) ``gate_proj``/``up_proj``/``down_proj`` by Qwen2-MoE's mapping
(``_MODEL_TO_CONVERSION_PATTERN``): on the installed layout their shared experts and dense MLPs get no adapter.

The routing under fake tensors: how many tokens each expert receives depends on the router's values, which a fake
tensor does not have (``torch.where`` of the expert mask has a data-dependent size). :mod:`.routing` gives each expert
a count: the real run's counts when a caller supplies them (the truth test), otherwise an even split of the
``tokens x top_k`` assignments. Every tensor the loop keeps for backward is proportional to the tokens an expert
receives, so the sum over experts, the saved activations, does not depend on the split; only the transient of the
expert being computed at the peak does (one expert's ``tokens x intermediate`` temporaries).

Imports torch only inside functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

KEY = "transformers-moe-fused-experts"

#: model_type -> (the module of this package that builds its transformers-4 block, its swap function)
FAMILIES = {
    "mixtral": ("mixtral", "swap"),
    "qwen2_moe": ("qwen_moe", "swap_qwen2"),
    "qwen3_moe": ("qwen_moe", "swap_qwen3"),
    "deepseek_v2": ("deepseek", "swap_v2"),
    "deepseek_v3": ("deepseek", "swap_v3"),
    "gpt_oss": ("gpt_oss", "swap"),
}

#: marks a model whose MoE blocks were swapped (read by :func:`peft_as_v4` and the records)
MARK = "_ledgerspec_legacy_moe"
#: marks each transformers-4 MoE block that :func:`.loop.swap_blocks` built (read by :func:`routers`)
BLOCK_MARK = "_ledgerspec_v4_block"


def declares_v4(doc: Any) -> bool:
    """``software.transformers`` declares a version before 5.0.0 and the installed transformers is 5 or later."""
    from ledgerspec.contract.differences import OLDER
    from ledgerspec.derivations.stack.versions import declared_side, installed_side

    return declared_side(doc, KEY) == OLDER and installed_side(KEY) != OLDER


def family(config: Any) -> str | None:
    """The model type of a covered family for a model config (its text config), None if not covered."""
    text = getattr(config, "text_config", None) or config
    model_type = str(getattr(text, "model_type", ""))
    return model_type if model_type in FAMILIES else None


def applies(doc: Any, config: Any) -> bool:
    """:func:`swap` would change this model: a covered family on a declared transformers 4."""
    return family(config) is not None and declares_v4(doc)


def swap(model: Any, doc: Any) -> int:
    """Replace the MoE blocks of ``model`` (built by the installed transformers, on any device) by transformers 4's,
    when the ledger declares it (:func:`applies`). Returns how many blocks were swapped (0: nothing changed)."""
    import importlib

    config = getattr(model, "config", None)
    name = family(config) if config is not None else None
    if name is None or not declares_v4(doc):
        return 0
    module_name, function = FAMILIES[name]
    module = importlib.import_module(f"ledgerspec.derivations.stack.legacy_moe.{module_name}")
    swapped = int(getattr(module, function)(model))
    # marked even without a block swapped (a DeepSeek whose layers are all dense, ``first_k_dense_replace``): the
    # model is that version's, and PEFT must name its modules as PEFT for transformers 4 did (:func:`peft_as_v4`)
    setattr(model, MARK, name)
    return swapped


def is_swapped(model: Any) -> bool:
    """``model`` (or the base model under a PEFT model) carries transformers 4's MoE blocks."""
    seen = 0
    while model is not None and seen < 4:
        if getattr(model, MARK, None):
            return True
        seen += 1
        model = getattr(model, "base_model", None) if not hasattr(model, "model") else model.model
    return False


@contextlib.contextmanager
def peft_as_v4(model: Any) -> Iterator[None]:
    """While PEFT injects adapters into a swapped model: PEFT's transformers-5 conversion of the v4 expert names
    (see the module docstring) is off, so ``w1``/``w2``/``w3``/``gate`` are the ``nn.Linear`` modules they name."""
    if not is_swapped(model):
        yield
        return
    from peft.tuners import tuners_utils

    before = tuners_utils.is_transformers_ge_v5
    tuners_utils.is_transformers_ge_v5 = False
    try:
        yield
    finally:
        tuners_utils.is_transformers_ge_v5 = before


#: the router modules of transformers 4's MoE blocks: ``gate`` (hidden -> experts) and Qwen2-MoE's
#: ``shared_expert_gate`` (hidden -> 1)
ROUTER_NAMES = ("gate", "shared_expert_gate")


def routers(model: Any) -> set[int]:
    """The ids of the router ``nn.Linear`` modules of ``model``'s swapped transformers-4 MoE blocks (empty when none
    was swapped). A GPTQ or AWQ checkpoint keeps them in float16: GPTQModel quantizes a model's ``layer_modules``
    only, and Mixtral's lists the attention projections and the experts' ``w1``/``w3``/``w2``, not
    ``block_sparse_moe.gate`` (fms-acceleration 876e2ed
    ``plugins/accelerated-peft/src/fms_acceleration_peft/gptqmodel/models/mixtral.py`` lines 20-56, applied by
    ``models/base.py`` ``from_quantized`` lines 1142-1162, which drops every Linear whose name ends with none of
    them). The routers of the other declared families (Qwen2/Qwen3-MoE) are left dense by the same rule, unchecked
    against a GPTQ or AWQ checkpoint of those families."""
    out: set[int] = set()
    for module in model.modules():
        if getattr(module, BLOCK_MARK, False):
            for name in ROUTER_NAMES:
                router = module._modules.get(name)
                if router is not None:
                    out.add(id(router))
    return out


def method_note(doc: Any, config: Any = None) -> str:
    version = doc.get("software", "transformers").value
    if config is not None and family(config) == "gpt_oss":
        return (
            f"MoE forward of the declared transformers {version}: gpt-oss's dense router scores and its loop over "
            "the experts (the same 3-D expert parameters), an even split of the tokens among the experts "
            "(stack/legacy_moe)"
        )
    return (
        f"MoE layout of the declared transformers {version}: per-expert nn.Linear experts (quantized like every "
        "linear layer) and its routing loop over the experts, an even split of the tokens among the experts "
        "(stack/legacy_moe)"
    )


__all__ = [
    "BLOCK_MARK",
    "FAMILIES",
    "KEY",
    "MARK",
    "ROUTER_NAMES",
    "applies",
    "declares_v4",
    "is_swapped",
    "method_note",
    "peft_as_v4",
    "routers",
    "swap",
]
