"""The fake-tensor mode a traced step runs under: PyTorch's ``FakeTensorMode``, with two costs of its own taken out.

A 3-layer probe of a 7B QLoRA step dispatches about 28,000 operators on fake tensors (16,000 of them device
queries, which the tracker answers itself: :mod:`.tracker`); PyTorch spends most of each in Python. Two parts of
that cost do not depend on the step at all, and :class:`FastFakeTensorMode` removes them without
changing any operator's result:

1. **The dispatch cache's key.** FakeTensorMode caches each operator's output metadata under a key built from its
   arguments (``FakeTensorMode._cache_key``): for every fake tensor a ``TensorMetadata`` dataclass is built, then
   flattened field by field, each tuple recursively (``_prep_args_for_hash``, ``TensorMetadata._flatten_into``),
   about a third of a probe's time. :meth:`FastFakeTensorMode._prep_args_for_hash` writes the same fields of a
   plain (strided, static-shaped, non-constant) fake tensor of this mode as one tuple; any other argument goes
   through PyTorch's own code, as before. The key holds the same information, so the same outputs come back. PyTorch's
   cache is shared by every mode of a process; where a key of this layout equals one of PyTorch's (an operator
   given only plain scalars), both encode the same arguments.
2. **TorchDynamo's wrapper.** Every ``TorchDispatchMode`` subclass's ``__torch_dispatch__`` is wrapped so that
   TorchDynamo never compiles it (``TorchDispatchMode.__init_subclass__``, while ``_should_skip_dynamo()``); the
   wrapper switches the frame-evaluation callback off and on around each call (two modes, each call of each), though
   nothing in a traced step is compiled. :func:`unwrapped_dispatch` gives the function inside it, for this mode
   and the tracker's (:mod:`.tracker`): about 6 % of a probe. (The tracker also answers fake tensors' device
   queries itself: ``tracker._device_query``.)

Left in: an operator given a real tensor converts it to a fake one at every call (bitsandbytes' 8-bit optimizers pass
their real 256-entry quantization maps to every update: 0.6 ms, 168 times a probe), because PyTorch's converter
forgets a conversion when the fake tensor dies. Keeping the converted tensors alive saved 4 % of a probe but changed
what the tracker counts: a fake tensor an operator returns that shares the converted one's storage then stayed
alive, and a GRPO step's phases grew by 68-168 B, a ZeRO-3 offloaded one's by 2,984 B, against the real runs.

The first relies on the fields of ``torch._subclasses.fake_tensor.TensorMetadata``: :func:`fast_key_supported`
checks that they are the fields this module writes (:data:`METADATA_FIELDS`) and the plain ``FakeTensorMode`` is
used otherwise (slower, the same answers). ``tests/derivations/engine/test_fakemode.py`` traces probes with both
modes and compares their event streams and figures.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

#: the fields of ``TensorMetadata`` (torch 2.13) that the fast key writes, in order
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
    from torch._prims_common import suggest_memory_format
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    strided = torch.strided
    plain = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)

    fast = fast_key_supported()
    raw_dispatch = unwrapped_dispatch(FakeTensorMode)

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
                        suggested = suggest_memory_format(arg)
                        memory_format = suggested if arg.is_contiguous(memory_format=suggested) else None
                        result.append(
                            (
                                arg.dtype,
                                arg.shape,
                                arg.stride(),
                                arg.device,
                                memory_format,
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


__all__ = ["METADATA_FIELDS", "fake_mode", "fast_key_supported", "stock_mode", "unwrapped_dispatch"]
