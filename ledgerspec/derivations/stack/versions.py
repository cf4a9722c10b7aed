"""The installed stack, and the known differences from the declared one (:mod:`ledgerspec.contract.differences`)
that apply to a model and configuration: what resolve and estimate record next to their figures."""

from __future__ import annotations

from typing import Any

from ledgerspec.contract.differences import BY_ID, NEWER, OLDER

#: the packages whose versions a figure depends on (``software.*`` keys)
PACKAGES = ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate")


def installed_stack() -> dict[str, str]:
    """The installed versions of :data:`PACKAGES` (those installed), read from package metadata (no import)."""
    from importlib import metadata

    out: dict[str, str] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def installed_side(difference_id: str) -> str:
    """Which side of a known difference the installed stack is on (``newer`` if the package is missing)."""
    d = BY_ID[difference_id]
    version = installed_stack().get(d.package)
    return (d.side(version) if version else None) or NEWER


def declared_side(doc: Any, difference_id: str) -> str | None:
    """Which side of a known difference ``software.<package>`` declares (None: not declared, or unreadable)."""
    d = BY_ID[difference_id]
    v = doc.get("software", d.package)
    return None if v.unknown or v.value is None else d.side(str(v.value))


def record(computed_as: str, other_minus_this: int | None = None) -> dict[str, Any]:
    """One ``differences`` entry: the side the figures hold and, when known, the other side's figure minus this."""
    assert computed_as in (OLDER, NEWER)
    entry: dict[str, Any] = {"computed_as": computed_as}
    if other_minus_this is not None:
        entry["bytes"] = int(other_minus_this)
    return entry


#: model types whose experts transformers < 5 built as per-expert ``nn.Linear`` modules and transformers >= 5
#: fuses (the list of NVIDIA/Model-Optimizer#1187, "verified against transformers v5.5.0 source", plus DeepSeek-V2);
#: gpt-oss, DBRX and GraniteMoE had 3-D expert parameters before 5 too, so nothing changed for them
LINEAR_EXPERTS_BEFORE_5 = frozenset(
    {"mixtral", "qwen2_moe", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3", "jamba", "olmoe"}
)


def fused_expert_parameters(model: Any) -> list[tuple[str, Any]]:
    """The frozen 3-D expert parameters (``experts.gate_up_proj``, ``experts.down_proj``: transformers >= 5) that
    bitsandbytes' ``nn.Linear`` replacement leaves in the loaded dtype, for the model types of
    :data:`LINEAR_EXPERTS_BEFORE_5`."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    if getattr(config, "model_type", None) not in LINEAR_EXPERTS_BEFORE_5:
        return []
    out = []
    for name, p in model.named_parameters():
        if p.dim() == 3 and not p.requires_grad and ".experts." in f".{name}" and p.dtype.is_floating_point:
            out.append((name, p))
    return out


def fused_experts_4bit_change(model: Any, double_quant: bool, storage_itemsize: int = 1) -> int:
    """Bytes the fused experts of ``model`` would take quantized to 4 bits as transformers < 5's per-expert
    ``nn.Linear`` modules (``w1``/``w3`` halves of ``gate_up_proj``, ``w2`` = ``down_proj``), minus what they take
    in the loaded dtype: the other side of ``transformers-moe-fused-experts`` (negative: smaller). 0 without them."""
    from ledgerspec.derivations.stack.bnb_storage import bnb4_bytes

    change = 0
    for name, p in fused_expert_parameters(model):
        experts, rows, cols = (int(x) for x in p.shape)
        halves = 2 if name.endswith("gate_up_proj") and rows % 2 == 0 else 1
        per_matrix = bnb4_bytes(rows // halves * cols, double_quant, storage_itemsize).total
        change += experts * halves * per_matrix - p.numel() * p.element_size()
    return change
