"""``LedgerCallback``: record a real ``transformers.Trainer`` run into a ledger, phase by phase.

``Trainer(..., callbacks=[LedgerCallback("run.ledger.yaml")])`` (TRL's trainers subclass ``Trainer``). At train
begin the ledger is read (or built from the live objects with
:func:`~ledgerspec.derivations.integrations.trainer_intake.intake_from_trainer` when the file does not exist); the
run is then measured with the measurement protocol's own backends (:mod:`ledgerspec.derivations.engine.backends`):
on the CPU the tensor tracker (every live tensor storage, exact bytes), on CUDA the caching allocator's counters
(``max_memory_allocated``/``max_memory_reserved``, reset at each phase start) and the device-level peak. The
figures are written with ``measure``'s own write-back (:func:`ledgerspec.derivations.measure.measurer.write_back`):
MEASURED phases, metrics, measurement, software, comparison; at train end, every ``save_every`` steps and on an
out-of-memory error, atomically (:func:`ledgerspec.contract.writer.save`, comments kept).

What a callback can and cannot observe (the protocol's phases):

- ``after_load``, ``after_adapter_injection``, ``after_optimizer_init``: a callback starts at ``on_train_begin``,
  after the model was loaded, the adapters injected and the optimizer built. These phases are the bytes held THEN,
  counted by the census of the live objects (frozen parameters, buffers and quantization state; + the adapters;
  + the optimizer's tensors). Transient peaks while loading are not seen; an optimizer that creates its state
  lazily (AdamW) holds none yet, as in ``measure``.
- ``forward_peak``, ``backward_peak`` (loss + backward), ``optimizer_step_peak``: the first optimizer step of the
  run, phase by phase (a forward pre-hook and hook on the model, ``Trainer.training_step`` returning, the
  optimizer step up to ``on_step_end``), the maximum over its micro-steps; ``steady_state_peak``: the maximum over
  the following steps. The first step of a real run is not necessarily its longest: the lengths the callback saw
  are recorded (``x-callback``), and ``workload.max_length``/``sequence_p50`` are filled from them when unknown.
- On the CPU the DataLoader has already read the next step's first micro-batch when a step runs (accelerate's
  ``DataLoaderShard`` fetches one ahead); on a GPU that batch is still on the host. The callback finds it (the
  batch tensors fetched before the step that the step's forwards never received) and leaves it out, so the CPU
  figures are the device's.
- ``ledger.frozen_base``, ``adapter``, ``gradients``, ``optimizer``: MEASURED by the census of the live tensors
  (unique storages on the run's device): the frozen parameters, buffers and quantization state, and the trainable
  parameters, at ``on_train_begin``; the gradients and every tensor the optimizer holds at ``on_optimizer_step`` of
  the first optimizer step (after the step, before ``zero_grad``; the optimizer's after the first step it did not
  skip). An FSDP or DeepSpeed run writes none of them (a rank's shards are not the single-device figures).
  ``identity.model_id`` and ``revision`` are read from the live model where an existing ledger does not declare them
  (:meth:`Recorder._identity_from`).
- An out-of-memory error in ``training_step`` (forward, loss, backward) or in the optimizer step is recorded with
  its phase and written before the exception propagates; the callback cannot see an error raised elsewhere (data
  loading, gradient clipping, evaluation): the run's own traceback is the report then.
- Distributed runs (DDP under ``torchrun``/``accelerate launch``): every rank measures itself; when rank 0 writes,
  it gathers every rank's result (``torch.distributed.gather_object``) and writes the worst rank per phase (never a
  sum) and ``parallelism.per_rank_peak``, as ``measure --nproc`` does. An out-of-memory error on one rank is
  written by rank 0 only, with its own figures (the other ranks are not there to gather).

A failure of the callback itself (an unwritable path, a Trainer with nothing to train, ...) is logged once and the
callback stops recording; training goes on. ``strict=True`` raises instead.

The ``TrainerCallback`` subclass is made on first use (:func:`callback_class`), so that importing this module
imports no torch or transformers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from ledgerspec.contract.document import Document
from ledgerspec.errors import LedgerspecError, described

log = logging.getLogger("ledgerspec")

STEP_KEYS = ("forward", "backward", "optimizer")


@dataclass
class _Live:
    """What the protocol's backends read (``workload.model``/``workload.optimizer``): the live objects."""

    model: Any
    optimizer: Any = None


class CallbackFailure(RuntimeError):
    """A failure of the callback itself, raised only with ``strict=True``."""


def _unwrap_optimizer(optimizer: Any) -> Any:
    """accelerate's ``AcceleratedOptimizer`` keeps the torch optimizer in ``.optimizer``."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if inner is not None and hasattr(inner, "state") else optimizer


def optimizer_tensors(optimizer: Any) -> list[Any]:
    """Tensors an optimizer made when it was built, outside its ``state`` (bitsandbytes' quantization maps):
    found by walking the optimizer object (and the one accelerate wraps), parameters excluded."""
    import torch

    out: list[Any] = []
    seen: set[int] = set()

    def walk(obj: Any, depth: int = 0) -> None:
        if obj is None or id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Parameter):
            return
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v, depth + 1)
        elif isinstance(obj, torch.optim.Optimizer) or type(obj).__name__ == "AcceleratedOptimizer":
            for k, v in vars(obj).items():
                if k not in ("param_groups", "state"):
                    walk(v, depth + 1)

    walk(optimizer)
    return out


def outside_state(optimizer: Any, known: dict[int, Any], device: str | None) -> dict[int, int]:
    """The storages of :func:`optimizer_tensors` (an optimizer's tensors outside its ``state``) that ``known`` (a
    census's storage keys) does not hold, on ``device`` (None: any): ``{storage key: nbytes}``."""
    from ledgerspec.derivations.engine.tracker import storage_key, storage_nbytes

    out: dict[int, int] = {}
    for t in optimizer_tensors(optimizer):
        if device is not None and t.device.type != device:
            continue
        key = storage_key(t)
        if key not in known:
            out.setdefault(key, storage_nbytes(t))
    return out


def _sharded(args: Any, trainer: Any) -> str | None:
    """Why the ledger's components are not written: an FSDP or DeepSpeed run holds a rank's shard of each (and
    DeepSpeed keeps the gradients outside ``.grad``), not the single-device figures ``ledger.*`` are."""
    for name, arg, attr in (("FSDP", "fsdp", "is_fsdp_enabled"), ("DeepSpeed", "deepspeed", "is_deepspeed_enabled")):
        if getattr(args, arg, None) or getattr(trainer, attr, False):
            return (
                f"a {name} run holds a rank's shard of each component, not the single-device figures of ledger.* "
                "(`ledgerspec shard` sizes the ranks)"
            )
    return None


def find_trainer(model: Any) -> Any:
    """The ``transformers.Trainer`` whose training loop called this callback (a callback is given the model and
    the optimizer, not the trainer): the ``self`` of a calling frame that is a Trainer of ``model``."""
    import inspect

    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        for _ in range(16):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer) and candidate.model is model:
                return candidate
        return None
    finally:
        del frame


_HEX = re.compile(r"^[0-9a-f]{7,40}$")  # a commit hash, abbreviated or full
#: what the callback compares between an existing ledger and the live run
COMPARED = (
    ("method", "kind"),
    ("method", "rank"),
    ("method", "alpha"),
    ("method", "target_modules"),
    ("method", "use_dora"),
    ("base_model", "loaded_dtype"),
    ("adapter", "dtype"),
    ("workload", "microbatch"),
    ("workload", "gradient_accumulation"),
    ("training", "mixed_precision"),
    ("optimizer", "name"),
    ("memory_options", "gradient_checkpointing"),
    ("identity", "model_id"),
    ("identity", "revision"),
)


def declared_vs_live(doc: Document, live: Document) -> list[str]:
    """The settings in which the ledger's declared configuration differs from the live objects' (both known;
    ``target_modules: all-linear`` is not compared with the resolved names, a model loaded from a local folder has no
    model id to compare, and a revision is compared only when both are commit hashes: a branch or a tag names a
    commit that changes)."""
    out = []
    for path in COMPARED:
        a, b = doc.get(*path), live.get(*path)
        if not (a.known and b.known):
            continue
        va, vb = a.value, b.value
        if path == ("identity", "model_id") and os.path.exists(str(vb)):
            continue
        if isinstance(va, list) and isinstance(vb, list):
            same = sorted(map(str, va)) == sorted(map(str, vb))
        elif isinstance(va, str) and path == ("method", "target_modules"):
            same = True  # a pattern or all-linear: the live list is its resolution
        elif path == ("identity", "revision"):
            hashes = [str(v).lower() for v in (va, vb)]
            short, long = sorted(hashes, key=len)
            same = not all(_HEX.match(h) for h in hashes) or long.startswith(short)
        else:
            same = str(va).lower() == str(vb).lower()
        if not same:
            out.append(f"{'.'.join(path)}: declared {va!r}, the run has {vb!r}")
    return out


def _tensors_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    import torch

    found = [a for a in args if isinstance(a, torch.Tensor)]
    found += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    return found


class Recorder:
    """The callback's work, independent of transformers' base class (see the module docstring).

    ``path``: the ledger to write (created from the live objects when absent). ``save_every``: also write every N
    optimizer steps. ``strict``: raise the callback's own failures (default: log them and stop recording).
    ``memory_limit`` (bytes, CPU only): a simulated out-of-memory when tracked tensors exceed it, as ``measure
    --memory-limit``. ``snapshot``: on CUDA, record the allocator's history and save a snapshot on an
    out-of-memory error (slows the step down). ``keep_status``: keep the declared status (default: set it to what
    the evidence supports, as ``measure`` does). ``force``: write through a symlink or over a read-only file.
    """

    #: set by :func:`callback_class`: sets the declared status before a save (``ledgerspec.faces.status.settle``)
    settle: Callable[[Document, bool], Any] | None = None

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        save_every: int | None = None,
        strict: bool = False,
        memory_limit: int | None = None,
        snapshot: bool = False,
        keep_status: bool = False,
        force: bool = False,
    ) -> None:
        if save_every is not None and save_every < 1:
            raise ValueError("save_every must be >= 1")
        self.path = os.fspath(path)
        self.save_every = save_every
        self.strict = strict
        self.memory_limit = memory_limit
        self.snapshot = snapshot
        self.keep_status = keep_status
        self.force = force
        self.failure: str | None = None  # why the callback stopped recording
        self._reset()

    def _reset(self) -> None:
        """The state of one ``train()`` call (a callback may see several)."""
        self.active = False
        self.rank = 0
        self.world = 1
        self.gathering = False  # distributed: rank 0 gathers every rank's figures when it writes
        self.differences: list[str] = []  # the existing ledger's configuration vs the live objects
        self.doc: Document | None = None
        self.backend: Any = None
        self.result: Any = None  # the ProtocolResult being filled
        self.notes: list[str] = []
        self.steps_done = 0
        self.where = "load"
        self.lengths: list[int] = []  # the longest sequence of each optimizer step
        self.ahead: list[int] = []  # bytes of the batch held ahead, per step (cpu)
        self._stack: contextlib.ExitStack | None = None
        self._live: Any = _Live(None)
        self._trainer: Any = None
        self._hooks: list[Any] = []
        self._restore: list[Callable[[], None]] = []
        self._in_step = False
        self._generating = False  # inside GRPOTrainer's/RLOOTrainer's _generate_and_score_completions
        self._step_peaks: dict[str, int] = {}
        self._step_cats: dict[str, Any] = {}
        self._step_extra: dict[str, int] = {}
        self._consumed: set[int] = set()
        self._step_inputs: list[tuple[str, int]] = []  # (key, storage) of the micro-batches handed to training_step
        self._forward_keys: set[str] = set()  # the keyword arguments the step's forwards received
        self._step_len = 0
        self._step_t0 = 0.0
        self._times: list[float] = []
        self._before_forward: int | None = None
        self._previous: dict[str, Any] = {}
        self._optimizer: Any = None  # the optimizer the Trainer steps (accelerate's wrapper)
        self.components: dict[str, int] = {}  # ledger.frozen_base, adapter, gradients, optimizer: census bytes
        self.components_note: str | None = None  # why they are not written (a sharded run)

    # -- guarded events ------------------------------------------------------------------------------------------
    def _guard(self, what: str, fn: Callable[[], None]) -> None:
        if not self.active and what != "train begin":
            return
        try:
            fn()
        except Exception as exc:
            self._stop(f"{what}: {_message(exc)}")
            if self.strict:
                raise CallbackFailure(self.failure) from exc

    def _stop(self, why: str) -> None:
        """Stop recording (the run goes on): log why once, undo the hooks, leave the tracking mode."""
        if self.failure is None:
            self.failure = why
            log.warning(
                "ledgerspec LedgerCallback (%s): %s; the callback stops recording, training goes on", self.path, why
            )
        self.active = False
        self._close()

    def _close(self) -> None:
        for h in self._hooks:
            with contextlib.suppress(Exception):
                h.remove()
        self._hooks.clear()
        for undo in reversed(self._restore):
            with contextlib.suppress(Exception):
                undo()
        self._restore.clear()
        if self._stack is not None:
            stack, self._stack = self._stack, None
            with contextlib.suppress(Exception):
                stack.close()

    # -- train begin ---------------------------------------------------------------------------------------------
    def begin(self, args: Any, state: Any, model: Any, optimizer: Any) -> None:
        self._close()
        self._reset()
        self.active = True
        self.failure = None
        self.rank = int(getattr(args, "process_index", 0) or 0)
        if model is None:
            raise LedgerspecError("the Trainer passed no model to the callback", self.path, rule="callback")
        if self.rank == 0:  # only rank 0 reads and writes the ledger
            self._open_document(args, model)
        else:
            from ledgerspec.derivations.integrations.trainer_intake import trained_parts

            trained_parts(model)
            self._trainer = find_trainer(model)
        self._start_backend(args, model, optimizer)

    def agree(self, args: Any) -> None:
        """Distributed runs: every rank learns whether every rank's callback started (an all-gather; ranks that
        disagree would wait for each other in the gathers later), and the callback gathers from then on."""
        import torch.distributed as dist

        world = int(getattr(args, "world_size", 1) or 1)
        if world < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        flags: list[Any] = [None] * world
        dist.all_gather_object(flags, self.active)
        self.world = world
        if not all(flags):
            self._stop(f"the callback of rank(s) {[i for i, f in enumerate(flags) if not f]} did not start")
            return
        self.gathering = True

    def _open_document(self, args: Any, model: Any) -> None:
        from ledgerspec.contract.document import load, require_header
        from ledgerspec.contract.edit import to_ledger
        from ledgerspec.contract.writer import check_writable
        from ledgerspec.derivations.integrations.trainer_intake import intake_from_objects, trained_parts

        check_writable(self.path, force=self.force)
        trained_parts(model)  # neither adapters nor a full fine-tune: a clear message before anything else
        self._trainer = find_trainer(model)
        if os.path.exists(self.path):
            doc = require_header(load(self.path), "callback")
            live = intake_from_objects(model, args, self.path, self._trainer)
            self.differences = declared_vs_live(doc, live)
            self._identity_from(live, doc)
            if self.differences:
                log.warning(
                    "ledgerspec LedgerCallback (%s): the ledger declares another configuration than the run (%s); "
                    "the figures written are the run's",
                    self.path,
                    "; ".join(self.differences),
                )
            self._previous = {
                name: doc.get("phases", name).value
                for name in ("forward_peak", "backward_peak", "optimizer_step_peak", "steady_state_peak")
                if doc.get("phases", name).known and doc.get("phases", name).effective_source(True) == "MEASURED"
            }
            if self._previous:
                self._previous["command"] = doc.get("measurement", "command").value
        else:
            doc = intake_from_objects(model, args, self.path, self._trainer)
        to_ledger(doc)
        self.doc = doc

    def _identity_from(self, live: Document, doc: Document) -> None:
        """``identity.model_id`` (a Hub repository id, not a local folder) and ``identity.revision`` read from the
        live model, where the ledger does not declare them (where it does, :func:`declared_vs_live` compares)."""
        from ledgerspec.contract.edit import set_plain

        for key in ("model_id", "revision"):
            value = live.get("identity", key)
            if doc.get("identity", key).known or not value.known:
                continue
            if key == "model_id" and os.path.exists(str(value.value)):
                continue  # a local folder is no identity; config_path and config_sha256 pin it
            set_plain(doc, ("identity", key), value.value)
            self.notes.append(f"identity.{key}: {value.value}, read from the live model")

    def _start_backend(self, args: Any, model: Any, optimizer: Any) -> None:
        from ledgerspec.derivations.engine.backends import CudaBackend, TrackerBackend
        from ledgerspec.derivations.engine.protocol import ProtocolResult
        from ledgerspec.derivations.engine.tracker import quant_state_tensors

        device = getattr(args, "device", None)
        kind = getattr(device, "type", "cpu")
        if kind == "cuda":
            index = device.index if device is not None and device.index is not None else _current_cuda_device()
            self.backend = CudaBackend(index, record_history=self.snapshot)
        elif kind == "cpu":
            self.backend = TrackerBackend(limit=self.memory_limit)
        else:
            raise LedgerspecError(
                f"the run is on {kind!r}: the callback measures cpu and cuda runs", self.path, rule="callback"
            )
        self._live = _Live(model, _unwrap_optimizer(optimizer))
        self._optimizer = optimizer
        self.components_note = _sharded(args, self._trainer)
        accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        self.result = ProtocolResult(
            self.backend.name,
            steps=0,
            microbatch=int(getattr(args, "per_device_train_batch_size", 1) or 1),
            accumulation=accumulation,
            memory_limit=self.memory_limit,
        )
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self.backend.session())
        b = self.backend
        if isinstance(b, TrackerBackend):
            tracker = b.tracker
            for m in (model, *self._reference_models()):  # a TRL trainer's separate reference model is held too
                tracker.track_existing(list(m.parameters()) + list(m.buffers()), "frozen_params")
                quant = [t for p in m.parameters() for t in quant_state_tensors(getattr(p, "quant_state", None))]
                tracker.track_existing(quant, "quant_state")
            tracker.track_existing(optimizer_tensors(optimizer), "optimizer")
            tr_loss = getattr(self._trainer, "_tr_loss", None)
            if tr_loss is not None:
                tracker.track_existing([tr_loss], "temporary")
            b.classify(self._live)
            b.watch(self._live)
        self._record_held_phases()
        self._install(model, optimizer)
        b.set_context("inputs")
        self.result.device = b.device_info()

    def _record_held_phases(self) -> None:
        """after_load / after_adapter_injection / after_optimizer_init: the bytes held at train begin, by the census
        of the live objects (see the module docstring)."""
        from ledgerspec.derivations.engine.protocol import PhaseRecord
        from ledgerspec.derivations.engine.tracker import by_component, census, census_storages

        b = self.backend
        live = self._live
        counts = census(live.model, live.optimizer, b.census_device)
        known = census_storages(live.model, live.optimizer, b.census_device)
        for ref in self._reference_models():  # loaded beside the policy, frozen: held from after_load on
            for key, (cat, n) in census_storages(ref, None, b.census_device).items():
                # TRL leaves the reference model's parameters as they were loaded (requires_grad true) and never
                # trains them (no optimizer, no_grad forwards): frozen weights, whatever their flag says
                cat = "frozen_params" if cat == "adapter" else cat
                if key not in known:
                    known[key] = (cat, n)
                    counts[cat] += n
        parts = by_component(counts)
        if self.components_note is None and parts["frozen_base"] > 0 and parts["adapter"] > 0:
            self.components.update(frozen_base=parts["frozen_base"], adapter=parts["adapter"])
        # on CUDA the caching allocator rounds every block up to 512 B (c10/cuda/CUDACachingAllocator.cpp,
        # kMinBlockSize), and memory_allocated counts the rounded blocks: the census is rounded the same way
        unit = 512 if b.name == "cuda" else 1
        rounded = dict.fromkeys(counts, 0)
        for cat, n in known.values():
            rounded[cat] += -(-n // unit) * unit
        from ledgerspec.derivations.integrations.trainer_intake import full_model

        # full fine-tuning (no PEFT adapters): the trained weights are what was loaded; nothing is injected
        full = full_model(live.model) is not None
        base = rounded["frozen_params"] + rounded["buffers"] + rounded["quant_state"]
        base += rounded["adapter"] if full else 0
        adapters = base + (0 if full else rounded["adapter"])
        # optimizer tensors outside its state (bitsandbytes' maps)
        extra = sum(-(-n // unit) * unit for n in outside_state(live.optimizer, known, b.census_device).values())
        with_optimizer = adapters + rounded["optimizer"] + extra
        if b.name == "cuda":  # the allocator's own figure: every tensor on the device now
            with_optimizer = b.current()
        for name, held in (
            ("after_load", base),
            ("after_adapter_injection", adapters),
            ("after_optimizer_init", with_optimizer),
        ):
            self.result.phases[name] = PhaseRecord(name, held, held, held, None, None, None, dict(counts), 0.0)

    def _reference_models(self) -> list[Any]:
        """A TRL trainer's separate reference model (``trainer.ref_model``: DPO, KTO), else nothing."""
        ref = getattr(self._trainer, "ref_model", None)
        return [ref] if ref is not None and hasattr(ref, "parameters") else []

    def _install(self, model: Any, optimizer: Any) -> None:
        """Hooks on the model's forward (and a TRL trainer's separate reference model's); ``training_step`` and the
        optimizer's ``step`` wrapped (an out-of-memory error there is recorded before it propagates)."""
        for m in (model, *self._reference_models()):
            self._hooks.append(m.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._hooks.append(m.register_forward_hook(self._post_forward))
        trainer = self._trainer
        if trainer is None:
            log.warning(
                "ledgerspec LedgerCallback (%s): no transformers.Trainer called this callback: only the phases held "
                "at train begin are recorded (the step phases need Trainer.training_step)",
                self.path,
            )
        else:
            original = trainer.training_step

            def training_step(*a: Any, **kw: Any) -> Any:
                self._in_step = True
                self._guard("step inputs", lambda: self._consume_step_inputs(a, kw))
                try:
                    out = original(*a, **kw)
                except BaseException as exc:
                    self._in_step = False
                    self._failed(exc)
                    raise
                self._in_step = False
                self._guard("after backward", self._after_backward)
                return out

            trainer.training_step = training_step
            self._restore.append(lambda: delattr(trainer, "training_step"))
            self._install_generation(trainer)
        if optimizer is not None:
            step = optimizer.step

            def optimizer_step(*a: Any, **kw: Any) -> Any:
                try:
                    return step(*a, **kw)
                except BaseException as exc:
                    self._failed(exc)
                    raise

            optimizer.step = optimizer_step
            self._restore.append(lambda: delattr(optimizer, "step"))

    def _install_generation(self, trainer: Any) -> None:
        """TRL's online trainers (``GRPOTrainer``, ``RLOOTrainer``, TRL 1.16) generate inside ``training_step``:
        ``Trainer.training_step`` calls ``_prepare_inputs`` first (transformers ``trainer.py``), which calls
        ``_generate_and_score_completions`` every ``steps_per_generation`` micro-steps (grpo_trainer.py:1522-1551,
        rloo_trainer.py:1091-1120): the completions generated, scored, the old-policy and reference log-probs. That
        call is the generation phase (``generation_peak``), as ``measure`` runs it; the model calls inside it (the
        log-probs' forwards) are not the step's forward."""
        generate = getattr(trainer, "_generate_and_score_completions", None)
        if not callable(generate):
            return

        def generating(*a: Any, **kw: Any) -> Any:
            if not (self.active and self._in_step):  # evaluation: not a training step
                return generate(*a, **kw)
            self._guard("generation", self._generation_begins)
            try:
                out = generate(*a, **kw)
            except BaseException as exc:
                self._generating = False
                self._failed(exc)
                raise
            self._guard("generation end", self._generation_ends)
            return out

        trainer._generate_and_score_completions = generating
        self._restore.append(lambda: delattr(trainer, "_generate_and_score_completions"))

    def _generation_begins(self) -> None:
        self._generating = True
        self.where = "forward"  # the spec's word for an out-of-memory error in the generation phase, as measure's
        self.backend.set_context("temporary")  # what generation makes is not the batch held ahead
        self.backend.reset_peak()

    def _generation_ends(self) -> None:
        self._generating = False
        self._keep("generation")

    # -- the step ------------------------------------------------------------------------------------------------
    def _consume_step_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The micro-batch handed to ``training_step(model, inputs)``: its tensors under keys no forward receives
        (DPO's ``completion_mask``: TRL derives the labels from it) are this step's, not the batch held ahead
        (:meth:`_held_ahead`; the others count as the forwards' inputs do)."""
        from ledgerspec.derivations.engine.tracker import storage_key

        inputs = kwargs.get("inputs", args[1] if len(args) > 1 else None)
        if isinstance(inputs, dict):
            self._step_inputs.extend((k, storage_key(v)) for k, v in inputs.items() if _tensors_in((), {k: v}))

    def _pre_forward(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.active or not self._in_step or self._generating:
            return

        def run() -> None:
            from ledgerspec.derivations.engine.tracker import storage_key

            tensors = _tensors_in(args, kwargs)
            self._consumed.update(storage_key(t) for t in tensors)
            self._forward_keys.update(kwargs)
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None and getattr(ids, "dim", lambda: 0)() >= 1:
                self._step_len = max(self._step_len, int(ids.shape[-1]))
            self.where = "forward"
            self.backend.set_context("activations")
            self.backend.reset_peak()
            self._before_forward = self.backend.current() if self.result.activations_saved is None else None

        self._guard("forward", run)

    def _post_forward(self, _module: Any, _args: Any, _out: Any) -> None:
        if not self.active or not self._in_step or self._generating:
            return

        def run() -> None:
            if self._before_forward is not None and self.steps_done == 0:
                self.result.activations_saved = self.backend.current() - self._before_forward
                self._before_forward = None
            self._keep("forward")
            self.where = "loss"
            self.backend.set_context("temporary")

        self._guard("forward end", run)

    def optimizer_stepped(self) -> None:
        """``on_optimizer_step`` (after the optimizer step, before ``zero_grad``): ``ledger.gradients`` (the
        parameters' gradients, once every trainable parameter has one) and ``ledger.optimizer`` (every tensor the
        optimizer holds, after the first step it did not skip: its state exists from then on), each counted once."""
        from ledgerspec.derivations.engine.tracker import census_storages

        if self.components_note is not None or {"gradients", "optimizer"} <= self.components.keys():
            return
        live, device = self._live, self.backend.census_device
        if "gradients" not in self.components:
            trainable = [p for p in live.model.parameters() if p.requires_grad]
            if trainable and all(p.grad is not None for p in trainable):
                storages = census_storages(live.model, None, device).values()
                grads = sum(n for cat, n in storages if cat == "gradients")
                if grads > 0:
                    self.components["gradients"] = grads
        if (
            "optimizer" not in self.components
            and live.optimizer is not None
            and not getattr(self._optimizer, "step_was_skipped", False)
        ):
            state = census_storages(None, live.optimizer, device)
            outside = outside_state(live.optimizer, state, device)
            self.components["optimizer"] = sum(n for _, n in state.values()) + sum(outside.values())

    def _after_backward(self) -> None:
        self._keep("backward")
        self.where = "optimizer_step"
        self.backend.set_context("optimizer")

    def _keep(self, key: str) -> None:
        """The peak since the last reset, kept as the step's ``key`` peak (maximum over micro-steps); reset."""
        b = self.backend
        p = b.peak()
        if p >= self._step_peaks.get(key, -1):
            self._step_peaks[key] = p
            self._step_cats[key] = b.peak_categories()
        for name, value in ((f"{key}:reserved", b.reserved_peak()), (f"{key}:device", b.device_peak())):
            if value is not None:
                self._step_extra[name] = max(value, self._step_extra.get(name, 0))
        b.reset_peak()

    def step_begin(self) -> None:
        self._step_t0 = time.perf_counter()

    def step_end(self, global_step: int) -> None:
        from ledgerspec.derivations.engine.protocol import PhaseRecord
        from ledgerspec.derivations.engine.tracker import census

        b = self.backend
        self._keep("optimizer")
        b.classify(self._live, stale=("optimizer",))
        ahead = self._held_ahead()
        self.ahead.append(ahead)
        self.lengths.append(self._step_len)
        held = b.current() - ahead
        counts = census(self._live.model, self._live.optimizer, b.census_device)
        r = self.result
        seconds = time.perf_counter() - self._step_t0
        if self.steps_done == 0:
            r.seq_worst = self._step_len
            for key, name in (
                ("generation", "generation_peak"),
                ("forward", "forward_peak"),
                ("backward", "backward_peak"),
                ("optimizer", "optimizer_step_peak"),
            ):
                if key in self._step_peaks:
                    peak = self._step_peaks[key] - ahead
                    r.phases[name] = PhaseRecord(
                        name,
                        peak,
                        peak,
                        held,
                        self._step_extra.get(f"{key}:reserved"),
                        self._step_extra.get(f"{key}:device"),
                        self._step_cats.get(key),
                        counts,
                        seconds,
                    )
        elif self._step_peaks:
            best = max(self._step_peaks, key=lambda k: self._step_peaks[k])
            peak = self._step_peaks[best] - ahead
            old = r.phases.get("steady_state_peak")
            reserved = [v for k, v in self._step_extra.items() if k.endswith(":reserved")]
            device = [v for k, v in self._step_extra.items() if k.endswith(":device")]
            if old is None or peak >= old.figure:
                r.phases["steady_state_peak"] = PhaseRecord(
                    "steady_state_peak",
                    peak,
                    peak,
                    held,
                    _maximum(reserved, old.reserved_peak if old else None),
                    _maximum(device, old.device_peak if old else None),
                    self._step_cats.get(best),
                    counts,
                    seconds,
                )
            self._times.append(seconds)
            r.steps = self.steps_done
            r.seq_typical = int(statistics.median_low(self.lengths[1:]))
        self.steps_done += 1
        self._step_peaks, self._step_cats, self._step_extra = {}, {}, {}
        self._consumed.clear()
        self._step_inputs, self._forward_keys = [], set()
        self._step_len = 0
        self.where = "step"
        b.set_context("inputs")
        b.reset_peak()

    def _held_ahead(self) -> int:
        """CPU: bytes of the batch tensors fetched before this step that none of its forwards received (the
        DataLoader's next batch, read one ahead); 0 on CUDA (that batch is on the host)."""
        tracker = getattr(self.backend, "tracker", None)
        if tracker is None:
            return 0
        # the tracker's live storages (engine/tracker.py keeps them in ``_live``: key -> nbytes, category)
        consumed = self._consumed | {s for k, s in self._step_inputs if k not in self._forward_keys}
        return sum(e.nbytes for key, e in tracker._live.items() if e.category == "inputs" and key not in consumed)

    # -- failures ------------------------------------------------------------------------------------------------
    def _failed(self, exc: BaseException) -> None:
        """An exception left ``training_step`` or the optimizer step: an out-of-memory error is recorded with its
        phase and written now; anything else stops the recording (nothing written: the run's error is the report)."""
        if not self.active:
            return
        try:
            kind = self.backend.oom_kind(exc) if isinstance(exc, Exception) else None
            if kind is None:
                self._stop(f"the run failed in phase {self.where} ({described(exc, 160)}): nothing written")
                return
            r = self.result
            r.oom = True
            r.oom_phase = "later_iteration" if self.steps_done > 0 else self.where
            r.oom_during = self.where
            r.simulated_oom = kind == "simulated"
            r.oom_message = _message(exc)
            ahead = self._held_ahead()
            with contextlib.suppress(Exception):
                r.failed_phase_peak = self.backend.peak() - ahead
            with contextlib.suppress(Exception):
                r.failed_phase_reserved = self.backend.reserved_peak()
                r.failed_phase_device = self.backend.device_peak()
            with contextlib.suppress(Exception):
                r.failed_categories = self.backend.peak_categories()
            if self.snapshot:
                r.snapshot_path = self.backend.on_oom(str(os.path.splitext(self.path)[0]) + ".oom-snapshot.pickle")
            self.write("out of memory", gather=False)
        except Exception as inner:
            log.warning(
                "ledgerspec LedgerCallback (%s): recording the out-of-memory error failed: %s", self.path, inner
            )
        finally:
            self.active = False
            self._close()

    # -- writing -------------------------------------------------------------------------------------------------
    def save_point(self, global_step: int, final: bool) -> None:
        """Train end or every ``save_every`` steps. In a distributed run every rank takes part in the gather, also
        a rank whose callback stopped (it sends nothing), so that none waits for another."""
        due = final or bool(self.save_every and global_step % self.save_every == 0)
        if not due:
            return
        why = "train end" if final else "every"
        if self.gathering:
            try:
                self.write(why)
            except Exception as exc:
                self._stop(f"{why}: {_message(exc)}")
                if self.strict:
                    raise CallbackFailure(self.failure) from exc
        else:
            self._guard(why, lambda: self.write(why))
        if final:
            self.active = False
            self._close()

    def _finish_result(self) -> None:
        r = self.result
        with contextlib.suppress(Exception):
            r.device = self.backend.device_info()
        r.step_time_s = sum(self._times) / len(self._times) if self._times else None
        from ledgerspec.derivations.engine.protocol import _host_peak

        r.host_peak = _host_peak()

    def write(self, why: str, gather: bool = True) -> None:
        """Write what was measured so far into the ledger (atomically), as ``measure`` writes its result; in a
        distributed run rank 0 gathers every rank's result first (``gather``) and writes them all."""
        from ledgerspec.derivations.measure.measurer import software_versions

        payload = None
        if self.active and self.result is not None:
            self._finish_result()
            payload = {"result": self.result.to_json(), "software": software_versions(self._live, self.backend.name)}
        ranks: list[tuple[int, dict[str, Any]]] = [(self.rank, payload)] if payload is not None else []
        if self.gathering and gather:
            import torch.distributed as dist

            gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
            dist.gather_object(payload, gathered, dst=0)
            ranks = [(i, p) for i, p in enumerate(gathered or []) if p is not None]
        if self.rank != 0 or not ranks or self.doc is None:
            return
        self._save(why, ranks)

    def _save(self, why: str, ranks: list[tuple[int, dict[str, Any]]]) -> None:
        from ledgerspec.contract.edit import set_extension, set_figure, set_plain
        from ledgerspec.contract.writer import save
        from ledgerspec.derivations.engine.protocol import ProtocolResult
        from ledgerspec.derivations.measure.measurer import ChildOutput, write_back

        doc = self.doc
        assert doc is not None
        if self.lengths:
            for key, value in (
                ("max_length", max(self.lengths)),
                ("sequence_p50", int(statistics.median_low(self.lengths))),
            ):
                if not doc.get("workload", key).known:
                    set_plain(doc, ("workload", key), value)
                    self.notes.append(f"workload.{key}: {value}, from the {len(self.lengths)} step(s) the callback saw")
        for key, value in self.components.items():
            set_figure(doc, ("ledger", key), value, "MEASURED", self._counted(key))
        self._say_what_is_replaced()
        command = f"LedgerCallback({self.path!r}) in {os.path.basename(sys.argv[0]) or 'python'} ({why})"
        software = ranks[0][1]["software"]
        if self.gathering:
            notes = _write_ranks(
                doc, [(i, ProtocolResult.from_json(p["result"])) for i, p in ranks], software, command, self.world
            )
        else:
            notes = write_back(doc, ChildOutput(ProtocolResult.from_json(ranks[0][1]["result"]), software), command)
        set_extension(doc, ("x-callback",), self._extension(why))
        if self.settle is not None:
            self.settle(doc, self.keep_status)
        save(doc, self.path, force=self.force)
        for note in [*self.notes, *notes]:
            log.info("ledgerspec LedgerCallback (%s): %s", self.path, note)
        self.notes.clear()

    def _counted(self, key: str) -> str:
        """The ``method`` of a ``ledger`` component the census counted (see :meth:`optimizer_stepped`)."""
        what = {
            "frozen_base": "the frozen parameters, buffers and quantization state, at on_train_begin",
            "adapter": "the trainable parameters (the adapters), at on_train_begin",
            "gradients": "the trainable parameters' .grad at the first optimizer step (on_optimizer_step: after "
            "backward, before zero_grad)",
            "optimizer": "the optimizer's state and the tensors it made when built (bitsandbytes' quantile maps), "
            "after its first step (on_optimizer_step)",
        }[key]
        device = self.backend.census_device
        where = f"on the {device} device" if device else "on the cpu"
        if device and key == "optimizer":
            where += " (host tensors, e.g. AdamW's step scalars, not counted)"
        ranks = f"; rank 0 of {self.world} (DDP replicates them)" if self.world > 1 else ""
        return f"census of the live tensors of the run (LedgerCallback): unique storages of {what}, {where}{ranks}"

    def _say_what_is_replaced(self) -> None:
        """Another run's MEASURED step figures are replaced by this run's: said in the log, never silently."""
        if not self._previous:
            return
        previous, self._previous = self._previous, {}
        command = previous.pop("command", None)
        changes = []
        for name, old in previous.items():
            rec = self.result.phases.get(name)
            new = "not measured by this run (removed)" if rec is None else f"{rec.figure} B"
            changes.append(f"{name} {old} B -> {new}")
        log.warning(
            "ledgerspec LedgerCallback (%s): replaces the MEASURED figures of an earlier measurement (%s): %s",
            self.path,
            command or "unknown command",
            "; ".join(changes),
        )

    def _extension(self, why: str) -> dict[str, Any]:
        return {
            "written_at": why,
            "steps_seen": self.steps_done,
            "sequence_lengths": list(self.lengths),
            "batch_held_ahead": list(self.ahead),
            **({"declared_vs_run": list(self.differences)} if self.differences else {}),
            **({"components_not_written": self.components_note} if self.components_note else {}),
            "observed": (
                "after_load, after_adapter_injection, after_optimizer_init: bytes held at on_train_begin (census of "
                "the live model and optimizer); forward/backward/optimizer_step: the run's first optimizer step; "
                "steady_state_peak: the steps after it"
            ),
        }


def _write_ranks(
    doc: Document, ranks: list[tuple[int, Any]], software: dict[str, str], command: str, world: int
) -> list[str]:
    """A DDP run's ranks into ``doc``: phases and metrics of the worst rank per phase (never a sum, as ``measure
    --nproc`` writes them, :func:`ledgerspec.derivations.measure.dist.worst_rank`), ``parallelism.per_rank_peak``
    (one MEASURED figure per rank that reported, in rank order) and the per-rank phases in ``x-callback-per-rank``."""
    from ledgerspec.contract.edit import remove_keys, set_extension, set_figure, set_plain
    from ledgerspec.derivations.engine.protocol import PHASES
    from ledgerspec.derivations.measure.dist import RankOutput, worst_rank
    from ledgerspec.derivations.measure.measurer import ChildOutput, write_back

    outs = [RankOutput(i, r, software) for i, r in ranks]
    merged = worst_rank(outs)
    notes = write_back(doc, ChildOutput(merged, software), command, compare=False)
    # the single-device calculated subtotal does not describe a rank (DDP adds its gradient buckets)
    remove_keys(doc, "comparison", ("calculated_subtotal", "measured_peak", "difference", "known_explanation"))
    what = "torch.cuda.max_memory_allocated" if merged.backend == "cuda" else "tracked tensor bytes"
    worst = max(o.peak for o in outs)
    set_figure(
        doc,
        ("metrics", "peak_allocated"),
        worst,
        "MEASURED",
        f"the worst of {len(outs)} DDP ranks (not a sum): maximum over the phases of {what}",
        force=True,
    )
    peaks = [
        {
            "value": o.peak,
            "source": "MEASURED",
            "method": f"rank {o.rank} of {world}: maximum over the phases of {what}",
        }
        for o in outs
    ]
    p = ("parallelism",)
    set_plain(doc, (*p, "gpu_count"), world, force=True)
    set_plain(doc, (*p, "per_rank_peak"), peaks, force=True)
    set_extension(
        doc,
        ("x-callback-per-rank",),
        {
            "world_size": world,
            "ranks_reported": [o.rank for o in outs],
            "method": "every rank measured itself with the callback; rank 0 gathered the results "
            "(torch.distributed.gather_object) and wrote the worst rank per phase",
            "ranks": [
                {
                    "rank": o.rank,
                    "peak_allocated": o.peak,
                    "phases": {n: o.result.phases[n].figure for n in PHASES if n in o.result.phases},
                }
                for o in outs
            ],
        },
    )
    if len(outs) < world:
        notes.append(f"only ranks {[o.rank for o in outs]} of {world} reported (the others' callbacks stopped)")
    return notes


def _maximum(values: list[int], other: int | None) -> int | None:
    both = [*values, *([] if other is None else [other])]
    return max(both) if both else None


def _current_cuda_device() -> int:
    import torch

    return int(torch.cuda.current_device())


def _message(exc: BaseException) -> str:
    if isinstance(exc, LedgerspecError):
        return exc.message + (f" (hint: {exc.hint})" if exc.hint else "")
    return described(exc, 200)


@cache
def callback_class(settle: Callable[[Document, bool], Any] | None = None) -> type:
    """The ``transformers.TrainerCallback`` subclass (made once; ``settle`` sets the status before each save)."""
    from transformers import TrainerCallback

    class LedgerCallback(Recorder, TrainerCallback):
        __doc__ = Recorder.__doc__

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._guard("train begin", lambda: self.begin(args, state, kw.get("model"), kw.get("optimizer")))
            try:
                self.agree(args)
            except Exception as exc:
                self._stop(f"train begin: {_message(exc)}")

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._guard("step begin", self.step_begin)

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._guard("optimizer step", self.optimizer_stepped)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._guard("step end", lambda: self.step_end(int(state.global_step)))
            self.save_point(int(state.global_step), final=False)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.save_point(int(state.global_step), final=True)

    LedgerCallback.settle = staticmethod(settle) if settle is not None else None
    LedgerCallback.__module__ = "ledgerspec.integrations.transformers"
    return LedgerCallback


def __getattr__(name: str) -> Any:
    if name == "LedgerCallback":
        return callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CallbackFailure", "Recorder", "callback_class", "declared_vs_live", "find_trainer", "optimizer_tensors"]
