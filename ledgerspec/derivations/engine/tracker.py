"""Tensor memory accounting: a dispatch-level tracker and a census of the long-lived training state.

Two tools, both working for real tensors (CPU or CUDA) and for fake tensors (``FakeTensorMode``):

* :func:`census` walks a model and its optimizer and counts the bytes of unique storages by
  category (frozen base parameters, buffers, quantization state, adapter, gradients, optimizer
  state). It is exact for what it walks and costs one pass over the parameters.
* :class:`MemoryTracker` is a ``TorchDispatchMode`` that sees every tensor produced by an op while
  it is active, registers each new storage once (views share storages and are not double counted)
  and learns of its release through a ``weakref.finalize`` on the storage. It keeps the current and
  peak bytes, the bytes per category at the peak, and can turn exceeding a budget into a simulated
  out-of-memory error.

Categories (:data:`CATEGORIES`): an allocation gets a provisional label from the tracker's
``context`` when it is made (``activations`` during forward, ``temporary`` during backward, ...);
:meth:`MemoryTracker.reclassify` relabels the storages a census recognises with their exact
category, and a post-accumulate-grad hook relabels each gradient the moment autograd stores it.
What the tracker cannot see: memory allocated inside a kernel without going through the dispatcher
(e.g. the CPU flash-attention kernel's scratch buffers), and memory outside PyTorch (bitsandbytes
paged buffers, CUDA context, cuBLAS workspaces).

Imports torch only inside functions and methods (the dispatch mode class is created on first use).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import Any

#: tracker categories; the first six map onto ledger components (see :data:`LEDGER_COMPONENT`)
CATEGORIES = (
    "frozen_params",
    "buffers",
    "quant_state",
    "adapter",
    "gradients",
    "optimizer",
    "activations",
    "temporary",
)
#: which ledger component each category belongs to
LEDGER_COMPONENT = {
    "frozen_params": "frozen_base",
    "buffers": "frozen_base",
    "quant_state": "frozen_base",
    "adapter": "adapter",
    "gradients": "gradients",
    "optimizer": "optimizer",
    "activations": "activations",
    "temporary": "temporary",
}

SIMULATED_OOM_MARKER = "ledgerspec simulated out of memory"


class SimulatedOOM(RuntimeError):
    """The tracked tensor bytes went over ``--memory-limit`` (a simulated out-of-memory, not a real one)."""


def by_component(categories: dict[str, int]) -> dict[str, int]:
    """Fold tracker categories into ledger components (frozen_base, adapter, gradients, ...)."""
    out: dict[str, int] = {}
    for cat, n in categories.items():
        comp = LEDGER_COMPONENT.get(cat, cat)
        out[comp] = out.get(comp, 0) + n
    return out


# -- census ---------------------------------------------------------------------------------------------------------


def local_tensor(t: Any) -> Any:
    """A DTensor's local shard, else ``t``: a DTensor's own storage is a wrapper's, sized like the global tensor."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def storage_key(t: Any) -> int:
    """One key per storage: views of one buffer share it."""
    return int(local_tensor(t).untyped_storage()._cdata)


def storage_nbytes(t: Any) -> int:
    return int(local_tensor(t).untyped_storage().nbytes())


def quant_state_tensors(qs: Any) -> Iterator[Any]:
    """The tensors a bitsandbytes ``QuantState`` holds (absmax, code, offset, and the nested state)."""
    import torch

    if qs is None:
        return
    for name in ("absmax", "code", "offset"):
        t = getattr(qs, name, None)
        if isinstance(t, torch.Tensor):
            yield t
    nested = getattr(qs, "state2", None)
    if nested is not None and nested is not qs:
        yield from quant_state_tensors(nested)


def _optimizer_tensors(optimizer: Any) -> Iterator[Any]:
    import torch

    if optimizer is None:
        return
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v
            elif isinstance(v, dict | list | tuple):  # e.g. bitsandbytes keeps some state in containers
                items = v.values() if isinstance(v, dict) else v
                for w in items:
                    if isinstance(w, torch.Tensor):
                        yield w


def census_storages(model: Any, optimizer: Any = None, device_type: str | None = None) -> dict[int, tuple[str, int]]:
    """Every storage the model and optimizer hold: ``{storage key: (category, nbytes)}``.

    A storage reachable in two ways counts once, in the first category found in this order:
    adapter/frozen parameters, quantization state, buffers, gradients, optimizer state.
    ``device_type`` (e.g. ``"cuda"``) counts only tensors on that kind of device (AdamW keeps its
    ``step`` scalars on the host).
    """
    import torch

    seen: dict[int, tuple[str, int]] = {}

    def add(t: Any, cat: str) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        if device_type is not None and t.device.type != device_type:
            return
        key = storage_key(t)
        if key not in seen:
            seen[key] = (cat, storage_nbytes(t))

    if model is not None:
        params = list(model.parameters())
        # FSDP1's flat parameters first: their original parameters are views of them, but under NO_SHARD a unit's
        # originals are left as plain tensors after its forward (``_use_unsharded_views(as_params=False)``, never
        # restored without a reshard), so ``parameters()`` no longer reaches them (torch 2.13: after backward the
        # tiny LoRA model's frozen parameters counted 235,584 B of its 1,048,032). A flat parameter is one dtype and
        # one requires_grad under the wrapping modelled here (PEFT's policy: every LoRA leaf its own unit), so its
        # category is its originals'; a flat parameter mixing both (use_orig_params without that policy) counts as
        # adapter
        for module in model.modules():
            flat = getattr(getattr(module, "_handle", None), "flat_param", None)
            if flat is not None:
                add(flat, "adapter" if flat.requires_grad else "frozen_params")
        for p in params:
            add(p, "adapter" if p.requires_grad else "frozen_params")
        for p in params:
            for t in quant_state_tensors(getattr(p, "quant_state", None)):
                add(t, "quant_state")
        for b in model.buffers():
            add(b, "buffers")
        for p in params:
            if p.grad is not None:
                add(p.grad, "gradients")
    for t in _optimizer_tensors(optimizer):
        add(t, "optimizer")
    return seen


def census(model: Any, optimizer: Any = None, device_type: str | None = None) -> dict[str, int]:
    """Bytes of unique storages by category for the model (parameters, buffers, quant state, grads) and optimizer."""
    out = dict.fromkeys(CATEGORIES[:6], 0)
    for cat, n in census_storages(model, optimizer, device_type).values():
        out[cat] += n
    return out


# -- the tracker ----------------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    nbytes: int
    category: str


@dataclass
class TrackerSnapshot:
    """Totals at one moment: ``current`` bytes and bytes by category."""

    current: int
    categories: dict[str, int] = field(default_factory=dict)


class MixedDtypeMatmul(RuntimeError):
    """A simulated matrix product over operands of different dtypes: a step that cannot run.

    The real CPU and CUDA kernels of ``mm``/``addmm``/``bmm``/``baddbmm`` refuse it ("expected m1 and m2 to have
    the same dtype", ``aten/src/ATen/native/LinearAlgebra.cpp`` and ``cuda/Blas.cpp``), but the meta kernels of
    ``mm``/``addmm``, the ones fake tensors run (``torch/_meta_registrations.py`` ``meta_mm``; torch 2.13's bmm and
    baddbmm meta kernels do check), check no dtypes: without this check a
    simulation would carry on in the first operand's dtype and give figures for a run that fails at its first
    forward (found with FSDP1 ``MixedPrecision`` without autocast, issue 16). Autocast has cast the operands before
    a dispatch mode sees them (the Autocast key is above the Python key), so a valid step never trips it.

    ``index_add``/``index_add_`` too: the CPU kernel refuses a ``source`` whose dtype is not ``self``'s
    ("index_add_(): self (BFloat16) and source (Float) must have the same scalar type",
    ``aten/src/ATen/native/TensorAdvancedIndexing.cpp``, ``index_add_cpu_``), the meta kernel does not (torch 2.13):
    transformers 4.57.6's DeepSeek-V3 MoE loop accumulates its experts' float32 outputs into a bfloat16 buffer under
    PEFT's k-bit preparation and bf16 autocast, and the real run fails there (``stack/legacy_moe/deepseek.py``)."""

    def __init__(self, func: Any, dtypes: list[Any]) -> None:
        self.func = func
        shown = " and ".join(str(d).replace("torch.", "") for d in dtypes)
        super().__init__(f"{func} of {shown} operands: the real kernel refuses mixed dtypes")


@cache
def _matmuls() -> frozenset[Any]:
    import torch

    aten = torch.ops.aten
    return frozenset(
        {
            aten.mm.default,
            aten.addmm.default,
            aten.bmm.default,
            aten.baddbmm.default,
            aten.index_add.default,
            aten.index_add_.default,
        }
    )


def _check_matmul_dtypes(func: Any, args: Any) -> None:
    """Raise :class:`MixedDtypeMatmul` when fake operands of a matrix product (``self`` and ``source`` of an
    ``index_add``) differ in dtype (real tensors are left to their own kernels)."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    if "index_add" in str(func):  # (self, dim, index, source): the int64 index is no operand
        args = (args[0], args[3]) if len(args) > 3 else ()
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len({a.dtype for a in tensors}) > 1 and any(is_fake(a) for a in tensors):
        raise MixedDtypeMatmul(func, [a.dtype for a in tensors])


@cache
def _profiler_marks() -> frozenset[Any]:
    """The two operators ``torch.profiler.record_function`` dispatches on entering and leaving a named range
    (``torch/autograd/profiler.py``, ``record_function.__enter__``/``__exit__``): FSDP1 opens one around every
    pre- and post-forward and -backward hook of every unit (``torch/distributed/fsdp/_runtime_utils.py``), about
    20,000 in a 7B step's probes. They take no tensor and make none; under a fake mode each entering one went through
    the whole of ``FakeTensorMode._dispatch_impl`` (PyTorch's dispatch cache bypasses operators outside aten:
    "non-builtin"; the leaving one it handles directly), about 13 % of an FSDP1 7B estimate's time. A session of fake
    tensors runs both below the Python modes (:func:`_mode_class`): the same ``RecordFunction`` object, seen by a
    profiler if one is running."""
    import torch

    profiler = torch.ops.profiler
    return frozenset({profiler._record_function_enter_new.default, profiler._record_function_exit._RecordFunction})


@cache
def _device_query() -> tuple[Any, Any, Any]:
    """``(prim.device, FakeTensor, the meta device)`` where this torch is the one whose FakeTensor the tracker
    answers for (2.13: ``FakeTensor.__torch_dispatch__``, fake_tensor.py 1025-1033, returns ``fake_device``, or
    ``meta`` inside a kernel invocation); else ``(None, None, None)``: every query goes to the fake mode."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    if (
        not torch.__version__.startswith("2.13.")
        or not isinstance(getattr(FakeTensor, "fake_device", None), property)
        or not hasattr(FakeTensorMode, "in_kernel_invocation")
    ):
        return None, None, None
    return torch.ops.prim.device.default, FakeTensor, torch.device("meta")


@cache
def _mode_class(fake: bool = False) -> Any:
    """The tracker's dispatch mode; ``fake``: for a session of fake tensors, where it answers fake tensors' device
    queries itself and runs without TorchDynamo's wrapper (nothing is compiled there; with real tensors a compiled
    function may run under the tracker, and the wrapper keeps TorchDynamo out of the tracker's own frames)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    matmuls = _matmuls()
    device_query, fake_class, meta = _device_query() if fake else (None, None, None)
    marks = _profiler_marks() if fake else frozenset()
    below_modes = torch._C._DisableTorchDispatch

    class _TrackingMode(TorchDispatchMode):
        def __init__(self, tracker: MemoryTracker) -> None:
            super().__init__()
            self.tracker = tracker

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is device_query and type(args[0]) is fake_class:
                # a fake tensor's device, as FakeTensor.__torch_dispatch__ answers it, without passing through the
                # fake mode: 16,000 of the 27,000 operators a 3-layer probe dispatches (autograd and TensorIterator
                # ask for every tensor's device)
                t = args[0]
                return meta if t.fake_mode.in_kernel_invocation else t.fake_device
            if func in marks:  # a profiler's named range: no tensor in or out (_profiler_marks)
                with below_modes():
                    return func(*args, **(kwargs or {}))
            if func in matmuls:
                _check_matmul_dtypes(func, args)
            out = func(*args, **(kwargs or {}))
            self.tracker._on_op(args, out)
            return out

    from ledgerspec.derivations.engine.fakemode import unwrapped_dispatch

    raw = unwrapped_dispatch(_TrackingMode) if fake else None
    if raw is not None:  # fake tensors: nothing is compiled, TorchDynamo's wrapper only costs (fakemode, 2.)
        _TrackingMode.__torch_dispatch__ = raw  # type: ignore[method-assign]
        _TrackingMode._should_skip_dynamo = classmethod(lambda cls: False)  # type: ignore[method-assign,assignment]

    return _TrackingMode


def _in_fake_session() -> bool:
    """Whether a fake-tensor mode is on the dispatch mode stack now (the tracker is entered inside it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


#: the trackers active now (innermost last): every one hears of each storage resize
_ACTIVE: list[MemoryTracker] = []


def _watch_resizes(tracker: MemoryTracker) -> None:
    """Storage ``resize_`` is no tensor op, so a dispatch mode never sees it: FSDP2 frees each gathered parameter
    with ``untyped_storage().resize_(0)`` after its layer ran (and re-allocates it the same way). While any tracker
    is active, ``UntypedStorage.resize_`` is wrapped so that every active tracker counts a live storage's new size
    at once; the wrapper is removed when the last tracker exits, whatever the order."""
    import torch

    if not _ACTIVE:
        base = getattr(torch._C.StorageBase, "resize_")  # noqa: B009 (not in the type stubs)

        def resize_(storage: Any, size: int) -> Any:
            out = base(storage, size)
            for active in list(_ACTIVE):
                active._resized(storage)
            return out

        setattr(torch.UntypedStorage, "resize_", resize_)  # noqa: B010 (a method of a torch class, on purpose)
    _ACTIVE.append(tracker)


def _unwatch_resizes(tracker: MemoryTracker) -> None:
    import torch

    if tracker in _ACTIVE:
        _ACTIVE.remove(tracker)
    if not _ACTIVE and "resize_" in torch.UntypedStorage.__dict__:
        delattr(torch.UntypedStorage, "resize_")


class MemoryTracker:
    """Counts the bytes of live tensor storages created while active (real or fake tensors).

    Use as a context manager (inside a ``FakeTensorMode`` for fake tensors: enter the fake mode
    first). ``context`` is the provisional category of new allocations. ``limit`` (bytes) makes an
    allocation that brings the total above it raise :class:`SimulatedOOM`. ``granularity`` rounds each
    storage up to a multiple of it (512 models the CUDA caching allocator's rounding, which
    ``max_memory_allocated`` counts; 1, the default, counts exact bytes; empty storages stay 0).

    ``events=True`` keeps an event log (:attr:`events`, off by default: None, and nothing is recorded) of what a
    CUDA caching allocator would be asked, in order: ``("alloc", id, nbytes, 0)`` for every new storage of
    ``nbytes > 0`` (the bytes requested, before any rounding: the allocator rounds them itself), ``("free", id)``
    when it is released, and ``("phase", name)`` markers (:meth:`mark`). A storage resize is what
    ``resize_bytes_cuda`` (``aten/src/ATen/native/cuda/Resize.cpp``) does on a GPU: the new size is allocated
    first (nothing for 0 bytes), then the old buffer freed, so FSDP2's ``resize_(0)`` is a free and the
    ``resize_(n)`` that gathers a parameter again an allocation. The tracker's own count moves by the difference
    at once, so for a resize between two non-zero sizes its peak misses the moment both buffers are alive.
    """

    def __init__(self, limit: int | None = None, granularity: int = 1, events: bool = False) -> None:
        if granularity < 1:
            raise ValueError("granularity must be >= 1")
        self._mode = _mode_class()(self)
        self.limit = limit
        self.granularity = granularity
        self.context = "temporary"
        self._live: dict[int, _Entry] = {}
        self._totals: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.current = 0
        self.peak = 0
        self.peak_categories: dict[str, int] = dict(self._totals)
        self._hooks: list[Any] = []
        #: the allocation event log (None: not kept)
        self.events: list[tuple[Any, ...]] | None = [] if events else None
        #: the stream an allocation is made on (None: all on stream 0)
        self.stream_of: Any = None
        self._event_ids: dict[int, tuple[int, int]] = {}  # storage key -> (event id, bytes) of its live buffer
        self._event_streams: dict[int, int] = {}  # event id -> its stream, while alive
        #: live event ids another stream used (``record_stream``): their free is logged as pending
        self._recorded: set[int] = set()
        #: pending frees logged so far (``("free", id, "pending")``)
        self.pending_frees = 0
        #: while set, every new allocation is also used on this stream (as :meth:`record_stream` says), e.g. the
        #: flat buckets a collective flattens inside C++, out of Python's reach (None: off)
        self.used_by: int | None = None

    # -- dispatch ------------------------------------------------------------------------------------------------
    def __enter__(self) -> MemoryTracker:
        if _in_fake_session():
            self._mode = _mode_class(fake=True)(self)
        _watch_resizes(self)
        try:
            self._mode.__enter__()
        except BaseException:
            _unwatch_resizes(self)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._mode.__exit__(*exc)
        finally:
            _unwatch_resizes(self)

    def _rounded(self, storage: Any) -> int:
        """A storage's bytes, rounded up to the allocator granularity."""
        nbytes = int(storage.nbytes())
        return -(-nbytes // self.granularity) * self.granularity if self.granularity > 1 else nbytes

    def _resized(self, storage: Any) -> None:
        """A live storage's size now, counted at once (no-op for a storage the tracker never saw)."""
        entry = self._live.get(int(storage._cdata))
        if entry is None:
            return
        nbytes = self._rounded(storage)
        if self.events is not None:
            self._log_resize(int(storage._cdata), int(storage.nbytes()))
        if nbytes != entry.nbytes:
            self._add(entry.category, nbytes - entry.nbytes)
            entry.nbytes = nbytes
            self._check_peak()

    def _on_op(self, args: Any, out: Any) -> None:
        """Every op the dispatch mode sees: its outputs are registered (a subclass may look at the inputs)."""
        self._register_outputs(out)

    def _register_outputs(self, out: Any) -> None:
        import torch

        if isinstance(out, torch.Tensor):
            self._register(out)
        elif isinstance(out, list | tuple):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._register(o)
                elif isinstance(o, list | tuple):
                    self._register_outputs(o)

    def _register(self, t: Any) -> None:
        t = local_tensor(t)
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = int(storage._cdata)
        entry = self._live.get(key)
        if entry is not None:  # resize_ / set_ may have changed the storage in place
            self._resized(storage)
            return
        nbytes = self._rounded(storage)
        self._live[key] = _Entry(nbytes, self.context)
        if self.events is not None:
            self._log_alloc(key, int(storage.nbytes()))
        weakref.finalize(storage, self._release, key)
        self._add(self.context, nbytes)
        self._check_peak()

    def _release(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._add(entry.category, -entry.nbytes)
            if self.events is not None:
                self._log_free(key)

    # -- the event log (``events=True``) -------------------------------------------------------------------------
    def _log_alloc(self, key: int, nbytes: int) -> None:
        assert self.events is not None
        if nbytes > 0:  # the caching allocator is not called for 0 bytes
            ident = len(self.events)
            self._event_ids[key] = (ident, nbytes)
            stream = self.stream_of() if self.stream_of else 0
            if stream:
                self._event_streams[ident] = stream
            if self.used_by is not None and self.used_by != stream:
                self._recorded.add(ident)
            self.events.append(("alloc", ident, nbytes, stream))

    def _free_event(self, ident: int) -> None:
        assert self.events is not None
        self._event_streams.pop(ident, None)
        if ident in self._recorded:
            self._recorded.discard(ident)
            self.pending_frees += 1
            self.events.append(("free", ident, "pending"))
        else:
            self.events.append(("free", ident))

    def _log_free(self, key: int) -> None:
        assert self.events is not None
        live = self._event_ids.pop(key, None)
        if live is not None:
            self._free_event(live[0])

    def record_stream(self, storage: Any, stream: int) -> None:
        """``tensor.record_stream(s)`` on a GPU: the live buffer of ``storage`` is used on stream ``stream`` (a
        number as :attr:`stream_of` gives): if that is not the stream it was allocated on, its free is logged as
        pending (the caching allocator returns it to the pool only once that stream has caught up)."""
        if self.events is None:
            return
        live = self._event_ids.get(int(storage._cdata))
        if live is not None and self._event_streams.get(live[0], 0) != stream:
            self._recorded.add(live[0])

    def sync(self, keep: int = 0) -> None:
        """The host waited for the device: every pending free but the last ``keep`` has completed."""
        if self.events is not None:
            self.events.append(("sync", keep))

    def _log_resize(self, key: int, nbytes: int) -> None:
        """A live storage now of ``nbytes``: if that changed, a new buffer (if any), then the old one freed
        (``resize_bytes_cuda``)."""
        assert self.events is not None
        old = self._event_ids.get(key)
        if (old[1] if old is not None else 0) == nbytes:
            return
        self._event_ids.pop(key, None)
        self._log_alloc(key, nbytes)
        if old is not None:
            self._free_event(old[0])

    def mark(self, name: str) -> None:
        """A phase marker in the event log (no-op without one)."""
        if self.events is not None:
            self.events.append(("phase", name))

    def _add(self, category: str, nbytes: int) -> None:
        self._totals[category] = self._totals.get(category, 0) + nbytes
        self.current += nbytes

    def _check_peak(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
            self.peak_categories = dict(self._totals)
        if self.limit is not None and self.current > self.limit:
            raise SimulatedOOM(
                f"{SIMULATED_OOM_MARKER}: tracked tensors need {self.current} B, over the "
                f"--memory-limit of {self.limit} B"
            )

    # -- queries -------------------------------------------------------------------------------------------------
    def reset_peak(self) -> None:
        """Start a new peak window at the current total."""
        self.peak = self.current
        self.peak_categories = dict(self._totals)

    def categories(self) -> dict[str, int]:
        """Live bytes by category now."""
        return dict(self._totals)

    def snapshot(self) -> TrackerSnapshot:
        return TrackerSnapshot(self.current, self.categories())

    # -- classification ------------------------------------------------------------------------------------------
    def track_existing(self, tensors: Iterable[Any], category: str) -> None:
        """Register tensors created before the tracker was active (counted from now on)."""
        saved = self.context
        self.context = category
        try:
            for t in tensors:
                self._register(t)
        finally:
            self.context = saved

    def reclassify(self, model: Any, optimizer: Any = None, stale: Iterable[str] = ()) -> None:
        """Relabel every storage the census recognises; storages still labelled ``stale`` become ``temporary``."""
        known = census_storages(model, optimizer)
        stale_set = set(stale)
        for key, entry in self._live.items():
            hit = known.get(key)
            new = hit[0] if hit else ("temporary" if entry.category in stale_set else entry.category)
            if new != entry.category:
                self._totals[entry.category] -= entry.nbytes
                self._totals[new] = self._totals.get(new, 0) + entry.nbytes
                entry.category = new

    def label(self, tensor: Any, category: str) -> None:
        """Give one live tensor's storage an exact category (no-op for a storage the tracker never saw)."""
        entry = self._live.get(storage_key(tensor))
        if entry is not None and entry.category != category:
            self._totals[entry.category] -= entry.nbytes
            self._totals[category] = self._totals.get(category, 0) + entry.nbytes
            entry.category = category

    def watch_gradients(self, model: Any) -> None:
        """Label each trainable parameter's ``.grad`` as ``gradients`` as soon as autograd stores it."""
        self.unwatch()
        for p in model.parameters():
            if p.requires_grad:  # never on frozen parameters: they get no gradient
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: Any) -> None:
        if p.grad is not None:
            self.label(p.grad, "gradients")

    def unwatch(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


__all__ = [
    "CATEGORIES",
    "LEDGER_COMPONENT",
    "SIMULATED_OOM_MARKER",
    "MemoryTracker",
    "SimulatedOOM",
    "TrackerSnapshot",
    "by_component",
    "census",
    "census_storages",
    "quant_state_tensors",
]
