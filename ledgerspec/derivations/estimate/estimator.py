"""``estimate``: one simulated training step under ``FakeTensorMode``: activations and phase peaks, no GPU.

The exact workload of the document (:class:`ledgerspec.derivations.engine.workload.Workload`: model from
its config, QLoRA layout, adapters, optimizer, gradient checkpointing, synthetic batches) is built
on the meta device and materialised as fake tensors on the CPU; every tensor an op produces is
counted by :class:`ledgerspec.derivations.engine.tracker.MemoryTracker`. Two modelling layers make the CPU
trace say what a CUDA GPU would allocate:

- attention runs through :mod:`ledgerspec.derivations.estimate.attention` (the declared CUDA kernel's
  saved tensors and backward buffers, not the CPU kernel's);
- 4-bit layers run through :mod:`ledgerspec.derivations.estimate.qlora` (bitsandbytes' storage and
  its dequantization temporaries: the CUDA path for training shapes and the CPU path are the same).

Phases follow the measurement protocol: after load, after adapter injection, after optimizer init,
forward (+ loss) peak, backward peak, optimizer-step peak of the first step, and the peak of a
second, steady-state step (two micro-steps per step when accumulating, because gradients are alive
during the second micro-step's forward). Depth is handled by :mod:`ledgerspec.derivations.estimate.extrapolate`.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ledgerspec.contract import fields as F
from ledgerspec.contract.config import sharded_ranks
from ledgerspec.contract.document import Document, ErrorAt
from ledgerspec.contract.units import format_size
from ledgerspec.derivations.estimate.cache import EstimateCache, cached, plain
from ledgerspec.derivations.estimate.extrapolate import Plan, extend_all, plan, with_layers
from ledgerspec.derivations.estimate.fit import ALL_PHASES, Fit, fit
from ledgerspec.derivations.stack.census import Progress
from ledgerspec.derivations.stack.versions import installed_stack
from ledgerspec.errors import LedgerspecError, first_line

#: the CUDA caching allocator rounds every block up to a multiple of this (c10/cuda/CUDACachingAllocator.cpp)
CUDA_ALLOCATION_GRANULARITY = 512
COMPONENTS = F.RESIDENT
#: what :attr:`Estimate.at_peak` splits the peak into: the ledger's components (the tracker's categories folded into
#: them; ``temporary`` holds what no component owns: logits and loss in fp32, their gradients, attention and
#: dequantization workspaces, gradients of activations in flight)
AT_PEAK = F.COMPONENTS
TARGETS = ("cuda", "cpu")


def peak_phase(phases: dict[str, int]) -> str:
    """The phase with the highest figure (the first one on a tie)."""
    return max(phases, key=lambda k: phases[k])


@dataclass
class Estimate:
    """The predicted memory of one configuration (bytes allocated by PyTorch tensors)."""

    phases: dict[str, int]
    activations: int
    components: dict[str, int]
    plan: Plan
    attention: str
    target: str
    seconds: float
    method: str
    notes: list[str] = field(default_factory=list)
    #: bytes alive at the moment of the peak (the highest phase), by component; they add up to the peak
    at_peak: dict[str, int] = field(default_factory=dict)
    #: every figure of the (extended) trace: phases, ``component.*``, ``at.PHASE.COMPONENT`` (read by ``fitmodel``)
    figures: dict[str, int] = field(default_factory=dict)
    #: the installed versions the estimate ran with (``x-estimate.stack``)
    stack: dict[str, str] = field(default_factory=dict)
    #: the known stack differences that apply (``x-estimate.differences``, :mod:`ledgerspec.contract.differences`)
    differences: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: answered from the estimate cache: the seconds the original trace took (None: traced now)
    cached_from: float | None = None

    @property
    def peak_phase(self) -> str:
        return peak_phase(self.phases)

    @property
    def peak_allocated(self) -> int:
        return max(self.phases.values())

    def fit(self, device_memory: int) -> Fit:
        return fit(self.phases, device_memory)

    def to_cache(self) -> dict[str, Any]:
        """JSON-ready data for :mod:`.cache` (``seconds`` is the time the trace took: for an estimate read back from
        the cache and stored again under another question, the trace's, not the look-up's)."""
        data = plain(self)
        if self.cached_from is not None:
            data["seconds"] = self.cached_from
        return data

    @classmethod
    def from_cache(cls, data: dict[str, Any], seconds: float) -> Estimate:
        """An estimate read back from :mod:`.cache`: ``seconds`` is the look-up's, ``cached_from`` the trace's."""
        fields_ = dict(data)
        plan_ = fields_.pop("plan")
        probes = plan_.get("probes")
        traced = float(fields_.pop("seconds"))
        fields_.pop("cached_from", None)
        est = cls(
            plan=Plan(int(plan_["layers"]), int(plan_["period"]), tuple(probes) if probes else None, plan_["reason"]),
            seconds=seconds,
            **fields_,
        )
        est.cached_from = traced
        return est


_err = ErrorAt("estimate")


_MEASURE_HINT = "run `ledgerspec measure` on a GPU (or --device cpu) instead"


def granularity(target: str) -> int:
    """The allocation rounding modelled for ``target``: the CUDA caching allocator's blocks, none on the CPU."""
    return CUDA_ALLOCATION_GRANULARITY if target == "cuda" else 1


@contextlib.contextmanager
def _no_meta_failure_log() -> Iterator[None]:
    """torch logs every failing meta kernel with its traceback before raising (``torch/_subclasses/fake_tensor.py``:
    ``log.exception("failed while attempting to run meta for %s", func)``, 22 lines on stderr); the estimate turns
    the failure into one line of its own (:func:`_fail`)."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    before = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = before


@contextlib.contextmanager
def _unpacked_rows() -> Iterator[None]:
    """Let transformers see the synthetic rows as unpacked, as it does with real tensors.

    ``masking_utils.find_packed_sequence_indices`` decides from the values of ``position_ids`` whether a row
    packs several sequences; on a fake tensor it cannot look and assumes packing, which builds an explicit
    4-D mask (and changes the attention kernel). The workload's rows are one sequence each (positions
    ``0..s-1``), for which the real function returns None: the replacement allocates the same intermediates
    and returns None.
    """
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices

    def unpacked(position_ids: Any) -> None:
        import torch

        first = position_ids[:, :1] - 1
        (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
        return None

    masking_utils.find_packed_sequence_indices = unpacked
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def _mask_rows(padded: bool) -> Iterator[None]:
    """Let transformers read the synthetic batch's 2-D attention mask as it reads a real one.

    ``masking_utils._ignore_causal_mask_sdpa`` decides from the values of the 2-D padding mask whether SDPA may
    skip the explicit mask and use ``is_causal`` (only when nothing is padded). On a fake tensor it cannot look
    and answers "do not skip" without computing anything. The workload's batches are of two known kinds
    (:meth:`ledgerspec.derivations.engine.workload.Workload.batch`): a padded batch always ends its last row with a
    padding position, for which the real function answers "do not skip" after two ``fast_all`` reductions (over the
    mask, then over its first ``q_length`` columns); the Trainer loop's unpadded batch carries an all-ones mask, for
    which it answers "skip" after one. The replacement allocates those same small intermediates and answers the
    same. Without a 2-D mask, or with real tensors, it is the original function. (The other value-dependent mask
    helpers are not reached: ``find_packed_sequence_indices`` runs only without a 2-D mask, see
    :func:`_unpacked_rows`; ``flash_attention_mask`` never sees the mask, see ``EstimateWorkload.model_inputs``.)
    """
    from torch._subclasses.fake_tensor import is_fake
    from transformers import masking_utils

    original = masking_utils._ignore_causal_mask_sdpa

    def known(
        padding_mask: Any,
        q_length: int,
        kv_length: int,
        q_offset: int,
        kv_offset: int,
        local_attention_size: int | None = None,
    ) -> bool:
        if padding_mask is None or not is_fake(padding_mask):
            return bool(original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size))
        import torch

        if padding_mask.shape[-1] > kv_length:
            padding_mask = padding_mask[:, torch.arange(kv_length, device=padding_mask.device) + kv_offset]
        if local_attention_size is not None and kv_length >= local_attention_size:
            return False
        if q_length == 1 or kv_length == q_length:
            masking_utils.fast_all(padding_mask)  # padded: False (the last row ends in padding); else True
            if not padded:
                return True
        if q_offset == 0:
            masking_utils.fast_all(padding_mask[:, :q_length])  # False for the same position: `and` stops here
        return False

    masking_utils._ignore_causal_mask_sdpa = known
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original


def _estimate_workload_class() -> Any:
    """The shared :class:`Workload`, plus the two CUDA modelling layers applied right after ``prepare``."""
    import torch

    from ledgerspec.derivations.engine.workload import Workload

    class EstimateWorkload(Workload):
        """``prepare`` as the measurement does, then 4-bit layers as bytes and attention as the CUDA kernel."""

        declared_moe_layout = True  # a declared transformers 4's MoE blocks (stack.legacy_moe)

        def __init__(
            self,
            doc: Document,
            spec: Any,
            source: Any,
            attention: str,
            target: str,
            keep_4bit_input: bool | None = None,
        ) -> None:
            # FlashAttention is not installed on the CPU: build with eager (every architecture has it); the
            # attention calls are routed to the FlashAttention model in ``prepare``
            build_spec = spec.changed(attention="eager") if attention.startswith("flash_attention") else spec
            super().__init__(doc, build_spec, source)
            self.declared_attention = attention
            self.target = target
            self.stack = contextlib.ExitStack()
            # the CUDA target: CUDA's optimizer defaults (and, in prepare, autocast lists) on these CPU tensors
            self.optimizer_device = target
            #: bitsandbytes < 0.43.2's MatMul4Bit keeps its input (None: as the document declares, e.g. a simulated
            #: rank of ``shard``, which once ran the installed side whatever the ledger declared)
            self.keep_4bit_input = keeps_4bit_input(doc, spec) if keep_4bit_input is None else keep_4bit_input
            #: the 4-bit size minus the loaded size of fused expert parameters bitsandbytes leaves unquantized
            self.fused_experts = 0
            #: the declared transformers 4's MoE layout was built (``stack.legacy_moe``)
            self.legacy_moe = False
            #: the model is an MoE family whose layout differs across transformers versions (``stack.moe_family``)
            self.moe_family = False
            #: the activation offloading hooks, when the ledger declares it (:mod:`..kernels.offload`)
            self.offload: Any = None

        def prepare(self) -> None:
            super().prepare()
            from ledgerspec.derivations.stack.legacy_moe import family, is_swapped

            self.legacy_moe = is_swapped(self.model)
            config = getattr(self.model, "config", None)
            self.moe_family = config is not None and family(config) is not None
            if self.spec.quant is not None:
                from ledgerspec.derivations.estimate.qlora import model_4bit_layers
                from ledgerspec.derivations.stack.versions import fused_experts_4bit_change

                self.fused_experts = fused_experts_4bit_change(self.model, self.spec.quant.double_quant)
                for model in self.models():
                    model_4bit_layers(
                        model,
                        getattr(torch, self.spec.loaded_dtype),
                        self.keep_4bit_input,
                        cpu=self.target == "cpu",
                    )
            from ledgerspec.derivations.estimate.attention import cuda_attention
            from ledgerspec.derivations.kernels.apply import simulated_kernels

            for model in self.models():  # the policy, and a separate reference model loaded as it is
                self.stack.enter_context(cuda_attention(model, self.declared_attention, self.target))
                self.stack.enter_context(
                    simulated_kernels(model, self.spec.kernels, self.spec.autocast_dtype, self.target == "cuda")
                )
            if self.spec.offload:
                from ledgerspec.derivations.kernels.offload import Offload

                # axolotl's LoRA manager does not call update_model_params (its offload_mode says axolotl)
                axolotl = (self.spec.offload_mode or "").lower().startswith("axolotl")
                self.offload = Offload(self.model, param_storages=not axolotl)
                self.stack.callback(self.offload.close)
            if self.target == "cuda" and self.spec.autocast_dtype is not None:
                from ledgerspec.derivations.engine.autocast import CUDA_POLICY, EmulatedAutocast

                self.stack.enter_context(EmulatedAutocast(CUDA_POLICY, getattr(torch, self.spec.autocast_dtype)))
            self.stack.enter_context(_unpacked_rows())
            self.stack.enter_context(_no_meta_failure_log())
            from ledgerspec.derivations.estimate.legacy_loss import declared_loss

            # transformers < 4.49's loss (and < 4.46's upcast) when the ledger declares it: every step simulated from
            # this workload (one GPU, FSDP's and ZeRO's ranks) runs the declared one
            self.stack.enter_context(declared_loss(self.doc, self))
            from ledgerspec.derivations.estimate.grouped_mm import grouped_mm_any_float

            grouped_mm_any_float()  # fp16 / fp32 experts: the meta kernel takes what the kernels take
            if self.spec.padded or (self.spec.loop == "trainer" and self.spec.pads_rows):
                self.stack.enter_context(_mask_rows(self.spec.padded))

        def models(self) -> list[Any]:
            """The models the step runs: the policy, and DPO's/KTO's separate reference model when there is one."""
            return [self.model] if self.reference is None else [self.model, self.reference]

        @property
        def trl_head_runs_here(self) -> bool:
            """On the CUDA target TRL's head is its Triton path, modelled in the loss (kernels/apply.py)."""
            return self.target != "cuda" and super().trl_head_runs_here

        def fused_lm_head(self, outputs: tuple[str, ...] | None = None, model: Any = None) -> None:
            """DPO: TRL's fused LM head; on the CUDA target its Triton path, as modelled by
            :mod:`ledgerspec.derivations.kernels.trl` (the completion positions gathered and scored)."""
            if self.target != "cuda":
                super().fused_lm_head(outputs, model)
                return
            from ledgerspec.derivations.kernels import trl

            amp = getattr(torch, self.spec.autocast_dtype) if self.spec.autocast_dtype else None
            trl.functions().add_fused_lm_head(
                model if model is not None else self.model.get_base_model(),
                outputs or trl.DPO_OUTPUTS,
                amp,
                lambda shifted: self.head_positions(int(shifted.shape[1]) + 1, int(shifted.shape[0])),
            )

        def saved_tensors(self) -> Any:
            """With ``memory_options.activation_offload``: TRL's offloading hooks (:mod:`..kernels.offload`)."""
            return self.offload if self.offload is not None else super().saved_tensors()

        def model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
            """FlashAttention: padded rows modelled as full rows (the mask is not passed, see :func:`method_text`)."""
            if self.declared_attention.startswith("flash_attention") and "attention_mask" in batch:
                return {k: v for k, v in batch.items() if k != "attention_mask"}
            return batch

    return EstimateWorkload


def trace(
    doc: Document,
    spec: Any,
    source: Any,
    target: str = "cuda",
    keep_4bit_input: bool | None = None,
    backend: Any = None,
) -> dict[str, int]:
    """One simulated protocol run (:func:`ledgerspec.derivations.engine.protocol.run_protocol` with fake tensors).

    Accumulation runs two micro-steps, not all of them: from the second micro-step on, the gradients are
    allocated and every micro-step allocates the same tensors, so the peaks are those of the full run.
    ``backend``: a fake-tensor :class:`TrackerBackend` of the target's granularity to count with instead of a new
    one (:mod:`ledgerspec.derivations.allocator.step` passes one that keeps the allocation event log).
    """
    from ledgerspec.derivations.engine.backends import TrackerBackend
    from ledgerspec.derivations.engine.protocol import run_protocol
    from ledgerspec.derivations.engine.tracker import by_component

    run_spec = spec.changed(accumulation=min(spec.accumulation, 2), prefetch=spec.accumulation)
    workload = _estimate_workload_class()(doc, run_spec, source, spec.attention, target, keep_4bit_input)
    backend = backend if backend is not None else TrackerBackend(fake=True, granularity=granularity(target))
    with workload.stack, warnings.catch_warnings():
        # the simulation builds a paged optimizer on the CPU, where bitsandbytes warns that paging falls back;
        # the estimate models the paged state itself, so the warning is about the simulation, not the user's run
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU", category=UserWarning)
        result = run_protocol(workload, backend, device="cpu", steps=1)
    if result.oom or not result.complete:  # no limit is set: cannot happen, but never report a partial run
        raise _err(doc, ("identity",), f"the simulated step stopped early ({result.oom_message})", _MEASURE_HINT)
    out = {name: rec.figure for name, rec in result.phases.items()}
    out["activations"] = result.activations_saved or 0
    held = by_component(result.phases["after_adapter_injection"].census)
    grads = by_component(result.phases["backward_peak"].census)
    state = by_component(result.phases["optimizer_step_peak"].census)
    out["component.frozen_base"] = held.get("frozen_base", 0)
    out["component.adapter"] = held.get("adapter", 0)
    out["component.gradients"] = grads.get("gradients", 0)
    out["component.optimizer"] = state.get("optimizer", 0)
    out["stack.fused_experts"] = workload.fused_experts
    out["stack.legacy_moe"] = int(workload.legacy_moe)
    out["stack.moe_family"] = int(workload.moe_family)
    if workload.offload is not None:
        out["host.offloaded_peak"] = workload.offload.host_peak
    for name, rec in result.phases.items():  # what is alive at each phase's peak, by ledger component
        live = by_component(rec.categories_at_peak or {})
        for comp in AT_PEAK:
            out[f"at.{name}.{comp}"] = live.get(comp, 0)
    return out


def _fail(doc: Document, exc: BaseException, architecture: str | None) -> LedgerspecError:
    """A trace failure as one clear line: which op or architecture, and what to do instead."""
    from ledgerspec.derivations.estimate.attention import UnsupportedAttention

    text = first_line(exc)
    if isinstance(exc, UnsupportedAttention):
        return _err(
            doc, ("software", "attention_implementation"), f"cannot model this attention: {text}", _MEASURE_HINT
        )
    name = type(exc).__name__
    op = getattr(exc, "func", None) or getattr(exc, "op", None)
    from ledgerspec.derivations.engine.tracker import MixedDtypeMatmul

    if isinstance(exc, MixedDtypeMatmul) and "index_add" in str(exc.func):  # a MoE loop's accumulation
        return _err(
            doc,
            ("software", "transformers") if doc.get("software", "transformers").present else ("identity",),
            f"the declared step cannot run: {text} (the simulation found it; a real run fails there: an MoE block adds "
            "its experts' outputs into a buffer of another dtype)",
            "e.g. transformers 4.51-4.57.6's DeepSeek-V3 MoE accumulates in the router's dtype (bfloat16 under "
            "autocast) while PEFT's k-bit preparation makes the experts' outputs float32: declare "
            "base_model.prepare_for_kbit_training: false, or a transformers >= 5.0.0 (it casts before index_add_)",
        )
    if isinstance(exc, MixedDtypeMatmul):  # not a limit of the simulation: the declared step cannot run
        return _err(
            doc,
            ("identity",),
            f"the declared step cannot run: {text} (the simulation found it; a real run fails there)",
            "check the dtypes: adapter.dtype, base_model.loaded_dtype, training.mixed_precision (autocast casts "
            "both operands), parallelism.mixed_precision_policy",
        )
    if isinstance(exc, ValueError) and "Attempting to unscale FP16 gradients" in str(exc):
        return _err(
            doc,
            ("adapter", "dtype") if doc.get("adapter", "dtype").present else ("identity",),
            "the declared step cannot run: fp16 loss scaling refuses float16 gradients (torch.amp.GradScaler, which "
            "accelerate uses on one GPU and under FSDP2; only FSDP1's ShardedGradScaler unscales them), so a real run "
            "fails at its first optimizer step as the simulation did",
            "keep the adapters in float32 (adapter.dtype: float32; fp16 autocast still computes in float16), or train "
            "in bf16 (training.mixed_precision: bf16)",
        )
    if failed_in_optimizer_step(exc):  # forward and backward traced; the optimizer's update failed
        at = f" in op {op}" if op is not None else ""
        return _err(
            doc,
            ("optimizer", "name") if doc.get("optimizer", "name").present else ("identity",),
            f"the simulated optimizer step failed{at}, after forward and backward ({name}: {text})",
            _MEASURE_HINT,
        )
    if op is not None or name in (
        "UnsupportedFakeTensorException",
        "DynamicOutputShapeException",
        "DataDependentOutputException",
        "UnsupportedOperatorException",
    ):
        which = f"op {op}" if op is not None else "an op"
        return _err(
            doc,
            ("identity",),
            f"{which} has no fake-tensor kernel, the step cannot be simulated ({name}: {text})",
            _MEASURE_HINT,
        )
    arch = architecture or "this architecture"
    return _err(doc, ("identity",), f"{arch} cannot be traced under FakeTensorMode ({name}: {text})", _MEASURE_HINT)


def failed_in_optimizer_step(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside the training step's ``optimizer_step`` (the loops of
    :mod:`ledgerspec.derivations.engine.step`): its traceback passes through that method."""
    from ledgerspec.derivations.engine import step

    source = step.__file__
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "optimizer_step" and code.co_filename == source:
            return True
        tb = tb.tb_next
    return False


def padding_text(attention: str, target: str) -> str:
    """The method sentence for padded batches (microbatch > 1 without packing or padding-free batching)."""
    text = (
        "padded batches: every row max length but the last, one token shorter (attention mask 0, label -100 "
        "at its last position), the mask passed to the model"
    )
    if attention == "sdpa" and target == "cuda":
        text += (
            "; SDPA then takes the memory-efficient kernel with k/v repeated to all heads and saves the mask's "
            "additive bias in every layer"
        )
    if attention.startswith("flash_attention") and target == "cuda":
        text += (
            "; for flash attention the mask is NOT passed: padded rows are modelled as full rows (transformers' "
            "unpad/varlen path gathers q/k/v into (tokens, heads, dim) copies of nearly the same size; those "
            "copies are not modelled)"
        )
    return text


def method_text(est_plan: Plan, spec: Any, target: str) -> str:
    """What the estimate simulated, in words (``ledger.activations.method``): the depth plan, the attention
    kernel, the 4-bit layers, the step (:func:`ledgerspec.derivations.engine.workload.method_notes`) and limits."""
    from ledgerspec.derivations.engine.workload import method_notes
    from ledgerspec.derivations.estimate.attention import method_text as attention_method

    attention, quant, padded = spec.attention, spec.quant is not None, spec.padded
    parts = [
        "ledgerspec estimate: one training step plus a steady-state step simulated under torch FakeTensorMode "
        "(exact model, adapters, optimizer, checkpointing; no GPU), every tensor storage counted by a dispatch-level "
        "tracker",
        est_plan.describe(),
        attention_method(attention)
        if target == "cuda"
        else "attention: the CPU kernels (target cpu; SDPA as PyTorch's CPU flash kernel: output + fp32 log-sum-exp)",
    ]
    if quant:
        parts.append("4-bit layers: bitsandbytes storage exact, CUDA dequantize+linear temporaries counted")
    if spec.gptq is not None and spec.gptq.scheme == "awq":
        parts.append(
            "AWQ layers: the GEMM QuantLinear buffers exact (qweight, qzeros, scales), its training kernel (the input "
            "kept for backward, the weight dequantized above 1,024 rows, a batch-size copy of it in backward), PEFT's "
            "AwqLoraLinear on top"
        )
    elif spec.gptq is not None:
        parts.append(
            f"GPTQ layers: the QuantLinear buffers exact (qweight, qzeros, scales, g_idx), kernel {spec.gptq.kernel} "
            + (
                "(the weight dequantized to a float16 workspace in forward and again in backward, nothing kept)"
                if spec.gptq.kernel == "triton_v2"
                else "(the dequantized weight kept by autograd for backward)"
            )
            + ", PEFT's GPTQLoraLinear on top"
        )
    if target == "cuda":
        parts.append("each allocation rounded up to 512 B as the CUDA caching allocator does")
    parts.append(method_notes(spec, target))
    if padded:
        parts.append(padding_text(attention, target))
    parts.append(
        "limits: PyTorch tensors only (no CUDA context, cuBLAS workspace, allocator caching or "
        "fragmentation, NCCL); activations = bytes held from forward to backward of the first micro-step"
    )
    return "; ".join(parts)


def estimate(
    doc: Document,
    target: str = "cuda",
    layers: str = "auto",
    progress: Progress | None = None,
    offline: bool = True,
    store: EstimateCache | None = None,
    parallel: bool = False,
) -> Estimate:
    """The estimate of ``doc``. ``layers``: ``auto`` (extrapolate when possible) or ``full``. With ``store``, an
    estimate of the same inputs on the same stack is answered from it (:mod:`.cache`), and a new one is kept there.
    ``parallel``: trace the two depth probes at once, the deeper one in a forked process, when this process has
    traced nothing yet (:mod:`ledgerspec.derivations.engine.beside`; the figures are the same either way).
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}")
    check_document(doc)
    question = {"target": target, "layers": layers, "offline": offline}
    return cached(
        store,
        doc,
        question,
        lambda: _estimate(doc, target, layers, progress, offline, parallel),
        Estimate.to_cache,
        Estimate.from_cache,
    )


@dataclass
class Prepared:
    """What an estimate of a document traces, read once (:func:`prepare`): the workload, the model's config and the
    depth plan. :meth:`trace` runs one protocol at a depth; :func:`assemble` turns the (extended) figures into an
    :class:`Estimate`. The allocator's full-depth stream (:mod:`ledgerspec.derivations.allocator.step`) traces
    through the same object, so its probes give the estimate's figures too."""

    doc: Document
    spec: Any
    source: Any
    plan: Plan
    target: str
    keep_input: bool
    say: Progress
    started: float

    def warm(self) -> None:
        """Import what a trace of this stack imports (the model class's module and through it transformers' masking
        and attention code, PEFT for adapters, bitsandbytes as PEFT imports it), before a probe is forked beside
        this process (:mod:`ledgerspec.derivations.engine.beside`): the forked probe then finds them imported
        instead of importing them again itself (about 3 s of CPU on a 7B Llama LoRA estimate, on a machine whose
        two cores the two probes share). Nothing else: an import that fails here is left to the trace to report."""
        import importlib

        from ledgerspec.derivations.stack.build import model_class
        from ledgerspec.derivations.stack.quiet import quiet_bitsandbytes

        try:
            import transformers

            quiet_bitsandbytes()  # as the trace imports it (its warning dropped, torch.compile deferred)
            chosen = model_class(self.source.config)
            if chosen is not None:
                getattr(transformers, chosen.class_name)
        except Exception:  # an optimisation only: the trace reports what fails
            return
        if not self.spec.full:  # and what get_peft_model imports when it runs (peft/tuners/lora/model.py,
            # tuners_utils.py at peft 0.21.2)
            for name in ("peft", "peft.tuners.lora.bnb", "peft.utils.transformers_weight_conversion"):
                try:
                    importlib.import_module(name)
                except Exception:  # another peft version, no bitsandbytes: the trace imports what it needs
                    continue

    def trace(self, layers: int | None, backend: Any = None) -> dict[str, int]:
        """One simulated protocol run with ``layers`` decoder layers (None: the model's own), counted by
        ``backend`` (None: a new tracker); a failure inside torch or transformers as one clear line."""
        from ledgerspec.derivations.stack.build import ModelSource

        source = self.source
        if layers is not None:
            source = ModelSource(
                with_layers(source.config, layers), source.config_file, source.sha256, source.architecture
            )
        self.say(f"tracing {layers or self.plan.layers} layers")
        try:
            return trace(self.doc, self.spec, source, self.target, self.keep_input, backend=backend)
        except LedgerspecError:
            raise
        except Exception as exc:  # any failure inside torch/transformers: one clear line, never a wrong number
            raise _fail(self.doc, exc, self.source.architecture) from None


def prepare(
    doc: Document, target: str = "cuda", layers: str = "auto", progress: Progress | None = None, offline: bool = True
) -> Prepared:
    """Read what an estimate of ``doc`` traces (``layers``: ``auto`` extrapolates from probes when the stack allows,
    ``full`` traces every layer); the errors the estimate gives before it traces anything."""
    started = time.perf_counter()
    say = progress or (lambda _msg: None)
    say("loading the model config")
    from ledgerspec.derivations.engine.workload import WorkloadSpec
    from ledgerspec.derivations.stack.build import load_config

    spec = WorkloadSpec.from_document(doc)
    _check_attention(doc, spec.attention)
    _check_kernels(doc, spec, target)
    source = load_config(doc, offline=offline)
    try:
        est_plan = plan(source.config)
    except ValueError:
        raise _err(
            doc,
            ("identity",),
            f"{source.architecture or 'this model'} has no num_hidden_layers: not a "
            "decoder stack the estimate can trace",
            _MEASURE_HINT,
        ) from None
    if layers == "full":
        est_plan = Plan(est_plan.layers, est_plan.period, None, "full trace requested")
    elif est_plan.probes is not None and spec.generation is not None and spec.generation.vllm == "server":
        # vLLM's packed weight transfer concatenates the whole parameter list into chunks of just over 1 GiB: its
        # chunks (and the generation peak they set) are not affine in the layers, two shallow probes cannot give them
        est_plan = Plan(
            est_plan.layers, est_plan.period, None, "vLLM's packed weight transfer is not affine in the layers"
        )
    return Prepared(doc, spec, source, est_plan, target, keeps_4bit_input(doc, spec), say, started)


def _estimate(
    doc: Document, target: str, layers: str, progress: Progress | None, offline: bool, parallel: bool
) -> Estimate:
    p = prepare(doc, target, layers, progress, offline)
    if p.plan.probes is None:
        figures = p.trace(None)
    else:
        n1, n2 = p.plan.probes
        from ledgerspec.derivations.engine.beside import both, can_fork

        if parallel and can_fork():
            p.warm()
        shallow, deep = both(lambda: p.trace(n1), lambda: p.trace(n2), parallel)
        figures = extend_all(shallow, deep, n1, n2, p.plan.layers)
    return assemble(p, figures)


def assemble(p: Prepared, figures: dict[str, int]) -> Estimate:
    """The :class:`Estimate` of the figures of ``p``'s step at full depth (traced, or extended from the probes)."""
    from ledgerspec.derivations.stack.build import MULTIMODAL_LIMIT, model_class

    doc, spec, est_plan, target = p.doc, p.spec, p.plan, p.target
    figures = dict(figures)
    legacy_moe = bool(figures.pop("stack.legacy_moe", 0))
    moe_family = bool(figures.pop("stack.moe_family", 0))
    text_config = p.source.config.get_text_config() if hasattr(p.source.config, "get_text_config") else None
    model_type = getattr(p.source.config, "model_type", None) or getattr(text_config, "model_type", None)
    differences, notes = _differences(
        doc, spec, p.keep_input, figures.pop("stack.fused_experts", 0), legacy_moe, moe_family
    )
    if mask := causal_mask_window(doc, spec.attention, model_type):
        key, entry, note = mask
        differences[key] = entry
        notes += [note] if note else []
    phases = {k: figures[k] for k in ALL_PHASES if k in figures}
    components = {k: figures[f"component.{k}"] for k in COMPONENTS}
    components["activations"] = figures["activations"]
    method = method_text(est_plan, spec, target)
    if p.keep_input:
        method += (
            f"; bitsandbytes {doc.get('software', 'bitsandbytes').value} as declared: each 4-bit layer keeps its "
            "input for backward (MatMul4Bit before 0.43.2)"
        )
    from ledgerspec.derivations.estimate import legacy_loss

    if legacy_loss.models_shift_copy(doc):
        method += "; " + legacy_loss.method_note(doc)
    if legacy_moe:
        from ledgerspec.derivations.stack.legacy_moe import method_note as moe_note

        method += "; " + moe_note(doc, p.source.config)
    from ledgerspec.derivations.kernels.apply import method_note as kernels_note
    from ledgerspec.derivations.kernels.apply import unpatched_note

    if kernels_note(spec.kernels):
        method += "; " + str(kernels_note(spec.kernels))
    if unpatched := unpatched_note(spec.kernels, model_type):
        method += "; " + unpatched
    if spec.offload:
        method += (
            "; activation offloading as TRL's OffloadActivations does it (streams, pinned host memory, tensors of "
            "1 KiB and more but parameters, five kept on the device while their copy runs, copied back per autograd "
            f"node): host memory held {figures.get('host.offloaded_peak', 0):,} B at most"
        )
    if (chosen := model_class(p.source.config)) is not None and chosen.multimodal:  # the class the config calls for
        method += f"; {MULTIMODAL_LIMIT}"
    at_peak = {comp: figures[f"at.{peak_phase(phases)}.{comp}"] for comp in AT_PEAK}
    return Estimate(
        phases,
        figures["activations"],
        components,
        est_plan,
        spec.attention,
        target,
        time.perf_counter() - p.started,
        method,
        notes=notes,
        at_peak=at_peak,
        figures=figures,
        stack=installed_stack(),
        differences=differences,
    )


def keeps_4bit_input(doc: Document, spec: Any) -> bool:
    """Model bitsandbytes < 0.43.2's MatMul4Bit (input kept for backward): declared, or installed when undeclared."""
    from ledgerspec.contract.differences import OLDER
    from ledgerspec.derivations.stack.versions import declared_side, installed_side

    if spec.quant is None:
        return False
    key = "bitsandbytes-4bit-matmul-input"
    return (declared_side(doc, key) or installed_side(key)) == OLDER


def _differences(
    doc: Document, spec: Any, keep_input: bool, fused_experts: int, legacy_moe: bool = False, moe_family: bool = False
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The known stack differences that apply to this estimate, with the side it computed, and notes to print."""
    from ledgerspec.contract.differences import BY_ID, NEWER, OLDER
    from ledgerspec.derivations.stack.versions import declared_side, installed_side, record

    out: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    from ledgerspec.derivations.estimate.legacy_loss import KEY as LOSS_KEY
    from ledgerspec.derivations.estimate.legacy_loss import models_shift_copy

    if models_shift_copy(doc):  # modelled as declared (transformers < 4.49's loss); recorded only then
        out[LOSS_KEY] = record(OLDER)
        from ledgerspec.derivations.estimate.legacy_loss import FLOAT_KEY, models_float_logits

        if models_float_logits(doc):  # and < 4.46's upcast in the model's forward
            out[FLOAT_KEY] = record(OLDER)
    if spec.gptq is not None and spec.gptq.scheme == "gptq":
        key = "peft-gptq-lora-input-cast"
        out[key] = record(OLDER if spec.gptq.older_lora else NEWER)
        if spec.gptq.older_lora and installed_side(key) == NEWER:
            d = BY_ID[key]
            notes.append(f"modelled the declared {d.span(OLDER)}: {d.older} [{key}]")
    if legacy_moe:  # modelled as declared: transformers 4's per-expert nn.Linear experts and routing loop
        out["transformers-moe-fused-experts"] = record(OLDER)
    elif moe_family and not fused_experts:  # the installed layout, whatever the base: recorded, so a later
        # declaration of transformers 4 shows against this estimate (a 4-bit base records it below, with its bytes)
        out["transformers-moe-fused-experts"] = record(installed_side("transformers-moe-fused-experts"))
    if spec.quant is None:
        return out, notes
    key = "bitsandbytes-4bit-matmul-input"
    out[key] = record(OLDER if keep_input else NEWER)
    if keep_input and installed_side(key) == NEWER:
        d = BY_ID[key]
        notes.append(f"modelled the declared {d.span(OLDER)}: {d.older} [{key}]")
    if fused_experts:
        key = "transformers-moe-fused-experts"
        side = installed_side(key)
        out[key] = record(side, fused_experts if side == NEWER else None)
        if (declared := declared_side(doc, key)) not in (None, side):
            sign = "+" if fused_experts < 0 else "-"
            moves = f"frozen base {sign}{format_size(abs(fused_experts))} against the declared stack; "
            notes.append(_unmodelled_note(doc, key, str(declared), side, moves))
    return out, notes


def _unmodelled_note(doc: Document, key: str, declared: str, installed: str, moves: str = "") -> str:
    """The note for a known difference the estimate does not model, where ``software.<package>`` declares the side
    (``declared``) the installed stack is not on (``installed``); ``moves``: what it moves, when known."""
    from ledgerspec.contract.differences import BY_ID

    d = BY_ID[key]
    return (
        f"software.{d.package} declares {doc.get('software', d.package).value}: {d.behaviour(declared)}; this "
        f"estimate ran {d.package} {installed_stack().get(d.package)}: {d.behaviour(installed)} ({moves}not "
        f"modelled) [{key}]"
    )


#: the model types whose transformers 4.38-4.39 code builds an explicit causal mask for SDPA
#: (``transformers-sdpa-explicit-causal-mask``: ``_update_causal_mask`` in 4.38.2 and 4.39.1; Cohere from 4.39)
EXPLICIT_MASK_MODEL_TYPES = frozenset({"llama", "gemma", "cohere"})


def causal_mask_window(
    doc: Document, attention: str | None, model_type: Any
) -> tuple[str, dict[str, Any], str | None] | None:
    """The record of ``transformers-sdpa-explicit-causal-mask`` for an SDPA estimate of a model type it concerns
    (the side the installed transformers computed; not modelled), and a note when ``software.transformers``
    declares the other side. None where it does not apply."""
    from ledgerspec.derivations.stack.versions import declared_side, installed_side, record

    key = "transformers-sdpa-explicit-causal-mask"
    if attention != "sdpa" or model_type not in EXPLICIT_MASK_MODEL_TYPES:
        return None
    side, declared = installed_side(key), declared_side(doc, key)
    note = _unmodelled_note(doc, key, declared, side) if declared not in (None, side) else None
    return key, record(side), note


def check_document(doc: Document) -> None:
    """What the estimate refuses before it imports anything heavy: not a ledgerspec document, an incomplete intake."""
    if doc.kind not in ("ledger", "intake"):
        raise _err(doc, ("ledgerspec",), "not a ledgerspec document", "start with `ledgerspec: ledger/v1`")
    _check_intake(doc)


def _check_intake(doc: Document) -> None:
    """The simulation needs the minimum intake (the model's identity may be a local config instead)."""
    from ledgerspec.contract.intake import minimum_intake_gaps

    local = doc.get("identity", "config_path").known
    gaps = [g for g in minimum_intake_gaps(doc) if not (local and g.startswith("identity."))]
    if gaps:
        first = gaps[0].split(" ")[0].split(".")
        raise _err(
            doc,
            tuple(first),
            f"cannot simulate an incomplete configuration: {'; '.join(gaps)}",
            f"fill the minimum intake (`ledgerspec validate {doc.path} -v` lists it)",
        )


def _check_kernels(doc: Document, spec: Any, target: str) -> None:
    """The declared kernels the simulation models run on a CUDA GPU and inside the model's forward."""
    from ledgerspec.derivations.kernels.apply import modelled

    done = modelled(spec.kernels)
    if target == "cpu" and spec.loop == "trainer":  # TRL's fused head runs on the CPU as it is (engine/trl_sft.py)
        done = tuple((op, k) for op, k in done if not (op == "cross_entropy" and k == "trl_chunked_nll"))
    if not done:
        return
    op, name = done[0]
    if target == "cpu":
        raise _err(
            doc,
            ("software", "kernels", op),
            f"{name} runs a Triton kernel on the GPU, which the CPU does not run (it runs other code or nothing), so "
            "`estimate --target cpu` cannot model it",
            "estimate for the GPU (the default target), or declare eager kernels for a CPU check",
        )
    if op == "cross_entropy" and spec.loop != "trainer" and spec.kernels.fused_loss:
        raise _err(
            doc,
            ("software", "kernels", "cross_entropy"),
            f"{name} computes the loss inside the model's forward from its labels; training.loop: custom keeps the "
            "logits and computes its own loss",
            "use training.loop: trainer (the Trainer's step), or declare cross_entropy: eager",
        )


def _check_attention(doc: Document, attention: str) -> None:
    from ledgerspec.derivations.estimate.attention import KNOWN

    if attention not in KNOWN:
        raise _err(
            doc,
            ("software", "attention_implementation"),
            f"attention implementation {attention!r} is not modelled by the estimate (modelled: {', '.join(KNOWN)})",
            _MEASURE_HINT,
        )


def device_memory_of(doc: Document) -> int | None:
    """The target device memory declared in ``result.target_device.memory``, if any."""
    return doc.get("result", "target_device", "memory").size()


def write_back(
    doc: Document, est: Estimate, device_memory: int | None, from_flag: bool, device: Any = None
) -> list[Any]:
    """Record the estimate in a ledger: ``ledger.activations``, ``x-estimate`` and, with a device, the fit.

    ``temporary`` is never written (MEASURED only). A stronger ``ledger.activations`` (MEASURED) is kept.
    ``x-estimate.inputs`` fingerprints the fields the estimate read (:mod:`ledgerspec.contract.fingerprint`).
    ``device``: the prediction on the device
    (:class:`ledgerspec.derivations.devices.prediction.DevicePrediction`): the verdict (``fits``, ``headroom``,
    ``oom_phase``, ``result.fits``) is then the device's, and its figures (``peak_reserved``, ``device_peak``, per
    phase, and ``verdict``) are written beside the allocated ones; without it the verdict compares the allocated
    peak.
    """
    from ledgerspec.contract.edit import set_extension, set_figure, set_plain
    from ledgerspec.contract.fingerprint import WORKLOAD_INPUTS, digests
    from ledgerspec.contract.subtotal import write_subtotal
    from ledgerspec.version import __version__

    changes: list[Any] = []
    changes.append(set_figure(doc, ("ledger", "activations"), est.activations, "CALCULATED", method=est.method))
    block: dict[str, Any] = {
        "source": "CALCULATED",
        "peak_allocated": {
            "value": est.peak_allocated,
            "source": "CALCULATED",
            "method": "maximum of the predicted phase peaks (bytes allocated by PyTorch tensors)",
        },
        "phases": dict(est.phases),
        "components": dict(est.components),
        "at_peak": {"phase": est.peak_phase, **est.at_peak},
        "target": est.target,
        "attention_implementation": est.attention,
        "layers": est.plan.describe(),
        "tool": f"ledgerspec {__version__}",
    }
    if device_memory is not None:
        if device is not None and device.total == device_memory:
            fits, headroom, oom_phase = device.fits, device.margin, device.oom_word
        else:
            verdict = est.fit(device_memory)
            fits, headroom, oom_phase = verdict.fits, verdict.headroom, verdict.oom_phase
        block.update({"device_memory": device_memory, "fits": fits, "headroom": headroom})
        if oom_phase:
            block["oom_phase"] = oom_phase
        if device is not None and device.total == device_memory:
            block.update(device.extension())
        if from_flag:
            changes.append(set_plain(doc, ("result", "target_device", "memory"), device_memory, force=True))
        if sharded_ranks(doc) is None:  # sharded ranks: one GPU of the whole model is not the run's answer
            changes.append(set_plain(doc, ("result", "fits"), fits, force=True))
    if "host.offloaded_peak" in est.figures:
        block["host_offloaded_peak"] = {
            "value": est.figures["host.offloaded_peak"],
            "source": "CALCULATED",
            "method": "host memory the offloaded activations hold at most (pinned; not device memory)",
        }
    block["stack"] = dict(est.stack)
    if est.differences:
        block["differences"] = {k: dict(v) for k, v in est.differences.items()}
    block["inputs"] = digests(doc, WORKLOAD_INPUTS)  # what it was estimated from: `validate` notices edits (LS006)
    changes.append(set_extension(doc, ("x-estimate",), block))
    changes.append(write_subtotal(doc))  # now with activations, as `resolve` would write it
    return [c for c in changes if c is not None]
