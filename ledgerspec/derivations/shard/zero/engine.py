"""DeepSpeed ZeRO-2 / ZeRO-3 per rank: the ledger's workload run by DeepSpeed's own engine (issue 16 item 3).

Shared by ``measure --nproc`` with ``parallelism.strategy: zero2|zero3`` (real tensors, one process per rank under
torchrun, gloo on the CPU: ``DS_ACCELERATOR=cpu``) and ``shard --estimate`` (:mod:`ledgerspec.derivations.shard.zero.
simulate`: the same engine under a fake process group and ``FakeTensorMode``). Nothing here is a formula: what
a rank holds is what DeepSpeed 0.19.8 allocates, counted by the dispatch-level tracker.

The order of work is transformers' Trainer with a DeepSpeed config (``transformers.integrations.deepspeed``,
``Trainer._inner_training_loop``; accelerate 1.x ``Accelerator._prepare_deepspeed``):

* ZeRO-3 (``is_deepspeed_zero3_enabled``): ``from_pretrained`` builds the base under ``deepspeed.zero.Init``, so each
  frozen parameter is partitioned as it is loaded (``partition_parameters.py`` ``Init._convert_to_zero_parameters``
  -> ``_zero_init_param`` -> ``param.partition()``: ``param.data`` becomes an empty tensor and the rank keeps
  ``param.ds_tensor``, ``ceil(numel / W)`` elements (``_aligned_size``/``_partition_param``)). Here the base is
  materialised whole, one parameter at a time, and each is handed to ``_convert_to_zero_parameters`` at once, so
  ``after_load`` holds the partitions. The LoRA adapters are created by PEFT after loading, whole, outside
  ``zero.Init``: ``after_adapter_injection`` holds them whole; ``deepspeed.initialize`` partitions them
  (``parameter_offload.py`` ``DeepSpeedZeRoOffload._convert_to_zero_parameters``).
* ZeRO-2: parameters are replicated (whole on every rank); gradients are reduced into buckets and partitioned.
* ``deepspeed.initialize(model, optimizer=<the Trainer's torch optimizer>, config)``: DeepSpeed wraps the client
  optimizer (``DeepSpeedZeroOptimizer_Stage3`` / ``DeepSpeedZeroOptimizer``) with flat fp32 partitions of the
  trainable parameters, its gradient partitions and reduce buckets. ``after_optimizer_init`` is measured after it.
* The step: ``engine(**batch)`` forward (ZeRO-3's hooks gather each module's parameters: the
  ``PartitionedParameterCoordinator`` with its prefetch bucket, ``max_live_parameters``, ``max_reuse_distance`` and
  the persistence threshold), ``engine.backward(loss)``, ``engine.step()``. accelerate calls ``engine.step()`` at the
  end of the last micro-step's backward (``DeepSpeedEngineWrapper.backward``); the protocol calls it in its own
  optimizer phase so that the backward and step peaks are told apart (the largest of them is the same).

Mixed precision: the Trainer does not autocast under DeepSpeed; ``bf16``/``fp16`` in the DeepSpeed config makes the
engine cast the model (``engine._configure_distributed_model``: ``self.module.bfloat16()``) and keep fp32 master
partitions. ``training.mixed_precision: bf16`` / ``fp16`` run the engine's bf16 / fp16 mode (fp16 with its dynamic
loss scaler; DeepSpeed's CPU accelerator is told fp16 is supported, :func:`import_deepspeed`).

CPU offload (``offload_optimizer`` / ``offload_param`` from the document's placements,
:func:`ledgerspec.derivations.shard.options.zero_offload`) is passed to DeepSpeed in the same config; with DeepSpeed's
default ``zero_force_ds_cpu_optimizer`` the step runs ``DeepSpeedCPUAdam`` from the config's ``optimizer`` block.
How the simulation keeps the host apart: :mod:`ledgerspec.derivations.shard.offload.zero`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from functools import cache
from typing import Any

from ledgerspec.derivations.shard.options import CPU_ADAM_TYPES, ZeroOptions
from ledgerspec.derivations.shard.patching import patched

DEEPSPEED_VERSION = "0.19.8"


def ds_config(spec: Any, options: ZeroOptions, bf16: bool = False, fp16: bool = False) -> dict[str, Any]:
    """The DeepSpeed config the Trainer hands to ``deepspeed.initialize`` for this workload (``auto`` values filled
    from the TrainingArguments as ``HfTrainerDeepSpeedConfig.trainer_config_process`` does: ``bf16.enabled`` from
    ``--bf16``). With ``offload_optimizer`` and DeepSpeed's default ``zero_force_ds_cpu_optimizer``, the config
    names the optimizer (``"optimizer": {"type": "AdamW"}``), as DeepSpeed's offload examples do: DeepSpeed builds
    ``DeepSpeedCPUAdam`` from it (``engine.py`` ``get_optimizer_configuration``)."""
    from ledgerspec.derivations.engine.workload import LEARNING_RATE

    extra: dict[str, Any] = {"zero_force_ds_cpu_optimizer": options.force_ds_cpu_optimizer}
    if options.cpu_adam:
        extra["optimizer"] = {
            "type": CPU_ADAM_TYPES.get(spec.optimizer, "AdamW"),
            "params": {"lr": LEARNING_RATE, "weight_decay": 0.0},
        }
    return extra | {
        "train_micro_batch_size_per_gpu": spec.microbatch,
        "gradient_accumulation_steps": spec.accumulation,
        "gradient_clipping": spec.max_grad_norm,
        "zero_optimization": options.zero_optimization(),
        "zero_allow_untested_optimizer": True,  # transformers sets it when the Trainer builds the optimizer
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": fp16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def zero_refusal(spec: Any, options: ZeroOptions | None = None, on_cpu: bool = False) -> str | None:
    """Why this workload cannot run under the DeepSpeed path (with ``options``; ``on_cpu``: CPU kernels, as
    ``measure --device cpu`` and ``--target cpu`` run them), or None."""
    if options is not None and options.contradicted:
        return (
            "cpu_offload: false is declared beside a cpu placement (DeepSpeed offload_optimizer / offload_param): "
            "declare what the run does, one or the other"
        )
    if options is not None and options.nvme:
        return "NVMe offload (a placement: nvme) is not simulated or measured; CPU offload (cpu) is"
    if options is not None and options.offload_param and options.stage != 3:
        return "parameter_placement: cpu (DeepSpeed offload_param) exists for ZeRO-3 only"
    if options is not None and options.cpu_adam and spec.optimizer not in CPU_ADAM_TYPES:
        return (
            f"ZeRO-Offload runs DeepSpeedCPUAdam (Adam/AdamW) and refuses a client optimizer ({spec.optimizer}) "
            "unless zero_force_ds_cpu_optimizer is false (deepspeed engine.py: ZeRORuntimeException); declare "
            "parallelism.deepspeed.zero_force_ds_cpu_optimizer: false to step the Trainer's optimizer on the host, "
            "or an Adam optimizer"
        )
    if spec.quant is not None:
        return "QLoRA under DeepSpeed ZeRO is not simulated or measured"
    if spec.objective != "sft" and spec.reference == "precomputed" and options is not None and options.stage == 3:
        return (
            "precomputed reference log-probs under DeepSpeed ZeRO-3 are not simulated or measured: TRL precomputes "
            "them through a second ZeRO-3 engine of the policy that it keeps (dpo_trainer.py:1196-1201, "
            "kto_trainer.py:1248-1252), and that sequence (TRL's prepare_deepspeed of the policy, then the Trainer's "
            "engine over the same model) fails inside DeepSpeed 0.19.8 when run here on two ranks (IndexError in the "
            "parameter coordinator's record_parameters at the first training forward); ZeRO-1/2 are simulated with "
            "them, or compute the reference on the fly (training.objective_settings.reference)"
        )
    return None


@contextlib.contextmanager
def cpu_accelerator() -> Iterator[None]:
    """``DS_ACCELERATOR=cpu`` while DeepSpeed is imported (its CPU accelerator falls back to gloo without oneccl)."""
    saved = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("DS_ACCELERATOR", None)
        else:
            os.environ["DS_ACCELERATOR"] = saved


def _cpu_info_once() -> None:
    """py-cpuinfo's ``get_cpu_info`` starts a Python subprocess on every call (about 1 s of CPU), and DeepSpeed
    calls it each time it builds or loads an op (``op_builder/builder.py`` ``cpu_arch``/``simd_width``) and each
    time a ``DeepSpeedCPUAdam``/``DeepSpeedCPULion`` is made (``cpu_adam.py``: its vendor string). Its answer is the
    machine's, the same for the whole process (no tensor, no memory of the step): asked once."""
    try:
        import cpuinfo
    except ImportError:
        return
    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = cache(cpuinfo.get_cpu_info)


def import_deepspeed(cpu: bool = True) -> Any:
    """``deepspeed`` (with its CPU accelerator unless ``cpu`` is false: nccl ranks let DeepSpeed detect CUDA), quiet,
    without its shared-memory all-reduce op. The first import fixes the accelerator for the process.

    ``deepspeed.comm.torch.TorchBackend`` JIT-compiles ``ShareMemCommBuilder`` (a C++ op, the system compiler, tens
    of seconds the first time) when the backend is created; it serves ``inference_all_reduce`` only, never a training
    step, and its shared memory is no torch tensor. ``build_shm_op`` returning None is DeepSpeed's own path when the
    op is not available (``comm/torch.py``): training runs the same collectives through torch.distributed.
    """
    import importlib
    import logging

    with cpu_accelerator() if cpu else contextlib.nullcontext():
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()  # fixed on first use
    if cpu and accelerator._name == "cpu":
        # DeepSpeed's CPU accelerator says fp16 only where oneDNN has fast fp16 kernels (AVX512-FP16,
        # `cpu_accelerator.py` is_fp16_supported); torch runs fp16 on any CPU, slowly. The engine's fp16 mode is run
        # here for its memory, which does not depend on the kernels' speed
        accelerator.is_fp16_supported = lambda: True
    # the module itself: `import deepspeed.comm.torch as m` would bind `deepspeed.comm.torch` *the attribute*, which
    # deepspeed.comm's star import makes the torch package, and the patch would miss DeepSpeed (checked by a test)
    comm_torch: Any = importlib.import_module("deepspeed.comm.torch")
    comm_torch.build_shm_op = lambda: None
    _cpu_info_once()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    return deepspeed


@contextlib.contextmanager
def fake_value_checks() -> Iterator[None]:
    """DeepSpeed's host reads of gradient values answered without values (fake tensors only).

    ``stage3.py`` 2888 and ``stage_1_and_2.py`` 3043/3203 skip the step when the global gradient norm is not finite
    (``runtime/utils.py`` ``is_invalid_grad_norm``: ``bool((~torch.isfinite(norm) | (norm < 0)).any())``), a read of
    a value a fake tensor does not have. The simulated step is the one a finite norm takes: answered "valid". The
    tensors the check allocates are still made (``isfinite`` and the comparison run before the read).

    ZeRO-3 also checks that every rank traced the same module and parameter order (``zero/utils.py``
    ``assert_lst_len_same_as_other_ranks`` / ``get_lst_from_rank0``: an int64 tensor broadcast from rank 0 and read
    back with ``.item()``); every simulated rank runs the same program, so the fake versions allocate and broadcast
    the same tensors and return this rank's own list.

    Under ZeRO-Offload the gradient norm is summed on the host (``complete_grad_norm_calculation_for_cpu_offload``,
    ``stage3.py`` 1975-2003, ``stage_1_and_2.py`` 1914-1954: ``float(total_norm)`` / ``.item()`` of the per-parameter
    norms, then a one-element tensor made and all-reduced): those reads are answered 1.0 (:func:`finite_reads`), a
    finite norm; ZeRO-1/2 also checks each offloaded gradient for NaN/Inf as it arrives
    (``update_offload_overflow_tracker``, ``stage_1_and_2.py`` 1791: the truth of ``has_inf_or_nan``), answered
    "none". Every tensor these methods make is still made.

    With ``bf16.enabled`` the optimizer step also reads its overflow flag on the host (``stage_1_and_2.py`` 3248,
    ``stage3.py`` 3042: ``overflow = overflow_gpu[0].item()``, after the flag's tensors are made and all-reduced):
    answered "no overflow", the step finite gradients take.
    """
    import deepspeed.runtime.zero.stage3 as stage3
    import deepspeed.runtime.zero.stage_1_and_2 as stage12
    import deepspeed.runtime.zero.utils as zutils
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import is_fake

    def lst_len(lst: list[int]) -> None:
        t = torch.tensor(len(lst) if dist.get_rank() == 0 else -1, dtype=torch.int64, device="cpu")
        dist.broadcast(t, src=0, async_op=False)
        del t

    def from_rank0(lst: list[int]) -> list[int]:
        t = torch.tensor(lst if dist.get_rank() == 0 else [-1] * len(lst), dtype=torch.int64, device="cpu")
        dist.broadcast(t, src=0, async_op=False)
        t.cpu()
        return list(lst)

    original = stage3.is_invalid_grad_norm

    def checked(norm: Any) -> bool:
        if isinstance(norm, torch.Tensor) and is_fake(norm):
            (~torch.isfinite(norm) | (norm < 0)).any()
            return False
        return bool(original(norm))

    from torch._subclasses.fake_tensor import DataDependentOutputException

    def flag_unread(method: Any) -> Any:
        def has_overflow(self: Any, *args: Any, **kwargs: Any) -> bool:
            try:
                return bool(method(self, *args, **kwargs))
            except DataDependentOutputException:  # the flag's host read (`overflow_gpu[0].item()`), fake only
                return False  # after every allocation and all-reduce of the real check: the step of finite gradients

        return has_overflow

    def norm_read(method: Any) -> Any:
        def complete(self: Any, *args: Any, **kwargs: Any) -> Any:
            with finite_reads():
                return method(self, *args, **kwargs)

        return complete

    cpu_norm = "complete_grad_norm_calculation_for_cpu_offload"
    overflow = "update_offload_overflow_tracker"
    z3, z12 = stage3.DeepSpeedZeroOptimizer_Stage3, stage12.DeepSpeedZeroOptimizer
    with patched(
        (z3, cpu_norm, norm_read(getattr(z3, cpu_norm))),
        (z12, cpu_norm, norm_read(getattr(z12, cpu_norm))),
        (z12, overflow, norm_read(getattr(z12, overflow))),
        (
            stage3.DeepSpeedZeroOptimizer_Stage3,
            "has_overflow",
            flag_unread(stage3.DeepSpeedZeroOptimizer_Stage3.has_overflow),
        ),
        (stage12.DeepSpeedZeroOptimizer, "has_overflow", flag_unread(stage12.DeepSpeedZeroOptimizer.has_overflow)),
        (stage3, "is_invalid_grad_norm", checked),
        (stage12, "is_invalid_grad_norm", checked),
        (zutils, "assert_lst_len_same_as_other_ranks", lst_len),
        (zutils, "get_lst_from_rank0", from_rank0),
    ):
        yield


@contextlib.contextmanager
def zero3_enabled(on: bool) -> Iterator[None]:
    """Inside the block (``on``), transformers answers that ZeRO-3 is enabled, as it does for the whole of a Trainer
    run with a ZeRO-3 config (``TrainingArguments`` keeps an ``HfTrainerDeepSpeedConfig``, which
    ``is_deepspeed_zero3_enabled`` reads): TRL's fused LM head then gathers ``lm_head``'s partitioned weight around
    its kernel (``trl/trainer/utils.py`` ``maybe_gather_lm_head_ctx``, read at each call). Only around the step's
    forward and GRPO's generation phase: the model is built and partitioned here without transformers' own
    ``zero.Init`` path."""
    if not on:
        yield
        return
    import transformers.integrations.deepspeed as hf_deepspeed

    with patched((hf_deepspeed, "is_deepspeed_zero3_enabled", lambda: True)):
        yield


@contextlib.contextmanager
def finite_reads() -> Iterator[None]:
    """Inside the block, a host read of a fake tensor's value answers as finite gradients do: ``item()`` and
    ``float()`` 1.0 (a norm), truth False (a NaN/Inf check); a real tensor's read is its value."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    def read(original: Any, value: Any) -> Any:
        def answer(self: Any) -> Any:
            return value if is_fake(self) else original(self)

        return answer

    T = torch.Tensor
    with patched(
        (T, "item", read(T.item, 1.0)),
        (T, "__float__", read(T.__float__, 1.0)),
        (T, "__bool__", read(T.__bool__, False)),
    ):
        yield


@cache
def zero_workload(base: type) -> Any:
    """A subclass of the workload class ``base`` trained by DeepSpeed ZeRO (set ``options`` before ``prepare``)."""

    class Zero(base):
        spec: Any
        options: ZeroOptions = ZeroOptions(3)
        engine: Any = None
        #: DeepSpeed's bf16 mode (``training.mixed_precision: bf16``, the Trainer's ``--bf16`` -> ``bf16.enabled``):
        #: the engine runs the model in bf16 and keeps fp32 master partitions; accelerate runs no autocast under
        #: DeepSpeed (accelerate 1.15 ``Accelerator.__init__``: ``native_amp`` stays False for DEEPSPEED), so the
        #: step runs without it
        bf16: bool = False
        #: DeepSpeed's fp16 mode (``training.mixed_precision: fp16``, the Trainer's ``--fp16`` -> ``fp16.enabled``):
        #: the model in fp16, fp32 master partitions, the dynamic loss scaler (``fp16.loss_scale: 0``, DeepSpeed's
        #: default: the loss multiplied by the scale before backward, the overflow flag read after the reduction)
        fp16: bool = False
        #: the simulation's side-keeping tracker under offload (:mod:`ledgerspec.derivations.shard.offload.zero`)
        sides: Any = None
        #: DPO/KTO's separate reference model's engine (:meth:`prepare_reference`), None without one
        reference_engine: Any = None
        #: DPO's precomputation engine of the policy (:meth:`precompute_reference`), None without one
        precompute_engine: Any = None

        @contextlib.contextmanager
        def generating(self) -> Iterator[Any]:
            """GRPO's and RLOO's ``generate`` as TRL's ``_unwrap_model_for_generation`` runs it under ZeRO-3
            (trl/models/utils.py 141-150, ``ds3_gather_for_generation`` true: GRPOConfig's default): every parameter
            gathered at once (``deepspeed.zero.GatheredParameters(model.parameters())``, the engine's), the engine's
            ZeRO-3 hooks removed meanwhile (TRL's own ``remove_hooks``) and registered again after it
            (``add_hooks``). ZeRO-1/2 hold every parameter already: the module, as on one device."""
            if self.options.stage != 3:
                yield self.model
                return
            import deepspeed
            from trl.models.utils import add_hooks, remove_hooks

            with deepspeed.zero.GatheredParameters(self.engine.parameters()):
                remove_hooks(self.engine)
                yield self.model
                add_hooks(self.engine)  # not after an error, as in TRL's (models/utils.py 147-150)

        @contextlib.contextmanager
        def syncing(self) -> Iterator[None]:
            """vLLM's weight sync under ZeRO-3 (``VLLMGeneration._iter_named_params`` with a PEFT model,
            generation/vllm_generation.py 441-470, TRL 1.16): every parameter gathered at once
            (``gather_params(list(model.parameters()))``, ``GatheredParameters``) for PEFT's merge and the walk;
            ZeRO-1/2 hold them whole already."""
            if self.options.stage != 3:
                yield
                return
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.engine.parameters())):
                yield

        def prepare(self) -> None:
            if self.model is not None:
                return
            from ledgerspec.derivations.shard.model import adapters_in_declared_dtype

            if self.spec.autocast_dtype in ("bfloat16", "float16"):
                self.bf16 = self.spec.autocast_dtype == "bfloat16"
                self.fp16 = not self.bf16
                self.spec = self.spec.changed(autocast_dtype=None)
            super().prepare()
            adapters_in_declared_dtype(self.model, self.spec.adapter_dtype)

        def _zero_init(self) -> Any:
            deepspeed = import_deepspeed(cpu=self.device_type == "cpu")
            return deepspeed.zero.Init(config_dict_or_path=ds_config(self.spec, self.options, self.bf16, self.fp16))

        def _materialise(self, device: Any, adapters: bool) -> None:
            if adapters or self.options.stage != 3:
                super()._materialise(device, adapters)
                return
            # zero.Init during from_pretrained: every frozen parameter is partitioned as soon as it exists; a separate
            # reference model (DPO/KTO's ref_model, built by from_pretrained after the TrainingArguments) too
            init = self._zero_init()
            models = [self.model] if self.reference is None else [self.model, self.reference]
            for module in (m for model in models for m in model.modules()):
                for pname, p in list(module._parameters.items()):
                    if p is None or not p.is_meta or p.requires_grad:
                        continue
                    new = self._new_param(p, device, module)
                    module._parameters[pname] = new
                    init._convert_to_zero_parameters([new])
            super()._materialise(device, adapters)  # the buffers (whole on every rank)

        def _inference_engine(self, model: Any) -> Any:
            """TRL's own ``prepare_deepspeed(model, accelerator)`` (trl/models/utils.py 246-289, TRL 1.16) with the
            Trainer's DeepSpeed config: an engine without an optimizer; under ZeRO-3 one that keeps ``model``
            partitioned (TRL's bucket sizes and persistence threshold from the hidden size are written as dotted
            top-level keys, which DeepSpeed does not read: the Trainer's config's own apply), under ZeRO-1/2 one with
            ZeRO off (stage 0), ``model`` cast to bf16/fp16 with the engine's mode."""
            from types import SimpleNamespace

            from trl.models.utils import prepare_deepspeed

            import_deepspeed(cpu=self.device_type == "cpu")
            plugin = SimpleNamespace(deepspeed_config=ds_config(self.spec, self.options, self.bf16, self.fp16))
            with _kept_in_place(model):
                return prepare_deepspeed(model, SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)))

        def prepare_reference(self) -> None:
            """DPO/KTO's separate reference model as TRL's trainer prepares it under DeepSpeed, in its ``__init__``
            (before the policy's engine exists): an engine of its own (:meth:`_inference_engine`), partitioned under
            ZeRO-3, whole on every rank under ZeRO-1/2. The reference's forward then goes through that engine
            (``self.ref_model(...)``)."""
            if self.reference is not None and self.reference_engine is None:
                self.reference_engine = self._inference_engine(self.reference)

        def precompute_reference(self) -> None:
            """DPO/KTO with precomputed reference log-probs under DeepSpeed: TRL precomputes them in its ``__init__``
            through an inference engine of the policy that it builds (:meth:`_inference_engine`) and keeps for the
            run (dpo_trainer.py:1196-1201, kto_trainer.py:1248-1252, TRL 1.16), one batch of the pass run through it
            (the loop's ``precompute``; ZeRO-1/2 only: ZeRO-3 is refused, :func:`zero_refusal`)."""
            if self.spec.reference != "precomputed" or self.spec.objective not in ("dpo", "kto"):
                return
            if self.precompute_engine is None:
                self.precompute_engine = self._inference_engine(self.model)
                self.step.precompute(self.precompute_engine, self.spec.seq_worst)

        def make_optimizer(self) -> Any:
            deepspeed = import_deepspeed(cpu=self.device_type == "cpu")
            model = self.model
            client: Any = None
            params: Any = None
            if self.options.cpu_adam:  # transformers: a DummyOptim over the trainable parameters, DeepSpeed builds
                # DeepSpeedCPUAdam from the config's optimizer block (deepspeed_optim_sched, _prepare_deepspeed)
                params = [p for p in model.parameters() if p.requires_grad]
            else:
                if self.options.offload_optimizer:  # it steps the host partitions: torch's CPU defaults (no foreach)
                    self.optimizer_device = "cpu"
                client = super().make_optimizer()
            self.prepare_reference()  # TRL prepares it in its __init__, before the Trainer builds the policy's engine
            self.precompute_reference()  # ... and precomputes the reference log-probs there
            with _kept_in_place(model):
                engine, optimizer, _, _ = deepspeed.initialize(
                    model=model,
                    optimizer=client,
                    model_parameters=params,
                    config=ds_config(self.spec, self.options, self.bf16, self.fp16),
                )
            self.engine, self.optimizer = engine, optimizer
            if self.sides is not None:  # simulated offload: the host optimizer's allocations on the host
                from ledgerspec.derivations.shard.offload.zero import host_optimizer

                host_optimizer(optimizer, self.sides, self.options)
            return optimizer

        @property
        def step(self) -> Any:
            if getattr(self, "_step", None) is None:
                self._step: Any = zero_step(self, self.step_class())  # the loop one device runs, through the engine
            return self._step

    Zero.__name__ = Zero.__qualname__ = f"Zero{base.__name__}"
    return Zero


@contextlib.contextmanager
def _kept_in_place(model: Any) -> Iterator[None]:
    """``deepspeed.initialize`` of ``model``: the engine's ``module.to(device)`` (``_configure_distributed_model``) is a
    no-op for tensors already on the CPU (``Tensor.to`` aliases them); on fake tensors ``nn.Module._apply`` would swap
    each (a traceable wrapper subclass) with itself, which the tracker's weakrefs forbid: the no-op is kept a no-op."""
    from torch._subclasses.fake_tensor import is_fake

    fake = any(is_fake(p) for p in model.parameters() if not p.is_meta)
    if fake:
        model.to = lambda *args, **kwargs: model
    try:
        yield
    finally:
        if fake:
            del model.to


def zero_step(workload: Any, loop: type) -> Any:
    """The declared loop ``loop`` (the class one device runs: the Trainer's, a custom loop, or a TRL trainer's step)
    with DeepSpeed's engine: forward through the engine, ``engine.backward``, ``engine.step``. A reference model call
    (DPO, KTO: ``call_reference``) goes to the module itself, as TRL's does (``self.model(...)``, the Trainer's
    unwrapped model, dpo_trainer.py:1336, kto_trainer.py:1433; the policy is called as ``model``, the engine)."""
    from ledgerspec.derivations.engine.step import CustomLoop, TrainerLoop

    class ZeroMixin:
        w: Any
        backwards = 0

        def engine_backward(self, loss: Any) -> None:
            """accelerate's ``DeepSpeedEngineWrapper.backward`` (accelerate 1.15 ``utils/deepspeed.py`` 264-281):
            the engine is told whether this micro-step ends the accumulation
            (``set_gradient_accumulation_boundary(sync_gradients)``), then ``engine.backward``; ``engine.step`` runs
            once, after the last one (:meth:`optimizer_step`). Without the boundary the engine counts micro-steps only
            in ``step()`` and, called once per optimizer step, would never reach one with accumulation."""
            self.backwards += 1
            self.w.engine.set_gradient_accumulation_boundary(self.backwards % self.w.spec.accumulation == 0)
            self.w.engine.backward(loss)

        @contextlib.contextmanager
        def _engine(self) -> Iterator[None]:
            model = self.w.model
            self.w.model = self.w.engine  # the Trainer's model is the engine: engine(**inputs)
            try:
                yield
            finally:
                self.w.model = model

        def forward(self, i: int) -> Any:
            with self._engine(), zero3_enabled(self.w.options.stage == 3):
                return super().forward(i)  # type: ignore[misc]

        def generate(self, i: int) -> None:
            """GRPO's/RLOO's generation phase with transformers saying ZeRO-3 is on, as in the Trainer's run (TRL's
            head then gathers ``lm_head`` for the old-policy and reference log-probs). ``generate``'s own
            ``synced_gpus`` (true there) stays false: transformers read the flag at import; it adds a 4-byte flag per
            decoding step."""
            with zero3_enabled(self.w.options.stage == 3):
                super().generate(i)  # type: ignore[misc]

        def call_reference(self, inputs: dict[str, Any], **extra: Any) -> Any:
            engine, reference = self.w.model, self.w.reference
            self.w.model = self.w.engine.module  # TRL's `self.model`: the module the engine wraps
            if self.w.reference_engine is not None:  # TRL's `self.ref_model`: prepare_deepspeed's engine
                self.w.reference = self.w.reference_engine
            try:
                return super().call_reference(inputs, **extra)  # type: ignore[misc]
            finally:
                self.w.model, self.w.reference = engine, reference

        def optimizer_step(self) -> None:
            self.w.engine.step()  # clipping (gradient_clipping), the wrapped optimizer's step, zeroed gradients

        def zero_grad(self) -> None:
            """``engine.step`` zeroed them (the Trainer's ``model.zero_grad()`` finds nothing)."""

    def backward(self: Any, loss: Any) -> None:
        self.engine_backward(loss)  # accelerate: DeepSpeedEngineWrapper.backward

    if issubclass(loop, TrainerLoop):
        hook = "accelerator_backward"
    elif issubclass(loop, CustomLoop):
        hook = "backward"
    else:
        raise TypeError(f"{loop.__name__} is neither the Trainer's loop nor a custom one")
    composed = type(f"Zero{loop.__name__}", (ZeroMixin, loop), {hook: backward})
    return composed(workload)


__all__ = ["DEEPSPEED_VERSION", "ds_config", "import_deepspeed", "zero_refusal", "zero_workload"]
