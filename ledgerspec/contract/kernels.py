"""The kernel catalogue: the kernels that replace transformers' own modules, what op each replaces (data, no torch).

``software.kernels`` names one kernel per op (``cross_entropy``, ``norm``, ``mlp_activation``, ``rope``,
``lora_projections``) plus ``other`` for replacements ledgerspec does not know. The checks wing reads this catalogue
to say which declared kernels the estimate models (rule LS013); :mod:`ledgerspec.derivations.kernels` holds the
models, one room per package, and the importers fill ``software.kernels`` from what each tool turns on.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

#: the ops a kernel can replace, in the order of ``software.kernels``
OPS = ("cross_entropy", "norm", "mlp_activation", "rope", "lora_projections")
#: transformers' (or PEFT's) own module: what the estimate runs when nothing is declared
EAGER = "eager"


@dataclass(frozen=True)
class KernelSpec:
    """One kernel replacement: its id, the op it replaces, its package and whether the estimate models it."""

    id: str
    op: str
    package: str
    modelled: bool
    #: what it does to memory, in one line (the docs' table and the estimate's method text)
    summary: str
    #: where its behaviour is read from (package version and file)
    source: str


def _k(id: str, op: str, package: str, modelled: bool, summary: str, source: str) -> KernelSpec:
    return KernelSpec(id, op, package, modelled, summary, source)


LIGER = "liger-kernel"
KERNELS: dict[str, KernelSpec] = {
    k.id: k
    for k in (
        _k(
            "liger_fused_linear_cross_entropy",
            "cross_entropy",
            LIGER,
            True,
            "lm_head and the loss in chunks of tokens; the logits are never held, the input's gradient is computed "
            "in forward and kept for backward",
            "liger_kernel/ops/fused_linear_cross_entropy.py (0.8.5)",
        ),
        _k(
            "cut_cross_entropy",
            "cross_entropy",
            "cut-cross-entropy",
            True,
            "lm_head and the loss blockwise in SRAM: only a float32 log-sum-exp per token is kept; backward "
            "recomputes the logits blockwise",
            "cut_cross_entropy/cce.py (25.1.1)",
        ),
        _k(
            "liger_cross_entropy",
            "cross_entropy",
            LIGER,
            False,
            "the loss on the held logits, its gradient written into the logits in forward",
            "liger_kernel/ops/cross_entropy.py (0.8.5)",
        ),
        _k(
            "trl_chunked_nll",
            "cross_entropy",
            "trl",
            True,
            "TRL's fused LM head (SFTTrainer's default loss): the valid positions' hidden states gathered, the lm_head "
            "in (4096 x 32768) tiles of one buffer, seven float32 statistics per token; the logits are never held",
            "trl/kernels/chunked_logprob.py, trl/trainer/utils.py (1.16)",
        ),
        _k(
            "fms_fused_cross_entropy",
            "cross_entropy",
            "fms-acceleration-foak",
            False,
            "fms-acceleration's fused-ops-and-kernels cross-entropy",
            "plugins/fused-ops-and-kernels",
        ),
        _k(
            "liger_rms_norm",
            "norm",
            LIGER,
            True,
            "one output and a float32 reciprocal RMS per row saved, instead of the eager norm's float32 copies",
            "liger_kernel/ops/rms_norm.py (0.8.5)",
        ),
        _k("liger_layer_norm", "norm", LIGER, False, "Liger's LayerNorm", "liger_kernel/ops/layer_norm.py (0.8.5)"),
        _k(
            "liger_swiglu",
            "mlp_activation",
            LIGER,
            True,
            "silu(gate) * up in one kernel: saves gate and up only, recomputes silu in backward",
            "liger_kernel/ops/swiglu.py (0.8.5)",
        ),
        _k(
            "liger_geglu",
            "mlp_activation",
            LIGER,
            True,
            "gelu(gate) * up in one kernel: saves gate and up only, recomputes gelu in backward",
            "liger_kernel/ops/geglu.py (0.8.5)",
        ),
        _k(
            "liger_rope",
            "rope",
            LIGER,
            True,
            "rotary embedding applied in place on q and k: no rotated copies, nothing saved but cos and sin",
            "liger_kernel/ops/rope.py (0.8.5)",
        ),
        _k(
            "axolotl_lora_mlp",
            "lora_projections",
            "axolotl",
            True,
            "the MLP's LoRA projections and activation in one autograd function",
            "axolotl/kernels/lora.py (0.21)",
        ),
        _k(
            "axolotl_lora_qkv",
            "lora_projections",
            "axolotl",
            True,
            "the q/k/v LoRA projections in one autograd function",
            "axolotl/kernels/lora.py (0.21)",
        ),
        _k(
            "axolotl_lora_o",
            "lora_projections",
            "axolotl",
            True,
            "the output projection's LoRA in one autograd function",
            "axolotl/kernels/lora.py (0.21)",
        ),
        _k(
            "fms_fused_lora",
            "lora_projections",
            "fms-acceleration-foak",
            False,
            "fms-acceleration's fused LoRA projections",
            "plugins/fused-ops-and-kernels",
        ),
    )
}

#: the model types Liger patches (``MODEL_TYPE_TO_APPLY_LIGER_FN``, liger-kernel 0.8.5
#: ``transformers/monkey_patch.py``): for any other, ``_apply_liger_kernel_to_instance`` applies nothing
LIGER_MODEL_TYPES = frozenset(
    """deepseek_v2 deepseek_v3 deepseek_v4 gemma gemma2 gemma3_text gemma3 gemma4_text gemma4 glm4 glm4v glm4v_moe
    gpt_oss internvl llama llama4_text llama4 llava granite mllama mllama_text_model ministral mistral mixtral
    muse_glimmer nemotron olmo2 pixtral olmo3 qwen2 qwen3 qwen3_moe qwen2_vl qwen2_vl_text qwen2_5_vl qwen2_5_vl_text
    qwen3_next qwen3_5 qwen3_5_text qwen3_5_moe qwen3_5_moe_text qwen3_vl qwen3_vl_text qwen3_vl_moe qwen3_vl_moe_text
    smollm3 phi3 paligemma falcon_h1 smolvlm hunyuan_v1_dense hunyuan_v1_moe exaone4""".split()
)

#: words in a kernel's name and the ops they suggest it replaces (for one ledgerspec does not know)
_HINTS = (
    (r"unsloth", OPS),
    (r"liger", ("cross_entropy", "norm", "mlp_activation", "rope")),
    (r"foak|fused[-_ ]?ops", ("cross_entropy", "lora_projections")),
    (r"cross[-_ ]?entropy|\bce\b|cce|loss|logit", ("cross_entropy",)),
    (r"norm", ("norm",)),
    (r"glu|mlp|silu|gelu", ("mlp_activation",)),
    (r"rope|rotary", ("rope",)),
    (r"lora|qkv", ("lora_projections",)),
)


def kernel(name: str) -> KernelSpec | None:
    """The catalogue entry of a kernel id (case and surrounding space ignored); None when unknown or eager."""
    return KERNELS.get(name.strip().lower())


def is_modelled(op: str, name: str) -> bool:
    """Whether the estimate models kernel ``name`` declared for ``op`` (known, for that op, and modelled)."""
    spec = kernel(name)
    return spec is not None and spec.op == op and spec.modelled


def likely_ops(name: str) -> tuple[str, ...]:
    """The ops a kernel ledgerspec does not know likely replaces, from the words in its name."""
    low = name.lower()
    found: list[str] = []
    for pattern, ops in _HINTS:
        if re.search(pattern, low):
            found.extend(o for o in ops if o not in found)
    return tuple(found)


def suggest(name: str, op: str | None = None) -> str | None:
    """The closest known kernel id (for the op when given), for a did-you-mean."""
    ids = [k.id for k in KERNELS.values() if op is None or k.op == op] + [EAGER]
    close = difflib.get_close_matches(name.strip().lower(), ids, n=1, cutoff=0.6)
    return close[0] if close else None


def ids_for(op: str) -> tuple[str, ...]:
    """The known kernel ids of one op."""
    return tuple(k.id for k in KERNELS.values() if k.op == op)


__all__ = [
    "EAGER",
    "KERNELS",
    "LIGER_MODEL_TYPES",
    "OPS",
    "KernelSpec",
    "ids_for",
    "is_modelled",
    "kernel",
    "likely_ops",
    "suggest",
]
