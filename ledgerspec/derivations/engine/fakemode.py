"""The fake-tensor mode a traced step runs under: PyTorch's ``FakeTensorMode``, with four costs of its own taken out.

A 3-layer probe of a 7B QLoRA step dispatches about 28,000 operators on fake tensors (16,000 of them device
queries, which the tracker answers itself: :mod:`.tracker`); PyTorch spends most of each in Python. Four parts of
that cost do not depend on the step at all, and :class:`FastFakeTensorMode` removes them without changing any
operator's result:

1. **The dispatch cache's key.** FakeTensorMode caches each operator's output metadata under a key built from its
   arguments (``FakeTensorMode._cache_key``): for every fake tensor a ``TensorMetadata`` dataclass is built, then
   flattened field by field, each tuple recursively (``_prep_args_for_hash``, ``TensorMetadata._flatten_into``),
   about a third of a probe's time. :meth:`FastFakeTensorMode._prep_args_for_hash` writes the same fields of a
   plain (strided, static-shaped, non-constant) fake tensor of this mode as one tuple, less the memory format
   (PyTorch's ``suggest_memory_format`` and ``is_contiguous``: a function of the shape and strides, which the tuple
   holds); any other argument goes through PyTorch's own code, as before. The key holds the same information, so
   the same outputs come back. PyTorch's
   cache is shared by every mode of a process; where a key of this layout equals one of PyTorch's (an operator
   given only plain scalars), both encode the same arguments.
2. **TorchDynamo's wrapper.** Every ``TorchDispatchMode`` subclass's ``__torch_dispatch__`` is wrapped so that
   TorchDynamo never compiles it (``TorchDispatchMode.__init_subclass__``, while ``_should_skip_dynamo()``); the
   wrapper switches the frame-evaluation callback off and on around each call (two modes, each call of each), though
   nothing in a traced step is compiled. :func:`unwrapped_dispatch` gives the function inside it, for this mode
   and the tracker's (:mod:`.tracker`): about 6 % of a probe. (The tracker also answers fake tensors' device
   queries itself: ``tracker._device_query``.)
3. **The cached output, made.** On a cache hit (most operators of a probe) PyTorch makes the output fake tensor from
   the cached metadata (``FakeTensorMode._get_output_tensor_from_cache_entry``): each size and stride through a
   checking closure, the meta tensor made inside ``in_kernel_invocation_manager`` (a generator context manager,
   entered twice for a view), then ``FakeTensor(...)``, whose constructor resolves its device arguments twice and
   sets five memo slots through a descriptor each, three attributes apiece: about a quarter of a probe.
   :meth:`FastFakeTensorMode._get_output_tensor_from_cache_entry` makes the same tensor with the same calls written
   out for the common case (static shapes, a strided output that is neither conjugate nor negative, not in place);
   anything else goes through PyTorch's own code. With 4., a 2-layer probe of the 7B QLoRA step at microbatch 2
   (1,024 tokens) took 2.61 s of CPU time against 3.28 s (the fastest of six runs each, the two alternated in one
   process, the same events and figures).
4. **``aten._unsafe_view``, kept.** PyTorch's dispatch cache never keeps ``_unsafe_view`` (``_validate_cache_key``:
   "unsafe view"): its output shares its input's storage, which a cached entry of an operator that is not a view
   would not give. Every ``matmul`` of a 3-d input ends with one (404 in that probe), each run afresh through the
   whole of ``_dispatch_impl`` (three times a cached operator's cost). The first one of each input metadata and
   size (and inference mode) runs as before, and what it gave is kept where it is a plain view of its input's
   storage and the tensor made from it has the operator's dispatch keys, inference flag and attributes (an input
   made in another inference mode than the call's is not: PyTorch's own cache refuses the same case, "dispatch_key_set
   mismatch"); the next ones are made like a cached view's output (its storage set to the input's), with PyTorch's
   cross-check when the mode has it on. PyTorch's cache statistics no longer count them as bypasses.

Left in: an operator given a real tensor converts it to a fake one at every call (bitsandbytes' 8-bit optimizers pass
their real 256-entry quantization maps to every update: 0.6 ms, 168 times a probe), because PyTorch's converter
forgets a conversion when the fake tensor dies. Keeping the converted tensors alive saved 4 % of a probe but changed
what the tracker counts: a fake tensor an operator returns that shares the converted one's storage then stayed
alive, and a GRPO step's phases grew by 68-168 B, a ZeRO-3 offloaded one's by 2,984 B, against the real runs.

The first relies on the fields of ``torch._subclasses.fake_tensor.TensorMetadata``: :func:`fast_key_supported`
checks that they are the fields this module writes (:data:`METADATA_FIELDS`) and the plain ``FakeTensorMode`` is
used otherwise (slower, the same answers). The third and fourth write out PyTorch functions:
:func:`fast_output_supported` checks that the installed ones are those they were read from (the digest of each one's
source, :data:`OUTPUT_CHECKED`), else PyTorch's own paths are taken. ``tests/derivations/engine/test_fakemode.py``
traces probes with both modes and compares their event streams and figures, and the tensors each mode makes,
attribute by attribute.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

#: the fields of ``TensorMetadata`` (torch 2.13) that the fast key stands for, in order (it writes each one, but the
#: layout, always strided there, and the memory format, which its shape and strides give)
METADATA_FIELDS = (
    "dtype",
    "shape",
    "stride",
    "device",
    "layout",
    "memory_format",
    "storage_offset",
    "storage_bytes",
    "requires_grad",
    "is_quantized",
    "is_conj",
    "is_neg",
    "is_inference",
    "is_sparse",
    "is_coalesced",
    "dense_dim",
    "sparse_dim",
)


#: ``{torch release: {function: SHA-256 of its source}}``: the PyTorch functions that the fast output (3., 4.) writes
#: out or takes over from, as read in each release (add one only after reading them again)
OUTPUT_CHECKED = {
    "2.13.0": {
        "FakeTensorMode._get_output_tensor_from_cache_entry": (
            "548bbfc0ecc471e94428831e2470a8a8f24c170bebd20a822fd63477b7003e60"
        ),
        "FakeTensor.__new__": "edc72218ee23ca6c432a741016d4b854bb562f87ad658a8833b31e3970415e87",
        "FakeTensor.fake_device": "66f781feb8735d3f5bd8d2cda43b74b02bd6f36062f402e03ab8d5eabe7092c0",
        "SymNumberMemoDescriptor.__set__": "7efe44d498279dfba89dac2c7bb2dd75ac3d8cf9cd0e090aa98f559202a8f617",
        "in_kernel_invocation_manager": "24e0b9912707f1e59d72c4ccb8ee46c69bd1acab577ec32498418ba21f16f134",
        "FakeTensorMode._cached_dispatch_impl": "adf4bc424fae16f3b617891964538bfb022953de1d0d1f3ebc161af26a63cbc9",
        "FakeTensorMode._validate_cache_key": "6e680de04c253adae1f96aabf06f1683b174d2b658649f1b441c3ba2459083d4",
        "FakeTensorMode._dispatch_impl": "baaaad15ebe07a1a821a88694039f8cb238cb6d8c11429cbe01b385c8b7d8187",
        "FakeTensorMode._make_cache_entry": "acbd9c87030fe241543dc0ddcf652be49bff08d3ae31de6c2bc0ffc08d243131",
        "FakeTensorMode._get_output_info_for_cache_entry": (
            "110e8d0c87ca6b5b7762ad7ebbb4ccf399459c487bbacf9e989e66b85fca78c5"
        ),
        "FakeTensorMode._output_from_cache_entry": "f7abdd8b80c8dd89dc9f93df58c10dedff2d9a6498626f581e94d731af8e0d24",
    },
}


def _installed(name: str) -> Any:
    """The installed PyTorch function that ``name`` (a key of :data:`OUTPUT_CHECKED`, dotted from
    ``torch._subclasses.fake_tensor``) names: a property's setter for a property. Raises AttributeError when gone."""
    from torch._subclasses import fake_tensor

    found: Any = fake_tensor
    for part in name.split("."):
        found = getattr(found, part)
    return found.fset if isinstance(found, property) else found


@cache
def fast_output_supported() -> bool:
    """Whether the installed torch's functions that the fast output writes out are those it was read from."""
    from ledgerspec.derivations.stack.sources import source_digest

    try:
        return any(
            all(source_digest(_installed(name)) == digest for name, digest in release.items())
            for release in OUTPUT_CHECKED.values()
        )
    except AttributeError:  # a function is gone
        return False


@cache
def fast_key_supported() -> bool:
    """Whether the installed torch's ``TensorMetadata`` has exactly the fields the fast key writes."""
    from torch._subclasses import fake_tensor

    meta = getattr(fake_tensor, "TensorMetadata", None)
    if meta is None or not dataclasses.is_dataclass(meta):
        return False
    fields = tuple(f.name for f in dataclasses.fields(meta))
    return fields == METADATA_FIELDS and hasattr(fake_tensor.FakeTensorMode, "_prep_args_for_hash")


@cache
def _mode_class() -> type:
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode
    from torch._subclasses.fake_tensor import disable_fake_tensor_cache as disable_cache

    strided = torch.strided
    plain = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)

    fast = fast_key_supported()
    fast_output = fast_output_supported()
    raw_dispatch = unwrapped_dispatch(FakeTensorMode)
    make_subclass = torch.Tensor._make_subclass
    normalize = FakeTensor._normalize_fake_device
    fake_init = FakeTensor.__init__
    empty_strided = torch.empty_strided
    meta_in_tls = torch._C._meta_in_tls_dispatch_include
    set_meta_in_tls = torch._C._set_meta_in_tls_dispatch_include
    no_dispatch = torch._C._DisableTorchDispatch
    keep_keys = torch._C._PreserveDispatchKeyGuard
    throw_on_data_ptr = torch._C._set_throw_on_mutable_data_ptr
    warn_on_data_ptr = torch._C._set_warn_deprecated_on_mutable_data_ptr
    op_overload = torch._ops.OpOverload
    unsafe_view = torch.ops.aten._unsafe_view.default
    dispatch_keys = torch._C._dispatch_keys
    inference_mode = torch.is_inference_mode_enabled

    # what FakeTensor.__new__ sets besides the device and the mode (each memo descriptor given None sets three slots)
    unset = {"constant": None, "pytype": None, "dispatch_keys": None, "real_tensor": None}
    for memo in ("nonzero_memo", "item_memo", "unique_memo", "unique_consecutive_memo", "nested_int_memo"):
        unset.update({f"_{memo}": None, f"_{memo}_vc": None, f"_{memo}_epoch": None})
    made_attributes = {"_fake_device", "fake_mode", *unset}
    #: ``aten._unsafe_view`` outputs by their input's metadata and the size asked: the output's (shape, stride,
    #: storage offset, dtype, requires_grad, device), or None where it is not its input's storage (module docstring, 4.)
    unsafe_views: dict[tuple[Any, ...], tuple[Any, ...] | None] = {}

    class FastFakeTensorMode(FakeTensorMode):
        """``FakeTensorMode`` with a cheaper dispatch-cache key, without TorchDynamo's wrapper (module docstring)."""

        if raw_dispatch is not None:  # without TorchDynamo's wrapper (module docstring, 2.)

            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                return False

            __torch_dispatch__ = raw_dispatch

        if fast:

            def _prep_args_for_hash(self, result: list[Any], args: Any, state: Any, id_hashed: list[Any]) -> None:
                if not isinstance(args, (list, tuple)):  # a dict (kwargs), or anything else: PyTorch's own
                    super()._prep_args_for_hash(result, args, state, id_hashed)
                    return
                result.append(type(args))
                result.append(len(args))
                for arg in args:
                    kind = type(arg)
                    if kind in plain:
                        result.append(kind)
                        result.append(arg)
                    elif (
                        isinstance(arg, FakeTensor)
                        and arg.fake_mode is self
                        and arg.constant is None
                        and arg.layout is strided
                        and not arg._has_symbolic_sizes_strides
                    ):
                        result.append(
                            (
                                arg.dtype,
                                arg.shape,
                                arg.stride(),
                                arg.device,
                                arg.storage_offset(),
                                arg.untyped_storage().nbytes(),
                                arg.requires_grad,
                                arg.is_quantized,
                                arg.is_conj(),
                                arg.is_neg(),
                                arg.is_inference(),
                            )
                        )
                    elif isinstance(arg, (list, tuple)):
                        self._prep_args_for_hash(result, arg, state, id_hashed)
                    else:  # every other kind (a constant, a symbol, a dict, a callable): as PyTorch keys it
                        super()._prep_args_for_hash(result, (arg,), state, id_hashed)

        if fast_output:

            def _get_output_tensor_from_cache_entry(
                self, state: Any, entry: Any, key: Any, func: Any, args: Any
            ) -> Any:
                """PyTorch's own, written out for a strided output of static shape, neither conjugate nor negative,
                not in place (module docstring, 3.); any other goes through PyTorch's."""
                metadata = entry.metadata
                if (
                    entry.inplace_idx is not None
                    or metadata is None
                    or self.shape_env is not None
                    or metadata.layout is not strided
                    or metadata.is_conj
                    or metadata.is_neg
                    or FakeTensorConfig.debug
                ):
                    return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
                storage = None
                if isinstance(func, op_overload) and func.is_view:  # the output shares its input's storage
                    view_arg = args[entry.view_idx]
                    if not isinstance(view_arg, FakeTensor):
                        return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
                    storage = view_arg.untyped_storage()
                shape, stride = tuple(metadata.shape), tuple(metadata.stride)
                empty = self._meta_tensor(
                    shape, stride, metadata.dtype, metadata.requires_grad, storage, metadata.storage_offset
                )
                return self._fake_tensor(empty, metadata.device)

            def _meta_tensor(
                self, shape: Any, stride: Any, dtype: Any, requires_grad: bool, storage: Any, offset: int
            ) -> Any:
                """``torch.empty_strided`` on the meta device (set to ``storage`` at ``offset`` when given) inside
                ``in_kernel_invocation_manager(self)``, written out."""
                prev = self.in_kernel_invocation
                if meta_in_tls() != prev:
                    raise AssertionError(f"{meta_in_tls()}, {prev}")
                with no_dispatch():
                    self.in_kernel_invocation = True
                    with keep_keys():
                        set_meta_in_tls(True)
                        try:
                            empty = empty_strided(
                                shape, stride, dtype=dtype, layout=strided, device="meta", requires_grad=requires_grad
                            )
                            if storage is not None:
                                empty.set_(storage, offset, shape, stride)
                        finally:
                            self.in_kernel_invocation = prev
                return empty

            def _fake_tensor(self, empty: Any, fake_device: Any) -> Any:
                """``FakeTensor(self, empty, fake_device)``, written out (its constructor's checks and attributes)."""
                device = normalize(torch.device(fake_device))
                out = make_subclass(
                    FakeTensor, empty, empty.requires_grad, dispatch_device=True, device_for_backend_keys=device
                )
                if not self._allow_unsafe_data_ptr_access:
                    throw_on_data_ptr(out)
                else:
                    warn_on_data_ptr(out)
                if not self.allow_meta and device.type == "meta":
                    raise AssertionError("device.type must not be 'meta' when allow_meta is False")
                attributes = out.__dict__
                attributes["_fake_device"] = normalize(device)
                attributes["fake_mode"] = self
                attributes.update(unset)
                fake_init(out)
                return out

            def _unsafe_view_of(self, source: Any, kept: tuple[Any, ...]) -> Any:
                """The output of ``aten._unsafe_view`` of ``source`` as :data:`unsafe_views` keeps it: on ``source``'s
                storage, as a cached view's output is made."""
                shape, stride, offset, dtype, requires_grad, device = kept
                empty = self._meta_tensor(shape, stride, dtype, requires_grad, source.untyped_storage(), offset)
                return self._fake_tensor(empty, device)

            def _cached_dispatch_impl(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
                """PyTorch's own, but for ``aten._unsafe_view`` (module docstring, 4.): PyTorch's cache never keeps
                it (its output shares its input's storage, which a cached entry of an operator that is not a view
                would not give), so each one runs the operator afresh; here the first run of each input and size
                is kept, and the next ones are made like a cached view's output."""
                if func is not unsafe_view or kwargs or len(args) != 2 or FakeTensorConfig.debug:
                    return super()._cached_dispatch_impl(func, types, args, kwargs)
                source, size = args
                if not (
                    type(source) is FakeTensor
                    and source.fake_mode is self
                    and self.shape_env is None
                    and source.constant is None
                    and source.layout is strided
                    and not source._has_symbolic_sizes_strides
                    and not source.is_conj()
                    and not source.is_neg()
                    and isinstance(size, (list, tuple))
                    and all(type(n) is int for n in size)
                ):
                    return super()._cached_dispatch_impl(func, types, args, kwargs)
                key = (
                    source.dtype,
                    tuple(source.shape),
                    source.stride(),
                    source.storage_offset(),
                    source.device,
                    source.requires_grad,
                    source.is_inference(),
                    inference_mode(),
                    tuple(size),
                )
                if key in unsafe_views:
                    kept = unsafe_views[key]
                    if kept is None:
                        return super()._cached_dispatch_impl(func, types, args, kwargs)
                else:  # the first: run (as PyTorch's cache would), and keep what it gave
                    out: Any = super()._cached_dispatch_impl(func, types, args, kwargs)
                    plain = (
                        type(out) is FakeTensor
                        and out.fake_mode is self
                        and out.constant is None
                        and out.layout is strided
                        and not out._has_symbolic_sizes_strides
                        and not out.is_conj()
                        and not out.is_neg()
                        and out.untyped_storage()._cdata == source.untyped_storage()._cdata
                        and vars(out).keys() == made_attributes
                    )
                    kept = (
                        (tuple(out.shape), out.stride(), out.storage_offset(), out.dtype, out.requires_grad, out.device)
                        if plain
                        else None
                    )
                    if kept is not None:  # kept only where the tensor made from it is the one the operator gave
                        made = self._unsafe_view_of(source, kept)  # (its attributes: made_attributes, as plain asks)
                        if dispatch_keys(made) != dispatch_keys(out) or made.is_inference() != out.is_inference():
                            kept = None
                    unsafe_views[key] = kept
                    return out
                out = self._unsafe_view_of(source, kept)
                if self.cache_crosscheck_enabled:
                    with disable_cache(self):
                        self._crosscheck_cache_output(out, func, types, args, kwargs)
                return out

    return FastFakeTensorMode


#: tests set this to trace with PyTorch's own mode (:func:`stock_mode`) and compare
STOCK = False


def unwrapped_dispatch(mode_class: type) -> Any:
    """``mode_class.__torch_dispatch__`` without the TorchDynamo-disabling wrapper that ``TorchDispatchMode``
    subclasses get (None when this torch has no such wrapper, or no way to leave it out: then it stays)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    wrapped = mode_class.__dict__.get("__torch_dispatch__")
    raw = getattr(wrapped, "__wrapped__", None)
    if raw is None or not callable(raw) or "_should_skip_dynamo" not in TorchDispatchMode.__dict__:
        return None
    return raw


def fake_mode(**kwargs: Any) -> Any:
    """A new :class:`FastFakeTensorMode` (keyword arguments: ``FakeTensorMode``'s); PyTorch's own with
    :data:`STOCK`."""
    if STOCK:
        return stock_mode(**kwargs)
    mode_class = _mode_class()
    return mode_class(**kwargs)


def stock_mode(**kwargs: Any) -> Any:
    """PyTorch's own ``FakeTensorMode`` (the tests' reference)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


__all__ = [
    "METADATA_FIELDS",
    "OUTPUT_CHECKED",
    "fake_mode",
    "fast_key_supported",
    "fast_output_supported",
    "stock_mode",
    "unwrapped_dispatch",
]
