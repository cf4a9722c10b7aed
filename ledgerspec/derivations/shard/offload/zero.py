"""DeepSpeed ZeRO offload in the per-rank simulation (issue 16 item 4): which side of the PCIe bus each tensor is on.

``offload_optimizer: {device: cpu}`` keeps the fp32 master partitions, their gradient partitions and the optimizer
(``DeepSpeedCPUAdam``) on the host; ``offload_param`` (ZeRO-3) also the parameter partitions. DeepSpeed 0.19.8 names
the host in its own code: ZeRO-1/2 ``self.device = 'cpu'`` (``stage_1_and_2.py`` 278), ZeRO-3
``self.device = OffloadDeviceEnum.cpu`` (``stage3.py`` 333) and ``zero.Init``'s ``remote_device`` from
``offload_param.device`` (``partition_parameters.py`` 1161-1168); the device is
``get_accelerator().current_device_name()``. Most host buffers are made with ``device=self.device`` (or
``remote_device``) or converted with ``.to(self.device)``; on a CPU-only machine both names are ``"cpu"``. The rest
are made with no device (``stage3.py`` 906-907), with the ``.device`` of another host tensor
(``stage_1_and_2.py`` 567-570) or by ``.cpu()``: rules 2 and 5 below.

So, in the simulation only (:func:`offload_sides`), each storage is put on its side as a GPU run would put it:

1. **Named host.** ZeRO-1/2's ``device``, ZeRO-3's ``subgroup_to_device`` and ``zero.Init``'s ``remote_device`` are
   stored as :class:`HostName`
   (a ``str`` equal to ``"cpu"``) when offload is declared; ZeRO-3's optimizer already holds the enum member. A torch
   call given such a device (a factory, ``Tensor.to``) or ``Tensor.cpu()`` allocates on the host; with the cuda
   target, ``.to(host)`` of a device tensor that returns the tensor itself (the CPU run's no-op) is made a copy, the
   transfer a GPU run makes.
2. **torch's default device.** A factory without a device called from DeepSpeed's ZeRO code allocates where torch
   allocates by default, the host (``stage3.py`` 906-907: ``param_groups_fp16_flat_cpu_memory``).
3. **Where the inputs are.** An op whose tensor inputs are all on the host makes its outputs there (the optimizer's
   norms of host gradients, ``clone`` of a host partition).
4. **The host optimizer.** With ``offload_optimizer``, everything ``DeepSpeedCPUAdam.step`` (or the client
   optimizer's, with ``zero_force_ds_cpu_optimizer: false``) allocates: it steps the host partitions.
5. **The optimizer's buffers by name.** After ``deepspeed.initialize``, the buffers of :data:`HOST_BUFFERS` are put
   on the host with ``offload_optimizer`` and on the device without it, whatever the rules above said: some are
   made with ``device=`` the ``.device`` of another host tensor, a ``torch.device("cpu")`` that names nothing on a
   CPU-only run; with ``offload_param`` alone ZeRO-3's fp32 master partitions are ``.to(self.device)`` copies of host
   partitions, a no-op on the CPU.

Everything else is on the device. The totals do not depend on the sides. For the cuda target the transfers a GPU
run makes are made: rule 1's device -> host copies, and DeepSpeed's ``.to(<the device>)`` of a host tensor becomes a
device copy (``stage3.py`` 2028/2034: each gradient partition brought back to accumulate; ``partition_parameters.py``
1360/1396: each offloaded parameter partition before its all-gather), transient. For the cpu target a transfer is
the CPU's no-op, so the totals are those of a real run on the CPU, compared to the byte by
``tests/derivations/shard/test_zero_offload.py``; a tensor converted by such a no-op keeps its side (the norm of a
gradient partition, computed on the device on a GPU, is the host's here: a few bytes).

``DeepSpeedCPUAdam`` is a C++ op (``CPUAdamBuilder``, compiled on first use); fake tensors have no data for it. Its
update works in place on the tensors it is given (``ops/adam/cpu_adam.py`` ``step``: the state tensors are made in
Python, ``adam_update`` writes into ``p.data``, ``exp_avg``, ``exp_avg_sq``) and allocates no torch tensor, so the
simulation loads :func:`cpu_adam_stand_in` instead of compiling it. A real run (``measure``) compiles and runs
the real op.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any


class HostName(str):
    """``"cpu"`` as DeepSpeed's offload device (equal to ``"cpu"`` everywhere; told apart by its type)."""

    __slots__ = ()


#: torch factories that allocate on torch's default device when given none
FACTORIES = frozenset({"empty", "zeros", "ones", "full", "tensor", "arange", "empty_strided", "as_tensor"})


def cpu_adam_stand_in() -> Any:
    """The C++ op ``DeepSpeedCPUAdam`` loads (``CPUAdamBuilder().load()``), for fake tensors: every entry point its
    Python side calls, none allocating (the real update writes in place)."""

    def nothing(*args: Any, **kwargs: Any) -> int:
        return 0

    return SimpleNamespace(create_adam=nothing, adam_update=nothing, destroy_adam=nothing, adam_rollback=nothing)


def _is_host(value: Any) -> bool:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    return isinstance(value, HostName) or value is OffloadDeviceEnum.cpu


def _named_device(args: Any, kwargs: Any) -> Any:
    import torch

    device = kwargs.get("device") if kwargs else None
    if device is not None:
        return device
    for a in args[1:3]:  # Tensor.to(device, dtype) / Tensor.to(dtype)
        if isinstance(a, str | torch.device):
            return a
    return None


def _sides_mode(tracker: Any, transfers: bool) -> Any:
    import torch
    from torch.overrides import TorchFunctionMode

    to_host = {torch.Tensor.to, torch.Tensor.cpu}

    class OffloadSides(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            device = _named_device(args, kwargs)
            name = getattr(func, "__name__", "")
            host = func is torch.Tensor.cpu or (device is not None and _is_host(device))
            if not host and device is None and name in FACTORIES and func is getattr(torch, name, None):
                caller = sys._getframe(1).f_globals.get("__name__", "")
                host = caller.startswith("deepspeed.runtime.zero")
            if not host:
                out = func(*args, **kwargs)
                if (
                    transfers
                    and func is torch.Tensor.to
                    and device is not None
                    and out is args[0]
                    and tracker.on_host(out)
                    and sys._getframe(1).f_globals.get("__name__", "").startswith("deepspeed.")
                ):
                    with tracker.devicing():
                        out = out.clone()  # the host -> device transfer a GPU run makes (a no-op on the CPU)
                return out
            with tracker.hosting():
                out = func(*args, **kwargs)
                if (
                    transfers
                    and func in to_host
                    and isinstance(out, torch.Tensor)
                    and out is args[0]
                    and not tracker.on_host(out)
                ):
                    out = out.clone()  # the device -> host transfer a GPU run makes (a no-op on the CPU)
            return out

    return OffloadSides()


def sides_tracker_class() -> type:
    """:func:`.sides.split_tracker_class` with rule 3 (outputs of all-host inputs on the
    host) and without FSDP's rules (the optimizer phase and gradient hooks decide nothing here)."""
    import torch

    from ledgerspec.derivations.engine.tracker import local_tensor
    from ledgerspec.derivations.shard.offload.sides import split_tracker_class

    base = split_tracker_class()

    class ZeroSides(base):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.grads_to_host = False

        _devicing = 0

        def _host_now(self) -> bool:
            return bool(self._hosting > 0) and not self._devicing

        @contextlib.contextmanager
        def devicing(self) -> Iterator[None]:
            """Inside: new storages on the device whatever their inputs (a transfer to the device)."""
            self._devicing += 1
            try:
                yield
            finally:
                self._devicing -= 1

        def on_host(self, t: Any) -> bool:
            lt = local_tensor(t)
            return lt.device.type != "meta" and int(lt.untyped_storage()._cdata) in self.host_keys

        def _on_op(self, args: Any, out: Any) -> None:
            inputs = [a for a in _tensors(args, torch.Tensor)]
            if not self._devicing and inputs and all(self.on_host(t) for t in inputs):
                with self.hosting():
                    self._register_outputs(out)
            else:
                self._register_outputs(out)

    return ZeroSides


def _tensors(args: Any, cls: type) -> Iterator[Any]:
    for a in args:
        if isinstance(a, cls):
            yield a
        elif isinstance(a, list | tuple):
            yield from _tensors(a, cls)


@contextlib.contextmanager
def offload_sides(tracker: Any, options: Any, transfers: bool) -> Iterator[None]:
    """Rules 1-3 of the module docstring while the simulated ZeRO step runs with ``tracker`` (a
    :func:`sides_tracker_class` instance) and the ``options``
    (:class:`ledgerspec.derivations.shard.options.ZeroOptions`) it declares; ``DeepSpeedCPUAdam``'s op replaced by
    :func:`cpu_adam_stand_in` (rules 4-5: :func:`host_optimizer`). ``transfers`` (the cuda target): the copies between
    host and device a GPU run makes are made; without it (the cpu target) a transfer is the no-op it is on the CPU and
    the totals are those of a real run on the CPU. The patched classes get their own attributes back on exit; objects
    made inside (the engine and its optimizer) keep the patched values and are not used after it."""
    from unittest import mock

    import deepspeed.runtime.zero.partition_parameters as pp
    import deepspeed.runtime.zero.stage3 as stage3
    import deepspeed.runtime.zero.stage_1_and_2 as stage12
    from deepspeed.ops.op_builder import CPUAdamBuilder

    def named(value: Any) -> Any:
        return HostName(value) if value == "cpu" and not isinstance(value, HostName) else value

    class HostNames(dict[Any, Any]):
        """ZeRO-3's ``subgroup_to_device``: ``'cpu'`` for every offloaded sub-group (``stage3.py`` 1106)."""

        def __setitem__(self, key: Any, value: Any) -> None:
            super().__setitem__(key, named(value))

    def host_named(attr: str, on: bool, wrap: Any = named) -> Any:
        slot = f"_ledgerspec_{attr}"

        def get(self: Any) -> Any:
            return getattr(self, slot)

        def put(self: Any, value: Any) -> None:
            setattr(self, slot, wrap(value) if on else value)

        return property(get, put)

    def fresh(value: Any) -> Any:
        return HostNames(value) if isinstance(value, dict) else value

    with contextlib.ExitStack() as stack:
        for owner, attr, value in (
            # ZeRO-1/2: `self.device = ... if not self.cpu_offload else 'cpu'`
            (stage12.DeepSpeedZeroOptimizer, "device", host_named("device", options.offload_optimizer)),
            # zero.Init: `self.remote_device = ...`, the offload device when offload_param is declared
            (pp.Init, "remote_device", host_named("remote_device", options.offload_param)),
            (
                stage3.DeepSpeedZeroOptimizer_Stage3,
                "subgroup_to_device",
                host_named("subgroup_to_device", options.offload_optimizer, fresh),
            ),
            (CPUAdamBuilder, "load", lambda self, verbose=True: cpu_adam_stand_in()),
        ):
            stack.enter_context(mock.patch.object(owner, attr, value, create=True))
        with _sides_mode(tracker, transfers):
            yield


#: rule 5: the host buffers DeepSpeed's ZeRO optimizer holds under ``offload_optimizer`` (0.19.8 attribute names)
HOST_BUFFERS = (
    "single_partition_of_fp32_groups",  # ZeRO-1/2 fp32 master partitions (stage_1_and_2.py 560) and their .grad (939)
    "param_buffer_of_bit16_for_cpu_offload_groups",  # ZeRO-1/2 (567: device=weights_partition.device, the host)
    "temp_grad_buffer_for_cpu_offload",  # ZeRO-1/2 (653)
    "fp32_partitioned_groups_flat",  # ZeRO-3 fp32 master partitions (stage3.py 1160) and their .grad (1338)
    "grad_partitions_flat_buffer",  # ZeRO-3 (791)
    "param_groups_fp16_flat_cpu_memory",  # ZeRO-3 with offload_param (905)
)


def _held(value: Any) -> Iterator[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        yield value
        if value.grad is not None:
            yield value.grad
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _held(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _held(v)


def host_optimizer(optimizer: Any, tracker: Any, options: Any) -> None:
    """After ``deepspeed.initialize``: rule 5, the optimizer's buffers of :data:`HOST_BUFFERS` put on the host with
    ``offload_optimizer`` (some were made from the device of another host tensor, ``device=weights_partition.device``:
    a ``torch.device`` on a CPU-only run, no name to tell; some converted by the CPU's no-op ``.to``) and on the
    device without it (``offload_param`` alone: ZeRO-3's fp32 master partitions and gradients stay on the device,
    made by ``.to(self.device)`` of host partitions); and rule 4 with ``offload_optimizer``, the basic optimizer
    inside DeepSpeed's ZeRO optimizer steps under ``tracker.hosting()`` (an instance attribute on that object)."""
    for name in HOST_BUFFERS:
        for t in _held(getattr(optimizer, name, None)):
            tracker.to_side(t, host=options.offload_optimizer)
    basic = getattr(optimizer, "optimizer", None)
    if basic is None or not options.offload_optimizer:
        return
    step = basic.step

    def hosted(*args: Any, **kwargs: Any) -> Any:
        with tracker.hosting():
            return step(*args, **kwargs)

    basic.step = hosted


__all__ = ["HostName", "cpu_adam_stand_in", "host_optimizer", "offload_sides", "sides_tracker_class"]
