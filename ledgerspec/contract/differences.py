"""Known memory-relevant differences between versions of the stack (docs: "The step users run", "Declared stack").

A ledger declares its stack in ``software.*``; ledgerspec computes figures with the stack installed where it runs.
Where the two sit on different sides of a version that changed memory, the figure is not the declared run's. Each
difference is data: the package, the first version with the new behaviour, what the old and new versions hold, which
figures it moves, and the upstream source.

The derivations record, next to the figures they write (``x-resolve.differences``, ``x-estimate.differences``), the
differences that apply to the model and configuration they computed: which side's behaviour the figures hold
(``computed_as``) and, where it can be computed, by how many bytes the other side differs (``bytes``). The check
(rule LS012, and the ladder's hold at CANDIDATE) compares that side with the version ``software.*`` declares now:
pure, no I/O, no torch. ``software.accepted_differences`` lists the ids a user accepts as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ledgerspec.contract.document import Document

#: where derivations record the differences of the figures they wrote
RECORDS = ("x-resolve", "x-estimate")
OLDER, NEWER = "older", "newer"


@dataclass(frozen=True)
class KnownDifference:
    """One version change that moves memory. Most have one edge: versions before ``changed_in`` hold ``older``,
    ``changed_in`` and later hold ``newer``. A window (``introduced_in`` set) was a behaviour of a few releases
    only: versions from ``introduced_in`` up to ``changed_in`` (excluded) hold ``older``, every other version,
    before or after, holds ``newer``; the two sides keep their names so that records and the rule read both kinds
    alike. A pre-release counts as the release it leads to (``4.40.0rc1`` is 4.40.0), as :func:`version_tuple`
    reads it."""

    id: str
    package: str  # the ``software.*`` key
    changed_in: str  # the first version with the newer behaviour (a window's first version after it)
    older: str  # what versions before ``changed_in`` hold (a window: the versions inside it)
    newer: str  # what ``changed_in`` and later hold (a window: every version outside it)
    figures: str  # which figures it moves
    sources: tuple[str, ...]
    introduced_in: str | None = None  # a window's first version (None: one edge)
    #: whether a derivation can compute the declared side (``older`` where installed is ``newer``, or the reverse);
    #: False: the figures are always the installed side's, and the record only says so
    modelled: bool = True

    def side(self, version: str) -> str | None:
        """``older``/``newer`` for a version string (``0.42.0``, ``4.48``, ``2.13.0+cpu``); None if unreadable."""
        v, edge = version_tuple(version), version_tuple(self.changed_in)
        if v is None or edge is None:
            return None
        if self.introduced_in is not None:
            start = version_tuple(self.introduced_in)
            if start is None:
                return None
            return OLDER if start <= v < edge else NEWER
        return NEWER if v >= edge else OLDER

    def behaviour(self, side: str) -> str:
        return self.older if side == OLDER else self.newer

    def span(self, side: str) -> str:
        if self.introduced_in is not None:
            if side == OLDER:
                return f"{self.introduced_in} <= {self.package} < {self.changed_in}"
            return f"{self.package} < {self.introduced_in} or >= {self.changed_in}"
        return f"{self.package} < {self.changed_in}" if side == OLDER else f"{self.package} >= {self.changed_in}"


KNOWN: tuple[KnownDifference, ...] = (
    KnownDifference(
        id="bitsandbytes-4bit-matmul-input",
        package="bitsandbytes",
        changed_in="0.43.2",
        older="MatMul4Bit keeps each 4-bit layer's input (cast to the compute dtype) for backward "
        "(`ctx.tensors = (A, B)`), until the step's autograd graph is released",
        newer="MatMul4Bit keeps only the packed weight for backward (`ctx.tensors = (None, B)`)",
        figures="activations and every phase peak of a QLoRA step (bitsandbytes 4-bit layers)",
        sources=(
            "https://github.com/bitsandbytes-foundation/bitsandbytes/pull/1270",
            "bitsandbytes/autograd/_functions.py, MatMul4Bit.forward, at 0.43.1 and at 0.43.2",
        ),
    ),
    KnownDifference(
        id="transformers-moe-fused-experts",
        package="transformers",
        changed_in="5.0.0",
        older="each expert's projections are `nn.Linear` modules (`experts[i].w1/w2/w3`) that bitsandbytes "
        "quantizes to 4 bits",
        newer="the experts are fused 3-D parameters (`experts.gate_up_proj`, `experts.down_proj`) that bitsandbytes' "
        "`nn.Linear` replacement does not touch: they stay in the loaded dtype",
        figures="the frozen base of a 4-bit MoE model, and every peak (modelled for Mixtral, Qwen2-MoE, Qwen3-MoE, "
        "DeepSeek-V2 and DeepSeek-V3: the declared layout is built, stack/legacy_moe; gpt-oss, whose experts were 3-D "
        "before 5.0 too, gets 4.x's routing loop and dense router scores)",
        sources=(
            "https://github.com/bitsandbytes-foundation/bitsandbytes/issues/1849",
            "transformers 4.57.6 models/mixtral/modeling_mixtral.py (MixtralBlockSparseTop2MLP) and 5.0.0rc0 "
            "(MixtralExperts, gate_up_proj/down_proj): the first release with fused experts is 5.0.0rc0",
            "https://github.com/ModelTC/LightCompress/pull/451 (the Mixtral layouts of transformers < 5 and >= 5)",
            "transformers 4.57.6 models/deepseek_v3/modeling_deepseek_v3.py (DeepseekV3MoE, a ModuleList of "
            "DeepseekV3MLP, from 4.51.0), models/deepseek_v2/modeling_deepseek_v2.py (DeepseekV2MoE, from 4.54.0), "
            "and 5.0.0 (DeepseekV3NaiveMoe, DeepseekV2Experts: gate_up_proj/down_proj)",
        ),
    ),
    KnownDifference(
        id="transformers-causal-lm-loss-shift-copy",
        package="transformers",
        changed_in="4.49.0",
        older="the causal-LM loss upcasts the logits to float32 and copies them shifted "
        "(`shift_logits = logits[..., :-1, :].contiguous()`): one more float32 tensor of batch x (length - 1) x vocab "
        "at the loss and, through the slice's backward, at the start of backward",
        newer="the loss pads and shifts the labels instead and only views the float32 logits (no copy)",
        figures="the forward and backward peaks of a causal-LM step (loss computed by transformers)",
        sources=(
            "https://github.com/huggingface/transformers/blob/v4.48.1/src/transformers/loss/loss_utils.py#L36-L39",
            "src/transformers/loss/loss_utils.py, ForCausalLMLoss, at 4.48.1 and at 4.49.0",
        ),
    ),
    KnownDifference(
        id="transformers-causal-lm-float-logits-in-model",
        package="transformers",
        changed_in="4.46.0",
        older="the causal-LM model upcasts its head's output in its own forward (`logits = "
        "self.lm_head(...).float()`): the model-dtype logits are freed at once and the model returns float32 logits",
        newer="the model returns its head's output in the model's dtype and the loss upcasts a copy, so both are alive "
        "at the loss (one more batch x length x vocab tensor in the model's dtype)",
        figures="the forward peak of a causal-LM step whose head runs in 16 bits (loss computed by transformers)",
        sources=(
            "https://github.com/huggingface/transformers/blob/v4.45.2/src/transformers/models/llama/modeling_llama.py "
            "(LlamaForCausalLM.forward: `self.lm_head(hidden_states[:, -num_logits_to_keep:, :]).float()`, 'TODO: "
            "remove the float() operation in v4.46')",
            "src/transformers/loss/loss_utils.py, ForCausalLMLoss, from 4.46.0 (`logits = logits.float()` inside the "
            "loss, the caller's logits kept)",
        ),
    ),
    KnownDifference(
        id="transformers-checkpoint-outside-fsdp-unit",
        package="transformers",
        changed_in="4.52.0",
        older="gradient checkpointing wraps each decoder layer's call from the model's loop, i.e. the FSDP1 unit "
        "from outside: with reentrant checkpointing and a frozen unit (PEFT's wrap policy), FSDP1's reshard-only "
        "multi-grad hook on the recompute's detached inputs keeps every layer's input and its gradient until "
        "backward ends (two hidden states per layer and token)",
        newer="GradientCheckpointingLayer checkpoints inside the layer's forward, inside the FSDP1 unit: each layer's "
        "input and gradient are freed as backward passes it",
        figures="the backward peak of an FSDP1 step with gradient checkpointing (reentrant)",
        sources=(
            "https://github.com/huggingface/transformers/blob/v4.48.1/src/transformers/models/mistral/"
            "modeling_mistral.py#L549",
            "https://github.com/huggingface/transformers/pull/37223 (GradientCheckpointingLayer, 4.52.0)",
            "torch/distributed/fsdp/_runtime_utils.py, _register_post_backward_reshard_only_hook (2.4.1 and 2.13)",
        ),
    ),
    KnownDifference(
        id="peft-gptq-lora-input-cast",
        package="peft",
        changed_in="0.16.0",
        older="GPTQLoraLinear leaves the input alone under autocast (`requires_conversion = not "
        "torch.is_autocast_enabled()`) and adds the scaled LoRA output in place (`result += output`)",
        newer="GPTQLoraLinear casts the input to the adapter's dtype under autocast too (`_cast_input_dtype`: a "
        "float32 copy of a 16-bit input and its dropout's output) and adds out of place (`result = result + ...`)",
        figures="the transient peaks of a GPTQ-LoRA step with float32 adapters under autocast",
        sources=(
            "https://github.com/huggingface/peft/blob/v0.13.2/src/peft/tuners/lora/gptq.py (GPTQLoraLinear.forward)",
            "https://github.com/huggingface/peft/pull/2571 (commit e34852f, first released in 0.16.0)",
        ),
    ),
    KnownDifference(
        id="transformers-sdpa-explicit-causal-mask",
        package="transformers",
        introduced_in="4.38.0",
        changed_in="4.40.0",
        older="Llama and Gemma models (and 4.39's Cohere) hand SDPA an explicit causal mask even when nothing is "
        "padded, so PyTorch runs its memory-efficient kernel (q, k and v copied contiguous first, the mask's additive "
        "bias saved for backward) instead of flash with `is_causal`; 4.38 also materialises a batch x 1 x "
        "max_position_embeddings x max_position_embeddings mask in the model's dtype in every forward and indexes a "
        "batch x 1 x length x length copy of it in every layer",
        newer="an unpadded batch gets no mask: SDPA is called with `is_causal` and runs flash (fp16/bf16)",
        figures="the attention's saved tensors and backward buffers on a CUDA device, and at 4.38 the forward peak "
        "(Llama, Gemma and Cohere with SDPA attention)",
        sources=(
            "https://github.com/huggingface/transformers/issues/30010",
            "src/transformers/models/llama/modeling_llama.py (LlamaModel._update_causal_mask, "
            "LlamaSdpaAttention.forward) at 4.37.2, 4.38.2, 4.39.1 and 4.40.0",
        ),
        modelled=False,
    ),
)

BY_ID = {d.id: d for d in KNOWN}


def version_tuple(text: str) -> tuple[int, ...] | None:
    """The leading release numbers of a version string: ``0.43.2`` -> (0, 43, 2); ``5.0.0rc1`` -> (5, 0, 0);
    ``4.48`` -> (4, 48, 0); anything else -> None."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text))
    if m is None:
        return None
    parts = tuple(int(p) for p in m.group(1).split("."))
    return (*parts, 0, 0, 0)[:3] if len(parts) < 3 else parts


@dataclass(frozen=True)
class StackDifference:
    """A known difference between the declared stack and the one a record's figures were computed with."""

    difference: KnownDifference
    record: str  # x-resolve / x-estimate
    declared: str  # the version software.* declares
    computed_as: str  # older / newer: the behaviour the figures hold
    bytes: int | None  # how much the declared side's figure differs (declared - computed), when known
    accepted: bool

    @property
    def id(self) -> str:
        return self.difference.id

    def message(self) -> str:
        d = self.difference
        declared_side = OLDER if self.computed_as == NEWER else NEWER
        size = ""
        if self.bytes is not None:
            from ledgerspec.contract.units import format_size

            sign = "+" if self.bytes >= 0 else "-"
            size = f"; with the declared stack it differs by {sign}{format_size(abs(self.bytes))}"
        unmodelled = "" if d.modelled else f"; ledgerspec does not model {d.span(declared_side)}"
        return (
            f"{self.record} was computed with {d.span(self.computed_as)}, but software.{d.package} declares "
            f"{self.declared}: there {d.behaviour(declared_side)} (moves {d.figures}{size}{unmodelled}) [{d.id}]"
        )


def stack_differences(doc: Document, accepted: tuple[str, ...]) -> list[StackDifference]:
    """The known differences between what ``software.*`` declares and what the recorded figures were computed as."""
    out: list[StackDifference] = []
    for record in RECORDS:
        entries = doc.get(record, "differences").raw
        if not isinstance(entries, dict):
            continue
        for key, entry in entries.items():
            d = BY_ID.get(str(key))
            if d is None or not isinstance(entry, dict):
                continue
            computed_as = entry.get("computed_as")
            declared = doc.get("software", d.package)
            if (
                computed_as not in (OLDER, NEWER)
                or declared.unknown
                or not isinstance(declared.value, str | int | float)
            ):
                continue
            side = d.side(str(declared.value))
            if side is None or side == computed_as:
                continue
            raw = entry.get("bytes")
            size = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
            out.append(StackDifference(d, record, str(declared.value), computed_as, size, d.id in accepted))
    return out
