"""The training workload a ledger declares, as real (CPU/CUDA) or fake tensors.

Shared by ``measure`` (real tensors, one child process per measurement) and ``estimate`` (fake
tensors under ``FakeTensorMode``). Memory does not depend on weight values, so the model is the
exact architecture from its config with random weights: no download.

Order of work (the protocol in :mod:`ledgerspec.derivations.engine.protocol` measures between the steps):

1. :meth:`Workload.prepare` (no memory): the base model on the meta device in ``loaded_dtype``
   with the declared attention implementation; for QLoRA the ``nn.Linear`` layers replaced by
   bitsandbytes ``Linear4bit`` exactly as transformers' bnb quantizer does (same skip modules);
   PEFT's ``prepare_model_for_kbit_training`` when declared (the fp32 upcast of non-quantized
   parameters); the exact adapters injected with :func:`ledgerspec.derivations.stack.build.inject_adapters`.
2. :meth:`Workload.materialise_base`: base parameters and buffers created on the device with
   random values (QLoRA weights quantized with bitsandbytes from a dense ``loaded_dtype`` tensor,
   one weight at a time like transformers' loader); rotary buffers computed by transformers.
3. :meth:`Workload.materialise_adapters`: the adapter weights, in the declared ``adapter.dtype``;
   gradient checkpointing enabled as declared (``gradient_checkpointing_enable`` with
   ``use_reentrant`` from ``checkpointing_kind``; transformers also calls
   ``enable_input_require_grads``, as the Trainer path does).
4. :meth:`Workload.make_optimizer`: the declared optimizer over the trainable parameters, as the
   transformers Trainer builds it for that name.
5. :meth:`Workload.batch`, :meth:`Workload.forward`, :meth:`Workload.loss`, :meth:`Workload.backward`,
   :meth:`Workload.optimizer_step`: one micro-step at a time; gradient accumulation is sequential
   micro-steps (accumulation is not a bigger activation batch).

For fake tensors enter ``FakeTensorMode(allow_non_fake_inputs=True)`` (and any tracker) after
:meth:`prepare` and materialise with ``device="cpu"``; :meth:`prepare` pre-builds bitsandbytes'
quantization maps so that 4-bit quantization runs under the fake mode.

Modelling choices (also in :data:`METHOD_NOTES`): no autocast (compute dtypes are the declared
ones), ``use_cache=False`` in training forwards, loss = transformers' own causal-LM loss function
(fp32 upcast of logits included), loss divided by the accumulation steps as the Trainer does,
``zero_grad(set_to_none=True)`` after each optimizer step, dropout active (``model.train()``).
Padded batches (microbatch > 1 without packing or padding-free batching, :func:`rows_are_padded`) carry an
attention mask with one padding position, as a padding collator's batch does (:meth:`Workload.batch`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ledgerspec.contract import config
from ledgerspec.contract.document import Document, ErrorAt
from ledgerspec.derivations.stack.build import ModelSource, build_base, inject_adapters, load_config
from ledgerspec.derivations.stack.quiet import quiet_bitsandbytes

#: optimizer names this workload can build (the transformers Trainer's names, plus plain ``adam``)
OPTIMIZERS = (
    "adamw_torch",
    "adamw_torch_fused",
    "adam",
    "sgd",
    "adamw_8bit",
    "adamw_bnb_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "adafactor",
)
ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
METHOD_NOTES = (
    "random weights from the exact config; synthetic token batches; no autocast; use_cache=False; "
    "transformers' causal-LM loss; sequential accumulation micro-steps; zero_grad(set_to_none=True)"
)
LEARNING_RATE = 2e-4  # any value: memory does not depend on it


_err = ErrorAt("workload")  # estimate and measure both build it


@dataclass(frozen=True)
class QuantSpec:
    """bitsandbytes 4-bit quantization as declared in ``base_model.quantization``."""

    quant_type: str  # nf4 | fp4
    double_quant: bool
    compute_dtype: str
    storage_dtype: str
    blocksize: int | None = None
    skip_modules: tuple[str, ...] | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """Every knob of the workload, read from a document; triage changes one at a time with :meth:`changed`."""

    loaded_dtype: str
    quant: QuantSpec | None
    prepare_kbit: bool
    adapter_dtype: str | None
    optimizer: str
    min_8bit_size: int | None
    gradient_checkpointing: bool
    reentrant: bool
    attention: str
    microbatch: int
    accumulation: int
    seq_worst: int
    seq_typical: int
    #: the document pads rows to the longest one (packing off, padding_free not true); batches are padded only
    #: when a micro-step has more than one row: see :attr:`padded` (so ``changed(microbatch=1)`` stays exact)
    pads_rows: bool = False

    @property
    def padded(self) -> bool:
        """Whether a micro-step's batch carries padding and an attention mask (see :func:`rows_are_padded`)."""
        return self.pads_rows and self.microbatch > 1

    @classmethod
    def from_document(cls, doc: Document) -> WorkloadSpec:
        """The workload of ``doc`` (:func:`ledgerspec.contract.config.read`); a knob the step cannot run is a
        one-line error at its field."""
        cfg = config.read(doc)

        def dtype(path: tuple[str, ...], default: str | None = None) -> str:
            return config.require_dtype(doc, path, default, rule="measure")

        loaded = dtype(("base_model", "loaded_dtype"), "float32")
        quant = None
        q = cfg.quantization
        if q.quantized:
            path = config.QUANT
            if not q.four_bit:
                raise _err(
                    doc, (*path, "type"), f"measure supports 4-bit nf4/fp4 quantization, got {q.type or 'nothing'!r}"
                )
            if q.double_quant is None:
                raise _err(doc, (*path, "double_quant"), "base_model.quantization.double_quant must be true or false")
            quant = QuantSpec(
                q.type or "",
                q.double_quant,
                dtype((*path, "compute_dtype")),
                dtype((*path, "storage_dtype"), config.DEFAULT_STORAGE),
                q.blocksize,
                q.skip_modules,
            )
        adapter = dtype(("adapter", "dtype")) if cfg.adapter_dtype else None  # None: PEFT's float32
        opt = cfg.optimizer.key
        if opt not in OPTIMIZERS:
            raise _err(
                doc,
                ("optimizer", "name"),
                f"the training step cannot build optimizer {opt or 'nothing'!r} (estimate, measure)",
                f"use one of {', '.join(OPTIMIZERS)}",
            )
        if cfg.gradient_checkpointing is None:
            raise _err(
                doc,
                ("memory_options", "gradient_checkpointing"),
                "memory_options.gradient_checkpointing must be true or false",
            )
        attention = cfg.attention or "sdpa"
        if attention not in ATTENTION:
            raise _err(
                doc,
                ("software", "attention_implementation"),
                f"unknown attention implementation {attention!r}",
                f"use one of {', '.join(ATTENTION)}",
            )
        w = cfg.workload
        if w.microbatch is None or w.microbatch < 1:
            raise _err(doc, ("workload", "microbatch"), "workload.microbatch must be an integer >= 1")
        worst, typical = sequence_shapes(doc)
        return cls(
            loaded,
            quant,
            cfg.prepare_kbit,
            adapter,
            opt,
            cfg.optimizer.min_8bit_size,
            cfg.gradient_checkpointing,
            cfg.reentrant,
            attention,
            w.microbatch,
            max(w.gradient_accumulation or 1, 1),
            worst,
            typical,
            rows_are_padded(doc),
        )

    def changed(self, **changes: Any) -> WorkloadSpec:
        """A copy with some knobs changed (``microbatch=1``, ``seq_worst=512``, ``optimizer="adamw_8bit"``...)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkloadSpec:
        data = dict(data)
        q = data.get("quant")
        if q is not None:
            q = dict(q)
            if q.get("skip_modules") is not None:
                q["skip_modules"] = tuple(q["skip_modules"])
            data["quant"] = QuantSpec(**q)
        return cls(**data)


def sequence_shapes(doc: Document) -> tuple[int, int]:
    """(worst, typical) sequence lengths of the declared profile (:class:`ledgerspec.contract.config.Workload`)."""
    w = config.read(doc).workload
    if w.worst is None or w.typical is None:
        raise _err(doc, ("workload",), "workload.max_length or workload.sequence_p95 is needed for a batch shape")
    return w.worst, w.typical


def rows_are_padded(doc: Document) -> bool:
    """Whether the declared batches pad every row to the batch's longest one
    (:attr:`ledgerspec.contract.config.Workload.pads_rows`); a batch of one row never is (:attr:`WorkloadSpec.padded`).
    """
    return config.read(doc).workload.pads_rows


def _is_4bit(p: Any) -> bool:
    return type(p).__name__ == "Params4bit"


class Workload:
    """The model, optimizer and batches of one spec; see the module docstring for the order of calls."""

    def __init__(self, doc: Document, spec: WorkloadSpec | None = None, source: ModelSource | None = None) -> None:
        self.doc = doc
        self.spec = spec or WorkloadSpec.from_document(doc)
        self.source = source
        self.model: Any = None  # the PeftModel
        self.optimizer: Any = None
        self._memo: dict[int, Any] = {}
        self.device: Any = None

    # -- 1. on the meta device ------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Build base + quantization layout + adapters on the meta device (no memory is used).

        Idempotent: a caller may prepare first, adjust the meta model (e.g. patch attention), then run the protocol.
        """
        if self.model is not None:
            return
        import torch

        spec = self.spec
        if self.source is None:
            self.source = load_config(self.doc, offline=True)
        with torch.device("meta"):  # the auto class the config calls for (stack.build.model_class)
            base = build_base(self.doc, self.source.config, getattr(torch, spec.loaded_dtype), attention=spec.attention)
        if spec.quant is not None:
            self._replace_with_4bit(base)
        if spec.prepare_kbit:
            quiet_bitsandbytes()
            import warnings

            from peft import prepare_model_for_kbit_training

            with warnings.catch_warnings():  # transformers 5 deprecates the name PEFT still calls
                warnings.simplefilter("ignore", FutureWarning)
                base = prepare_model_for_kbit_training(
                    base,
                    use_gradient_checkpointing=spec.gradient_checkpointing,
                    gradient_checkpointing_kwargs={"use_reentrant": spec.reentrant},
                )
        self.model = inject_adapters(self.doc, base)
        if spec.quant is not None:
            self._prewarm_bnb()

    def _replace_with_4bit(self, base: Any) -> None:
        quiet_bitsandbytes()
        import torch
        from transformers import BitsAndBytesConfig
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear
        from transformers.quantizers.base import HfQuantizer

        q = self.spec.quant
        assert q is not None
        bnb_config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=q.quant_type,
            bnb_4bit_use_double_quant=q.double_quant,
            bnb_4bit_compute_dtype=getattr(torch, q.compute_dtype),
            bnb_4bit_quant_storage=getattr(torch, q.storage_dtype),
            llm_int8_skip_modules=list(q.skip_modules) if q.skip_modules is not None else None,
        )
        skip = HfQuantizer.get_modules_to_not_convert(
            base, bnb_config.llm_int8_skip_modules, getattr(base, "_keep_in_fp32_modules", None)
        )
        replace_with_bnb_linear(base, modules_to_not_convert=skip, quantization_config=bnb_config)
        for module in base.modules():
            w = getattr(module, "weight", None)
            if w is not None and _is_4bit(w) and q.blocksize:
                w.blocksize = q.blocksize
        base.is_loaded_in_4bit = True  # what transformers' quantizer sets; PEFT's kbit preparation reads it
        base.config.quantization_config = bnb_config

    def _prewarm_bnb(self) -> None:
        """Build bitsandbytes' cached quantization maps with real tensors (fake tensors cannot build them)."""
        quiet_bitsandbytes()
        import bitsandbytes.functional as bnbf
        import torch

        q = self.spec.quant
        assert q is not None
        w = torch.zeros(128, 64, dtype=getattr(torch, self.spec.loaded_dtype))
        bnbf.quantize_4bit(
            w,
            blocksize=q.blocksize or 64,
            compress_statistics=q.double_quant,
            quant_type=q.quant_type,
            quant_storage=getattr(torch, q.storage_dtype),
        )

    # -- 2./3. materialisation -------------------------------------------------------------------------------------
    def materialise_base(self, device: Any) -> None:
        """Create the base model's parameters and buffers on ``device`` (the protocol's "load")."""
        self.device = device
        self._materialise(device, adapters=False)
        self._init_base()

    def materialise_adapters(self, device: Any) -> None:
        """Create the adapter weights on ``device``; enable gradient checkpointing (the protocol's "inject")."""
        import torch

        self._materialise(device, adapters=True)
        target = getattr(torch, self.spec.adapter_dtype) if self.spec.adapter_dtype else None
        with torch.no_grad():
            for p in self.model.parameters():
                if p.requires_grad:
                    if target is not None and p.dtype != target:
                        p.data = p.data.to(target)
                    p.normal_(0.0, 0.02)
        if self.spec.gradient_checkpointing:
            base = self.model.get_base_model()
            enable = getattr(base, "activation_checkpointing_enable", None)
            kwargs = {"use_reentrant": self.spec.reentrant}
            if enable is not None:
                enable(activation_checkpointing_kwargs=kwargs)
            else:  # older transformers
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.model.train()

    def _materialise(self, device: Any, adapters: bool) -> None:
        import torch

        for module in self.model.modules():
            for pname, p in list(module._parameters.items()):
                # after injection the trainable parameters are exactly the adapter's (PEFT froze the rest)
                if p is None or not p.is_meta or p.requires_grad != adapters:
                    continue
                module._parameters[pname] = self._new_param(p, device, module)
            if adapters:
                continue
            for bname, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    new = self._memo.get(id(b))
                    if new is None:
                        new = torch.empty_like(b, device=device)
                        if new.is_floating_point():
                            new.zero_()
                        self._memo[id(b)] = new
                    module._buffers[bname] = new

    def _new_param(self, p: Any, device: Any, module: Any) -> Any:
        import torch

        hit = self._memo.get(id(p))
        if hit is not None:  # tied weights stay tied
            return hit
        if _is_4bit(p):
            quiet_bitsandbytes()
            import bitsandbytes as bnb

            dense = torch.empty(p.shape, dtype=getattr(torch, self.spec.loaded_dtype), device=device)
            with torch.no_grad():
                dense.normal_(0.0, 0.02)
            from torch._subclasses.fake_tensor import is_fake

            if not is_fake(dense):
                new = bnb.nn.Params4bit(
                    dense,
                    requires_grad=False,
                    blocksize=p.blocksize,
                    compress_statistics=p.compress_statistics,
                    quant_type=p.quant_type,
                    quant_storage=p.quant_storage,
                    module=module,
                )._quantize(device)
            else:  # a FakeTensor cannot become a Params4bit: quantize it and carry the same attributes
                w4, state = bnb.functional.quantize_4bit(
                    dense,
                    blocksize=p.blocksize,
                    compress_statistics=p.compress_statistics,
                    quant_type=p.quant_type,
                    quant_storage=p.quant_storage,
                )
                new = torch.nn.Parameter(w4, requires_grad=False)
                for attr, value in (
                    ("quant_state", state),
                    ("blocksize", p.blocksize),
                    ("quant_type", p.quant_type),
                    ("compress_statistics", p.compress_statistics),
                    ("bnb_quantized", True),
                    ("quant_storage", p.quant_storage),
                    ("module", module),
                ):
                    setattr(new, attr, value)
                module.quant_state = state
            del dense
        else:
            data = torch.empty_like(p, device=device)
            with torch.no_grad():
                if data.is_floating_point():
                    data.normal_(0.0, 0.02)
                else:
                    data.zero_()
            new = torch.nn.Parameter(data, requires_grad=p.requires_grad)
        self._memo[id(p)] = new
        return new

    def _init_base(self) -> None:
        """Recompute computed buffers (rotary frequencies) with transformers' own initialiser."""
        import torch

        base = self.model.get_base_model()
        init = getattr(base, "_init_weights", None)
        if init is None:
            return
        with torch.no_grad():
            for module in base.modules():
                if "RotaryEmbedding" in type(module).__name__ and not any(b.is_meta for b in module.buffers()):
                    init(module)

    # -- 4. optimizer --------------------------------------------------------------------------------------------
    def make_optimizer(self) -> Any:
        """The declared optimizer over the trainable parameters, built as the transformers Trainer builds it."""
        import torch

        params = [p for p in self.model.parameters() if p.requires_grad]
        name = self.spec.optimizer
        bnb_kwargs: dict[str, Any] = {}
        if self.spec.min_8bit_size is not None:
            bnb_kwargs["min_8bit_size"] = self.spec.min_8bit_size
        if name == "adamw_torch":
            opt: Any = torch.optim.AdamW(params, lr=LEARNING_RATE)
        elif name == "adamw_torch_fused":
            opt = torch.optim.AdamW(params, lr=LEARNING_RATE, fused=True)
        elif name == "adam":
            opt = torch.optim.Adam(params, lr=LEARNING_RATE)
        elif name == "sgd":
            opt = torch.optim.SGD(params, lr=LEARNING_RATE)
        elif name == "adafactor":
            from transformers.optimization import Adafactor

            opt = Adafactor(params, lr=LEARNING_RATE, scale_parameter=False, relative_step=False)
        else:
            quiet_bitsandbytes()
            import bitsandbytes as bnb
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            bits = 32 if name.endswith("32bit") else 8
            with unset_fake_temporarily():  # its quantization maps are built from real numbers (no-op when not fake)
                opt = bnb.optim.AdamW(
                    params, lr=LEARNING_RATE, optim_bits=bits, is_paged=name.startswith("paged"), **bnb_kwargs
                )
        self.optimizer = opt
        return opt

    # -- 5. micro-steps ------------------------------------------------------------------------------------------
    def batch(self, seq_len: int) -> tuple[Any, Any]:
        """A synthetic batch ``microbatch x seq_len``: (inputs, labels).

        Unpadded (:attr:`WorkloadSpec.padded` false): inputs are the token ids, labels a copy of them. Padded:
        inputs are ``{"input_ids", "attention_mask"}`` as a padding collator makes them (int64 mask, right
        padding); every row is ``seq_len`` tokens except the last, one token shorter: its last position is
        padding (mask 0, label -100). The worst representative padded batch: the longest row sets the shape and
        one shorter row makes the mask non-trivial, which changes the attention path (explicit 4-D mask; SDPA
        repeats k/v to all heads and CUDA runs the memory-efficient kernel instead of flash).
        """
        import torch

        vocab = int(self.model.get_base_model().config.get_text_config().vocab_size)
        ids = torch.randint(0, vocab, (self.spec.microbatch, seq_len), device=self.device)
        if not self.spec.padded or seq_len < 2:
            return ids, ids.clone()
        mask = torch.ones_like(ids)
        mask[-1, -1] = 0
        labels = ids.clone()
        labels[-1, -1] = -100
        return {"input_ids": ids, "attention_mask": mask}, labels

    def forward(self, inputs: Any) -> Any:
        """The model's forward on :meth:`batch`'s inputs: logits (loss is computed separately, see :meth:`loss`)."""
        if isinstance(inputs, dict):
            out = self.model(**inputs, use_cache=False)
        else:
            out = self.model(input_ids=inputs, use_cache=False)
        return out.logits

    def loss(self, logits: Any, labels: Any) -> Any:
        """transformers' causal-LM loss, divided by the accumulation steps as the Trainer does."""
        base = self.model.get_base_model()
        vocab = int(base.config.get_text_config().vocab_size)
        fn = getattr(base, "loss_function", None)
        if fn is None:
            import torch.nn.functional as nnf

            shift = logits[..., :-1, :].float().reshape(-1, vocab)
            loss = nnf.cross_entropy(shift, labels[..., 1:].reshape(-1))
        else:
            loss = fn(logits=logits, labels=labels, vocab_size=vocab)
        if self.spec.accumulation > 1:
            loss = loss / self.spec.accumulation
        return loss

    def backward(self, loss: Any) -> None:
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


__all__ = [
    "ATTENTION",
    "METHOD_NOTES",
    "OPTIMIZERS",
    "QuantSpec",
    "Workload",
    "WorkloadSpec",
    "rows_are_padded",
    "sequence_shapes",
]
