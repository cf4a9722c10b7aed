"""CPU offload under FSDP (issue 16): what leaves the device, what comes back per step, and the host's peak.

Modelled: FSDP2 ``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=...))`` and FSDP1
``FullyShardedDataParallel(..., cpu_offload=CPUOffload(offload_params=True))``. Upstream behaviour relied on
(torch 2.13, ``torch/distributed/fsdp/``):

- FSDP2 (``_fully_shard/_fsdp_param.py``): ``FSDPParam._init_sharded_param`` moves each padded shard to the CPU
  (``padded_sharded_param.cpu()``, pinned when ``pin_memory``); ``all_gather_inputs`` copies it to the compute
  device before every all-gather (``sharded_param_data.to(self.device, non_blocking=True)``), into the group's
  all-gather buffer, freed after the copy-in; ``_fsdp_collectives.foreach_reduce`` copies each reduce-scatter output
  shard to the CPU (``new_sharded_grad.to(torch.device("cpu"))``) so the sharded gradients live on the host; the
  optimizer then steps the CPU shards with CPU gradients, so its state and its temporaries are host memory.
  ``_fsdp_param_group._validate_cpu_offload_params`` requires the shards on the CPU.
- FSDP1 (``_flat_param.py``, ``_runtime_utils.py``): ``FlatParamHandle.init_flat_param_attributes`` keeps the local
  flat shard on the CPU (``_local_shard = flat_param.data.pin_memory()``) and pre-allocates a pinned CPU gradient of
  the shard's size (``_cpu_grad``), kept for the whole run; ``FlatParamHandle.pre_unshard`` copies the shard to the
  device before the all-gather (``flat_param_to(self.device)``); ``_runtime_utils._offload_grad`` copies the
  reduce-scatter output into ``_cpu_grad`` and ``prepare_gradient_for_optim`` points ``flat_param.grad`` at it; the
  optimizer steps on the CPU.

What stays on the device: the all-gathered units while they compute (and what FSDP keeps gathered into backward),
the unsharded gradients and the reduce-scatter buffers, activations and temporaries, the model's buffers. What
moves each step: every gather copies the unit's shard host -> device (forward, and again in backward when the unit
was resharded), every reduce-scatter copies the gradient shard device -> host.

How it is simulated without a GPU (:mod:`.sides`: ``split_tracker_class``, ``recording_sides``): every storage is on one
side by its ROLE, since on a CPU-only run both sides are host memory. Host: the sharded parameters (FSDP2
``FSDPParam._sharded_param_data``, FSDP1 ``FlatParameter._local_shard``), their sharded gradients (FSDP2
``sharded_param.grad``, FSDP1 ``_cpu_grad``), the optimizer state, and everything the optimizer step allocates; under
FSDP1 also what the load builds before the wrapper moves the buffers to the device (in the device's allocation stream,
:func:`fsdp1_shards_to_the_host`: each unit made on the device as FSDP1 wraps it, its shard moved to the host after
``shard()``). Device: all the rest. The phases keep their totals (device + host, comparable with a real offloaded run
on the CPU to the byte); each phase also gets its device and host peaks. ``.to(device)`` of a CPU tensor is the tensor
itself when the device is the CPU, so a CPU run has no staging copy of the shards on the device before an all-gather;
for the cuda target it is made (:func:`staging_on_the_device`, :func:`fsdp1_staging_on_the_device`).

The device-level verdict replays the device's allocation stream: a split tracker with an event log logs the device's
storages only (:mod:`.sides`), and FSDP1's wait for its gradient copies at the end of backward is a ``sync`` in it
(:func:`waiting_for_gradient_copies`).

Pinned memory (``pin_memory()``) needs an accelerator; on a CPU-only host :func:`pinning_as_copies` makes it a plain
copy, which is what it is in bytes (``Tensor.pin_memory`` copies into page-locked memory). FSDP1's CPUOffload
always pins, so it runs on gloo only with that replacement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ledgerspec.derivations.shard.patching import patched


@contextlib.contextmanager
def pinning_as_copies(hosting: Any = None, always: bool = False) -> Iterator[None]:
    """FSDP offload on a host without an accelerator (restored on exit; nothing changes where one is available).

    ``Tensor.pin_memory()`` becomes a plain copy (page-locked memory is host memory: the same bytes, copied), and
    ``torch.cpu.Stream`` gets a no-op ``synchronize`` (FSDP1's ``_post_backward_final_callback`` waits for the
    device -> host gradient copies with ``current_stream().synchronize()``; on the CPU they are done already).
    ``hosting``: a context manager factory the copy is made under (the simulation puts pinned memory on the host);
    ``always``: replace even where an accelerator is available (fake tensors are never pinned).
    """
    import torch

    if torch.accelerator.is_available() and not always:
        yield
        return
    original = torch.Tensor.pin_memory

    def pin_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        with hosting() if hosting is not None else contextlib.nullcontext():
            return self.clone()

    stream = torch.cpu.Stream
    added = not hasattr(stream, "synchronize")
    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign]
    if added:
        stream.synchronize = lambda self: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.Tensor.pin_memory = original  # type: ignore[method-assign]
        if added:
            del stream.synchronize  # type: ignore[attr-defined]


# -- the simulation: which side each storage is on ------------------------------------------------------------------


def offloaded_workload(base: type) -> Any:
    """A subclass of a sharded workload class (:func:`ledgerspec.derivations.shard.fsdp.workload.sharded_workload` or
    ``fsdp1_workload``) that runs with CPU offload and tells ``split`` (a split tracker, set before the protocol
    runs) which storages are the host's: the sharded parameters as they are created (FSDP2's padded shards; under
    FSDP1 everything the load creates before the wrapped model moves its buffers to the device), the rest follows
    from :func:`pinning_as_copies` (FSDP1's pinned shard and gradient) and from the gradient hook (FSDP2)."""

    class Offloaded(base):
        cpu_offload = True
        split: Any = None

        def _materialise_shards(self, device: Any, adapters: bool) -> None:  # FSDP2
            with self.split.hosting():
                super()._materialise_shards(device, adapters)

        def materialise_base(self, device: Any) -> None:
            if not hasattr(base, "_wrap"):  # FSDP2: the shards only (above)
                super().materialise_base(device)
                return
            if self.load_per_unit:  # the device's stream: each unit made on the device as FSDP1 wraps it
                with fsdp1_shards_to_the_host(self.split):
                    super().materialise_base(device)
            else:
                with self.split.hosting():  # FSDP1: the model is built and flattened on the host
                    super().materialise_base(device)
            for b in self.model.buffers():  # FSDP1 moves the buffers to the compute device
                self.split.to_side(b, host=False)

    Offloaded.__name__ = Offloaded.__qualname__ = f"Offloaded{base.__name__}"
    return Offloaded


@contextlib.contextmanager
def fsdp1_shards_to_the_host(tracker: Any) -> Iterator[None]:
    """FSDP1 wrapping with ``CPUOffload(offload_params=True)`` and a ``device_id``, as a GPU run does it unit by unit
    (torch 2.13 ``_init_utils.py``): the unit's parameters are moved or materialised on the device
    (``_move_module_to_device`` / ``param_init_fn``), broadcast with ``sync_module_states``, flattened and sharded
    there (``FlatParamHandle.shard``: a new sharded flat parameter, the unsharded storage freed), and only then
    ``_init_param_handle_from_params`` moves the shard to the host (``handle.flat_param_to(cpu_device)`` when the
    flat parameter is not on the CPU). On the CPU that move is skipped (the devices are equal); here the shard is put
    on the host side of ``tracker`` right after ``shard()``, so the device's stream frees it there, as the move
    does. The wrapping's device memory is one unit's at a time, as without offload."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    shard = FlatParamHandle.shard

    def shard_to_host(self: Any) -> None:
        shard(self)
        if self._offload_params:
            tracker.to_side(self.flat_param, host=True)

    with patched((FlatParamHandle, "shard", shard_to_host)):
        yield


@contextlib.contextmanager
def fsdp1_host_gradients(tracker: Any) -> Iterator[None]:
    """FSDP1's host gradient buffer, made on the host: torch 2.13 ``FlatParamHandle.init_flat_param_attributes``
    allocates it as ``torch.zeros_like(flat_param._local_shard, device=cpu_device).pin_memory()``; the pinned copy is
    the host's already (:func:`pinning_as_copies`), and so is the zeroed tensor before it (host memory on a GPU run,
    not a device allocation). Wrapped for the simulation only: inside that method, ``torch.zeros_like(...,
    device=<cpu>)`` runs under ``tracker.hosting()``."""
    import torch
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    init = FlatParamHandle.init_flat_param_attributes
    zeros_like = torch.zeros_like

    def host_zeros_like(*args: Any, **kwargs: Any) -> Any:
        if torch.device(kwargs.get("device") or "meta").type == "cpu":
            with tracker.hosting():
                return zeros_like(*args, **kwargs)
        return zeros_like(*args, **kwargs)

    def init_flat_param_attributes(self: Any) -> None:
        if not self._offload_params:
            return init(self)
        with patched((torch, "zeros_like", host_zeros_like)):
            return init(self)

    with patched((FlatParamHandle, "init_flat_param_attributes", init_flat_param_attributes)):
        yield


@contextlib.contextmanager
def hosting_resharded_params(tracker: Any) -> Iterator[None]:
    """FSDP2's lazy init re-pads a shard with fewer rows than the padded size (``FSDPParam.reset_sharded_param``:
    ``local_tensor.new_zeros(padded_sharded_size)``, torch 2.13 ``_fsdp_param.py``): with offload that new storage is
    on the host, where the shard is. Wrapped for the simulation only."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    original = FSDPParam.reset_sharded_param

    def reset_sharded_param(self: Any) -> Any:
        with tracker.hosting() if self.offload_to_cpu else contextlib.nullcontext():
            return original(self)

    FSDPParam.reset_sharded_param = reset_sharded_param  # type: ignore[method-assign]
    try:
        yield
    finally:
        FSDPParam.reset_sharded_param = original  # type: ignore[method-assign]


# -- the calculation: each rank's two sides and the traffic of a micro-step -----------------------------------------


@dataclass(frozen=True)
class OffloadRank:
    """One rank under CPU offload, calculated from the sharded state (bytes; no activations, no temporaries)."""

    rank: int
    host: int  # sharded parameters (frozen and trainable), gradient shards, optimizer state
    device: int  # the model's buffers and the gathered units at the compute peak
    staging: int  # the largest unit's shards copied to the device before its all-gather (transient)
    to_device: int  # host -> device per micro-step: every unit's shards at each all-gather
    to_host: int  # device -> host per micro-step: the gradient shards after each reduce-scatter


def calculated(plan: Any, descs: list[Any]) -> list[OffloadRank]:
    """Each rank of ``plan`` (:class:`ledgerspec.derivations.shard.state.Fsdp2Plan` or ``Fsdp1Plan``) with offload.

    Forward all-gathers every unit once; backward all-gathers again every unit that was resharded after forward
    (all but the root, which FSDP keeps gathered, with ``reshard_after_forward`` true or FSDP2's default; none with
    false / ``SHARD_GRAD_OP``). FSDP2's gradient copies are the unpadded shards (``sharded_size``), counted here padded.
    """
    from ledgerspec.derivations.shard import state as S

    buffers = sum(p.nbytes for p in descs if p.kind == "buffer")
    out = []
    for rs in plan.ranks:
        shards: dict[str, int] = {}
        if isinstance(plan, S.Fsdp1Plan):
            for name, u in plan.units.items():
                shards[name] = u.shard_numel * u.itemsize
        else:
            for p in descs:
                if p.kind == "param":
                    shard = S.param_shard(p, plan.world_size, rs.rank)
                    shards[p.unit] = shards.get(p.unit, 0) + shard.storage
        regathered = sum(v for k, v in shards.items() if k != S.ROOT) if plan.reshard_after_forward is not False else 0
        out.append(
            OffloadRank(
                rs.rank,
                host=rs.frozen_base - buffers + rs.adapter + rs.gradients + rs.optimizer + rs.optimizer_host,
                device=buffers + rs.gathered,
                staging=max(shards.values(), default=0),
                to_device=sum(shards.values()) + regathered,
                to_host=rs.gradients,
            )
        )
    return out


#: how the simulated phases are split (the estimate's method text)
OFFLOAD_METHOD = (
    "phases are the device's: each tensor on its side by its role (host: the sharded parameters, their gradient "
    "shards, the optimizer state and everything the optimizer step allocates; device: the rest), host_peak the most "
    "the host side held; the device copy of a unit's shards before its all-gather (staging) is made on the cuda "
    "target"
)


def describe(strategy: str) -> str:
    """What the declared offload is, in the words of the library that runs it."""
    if strategy == "fsdp1":
        return "FSDP1 CPUOffload(offload_params=True)"
    return "FSDP2 fully_shard(offload_policy=CPUOffloadPolicy())"


def extension(plan: Any, descs: list[Any], strategy: str, where: str) -> dict[str, Any]:
    """The ``cpu_offload`` block of ``parallelism.x-per-rank``: per rank, what moves to the host and what comes back."""

    def fig(value: int, method: str) -> dict[str, Any]:
        return {"value": value, "source": "CALCULATED", "method": method}

    ranks = []
    for r in calculated(plan, descs):
        ranks.append(
            {
                "rank": r.rank,
                "host": fig(r.host, "sharded parameters + gradient shards + optimizer state, moved to the host"),
                "device": fig(r.device, "buffers + gathered units at the compute peak (no activations, temporaries)"),
                "staging": fig(r.staging, "the largest unit's shards copied to the device before its all-gather"),
                "to_device_per_micro_step": fig(
                    r.to_device, "host -> device: every unit's shards in forward, again in backward when resharded"
                ),
                "to_host_per_micro_step": fig(r.to_host, "device -> host: the gradient shards after reduce-scatter"),
            }
        )
    return {
        "policy": describe(strategy),
        "declared_at": where,
        "moves": "the sharded parameters, their gradients and the optimizer state (and its step) live on the host; "
        "the device holds the gathered units while they compute, the unsharded gradients until reduce-scatter, "
        "activations and temporaries",
        "ranks": ranks,
        "zero": "DeepSpeed ZeRO offload (offload_optimizer / offload_param) is not this: the zero*_offload rows",
    }


@contextlib.contextmanager
def staging_on_the_device() -> Iterator[None]:
    """FSDP2's host -> device copy of the shards before each all-gather, as a GPU run makes it (cuda target).

    With the CPU as the compute device ``.to(self.device)`` returns the host tensor itself, so the all-gather reads
    the host shard directly. On a GPU ``FSDPParam.all_gather_inputs`` returns ``sharded_param_data.to(self.device)``,
    a device copy alive until the group's copy-in into the all-gather buffer is done (``foreach_all_gather``:
    ``del param_all_gather_inputs``). Here that copy is made (a clone outside the host context: device memory)
    whenever the all-gather would read the host shard. With a ``param_dtype`` the cast is that copy already (the copy
    in the original dtype before it is not made). FSDP1's copy: :func:`fsdp1_staging_on_the_device`.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    inputs = FSDPParam.all_gather_inputs

    def all_gather_inputs(self: Any) -> Any:
        out = inputs.fget(self)  # type: ignore[attr-defined]
        if (
            self.offload_to_cpu
            and out
            and out[0].untyped_storage()._cdata == self._sharded_param_data.untyped_storage()._cdata
        ):
            return [t.clone() for t in out]
        return out

    FSDPParam.all_gather_inputs = property(all_gather_inputs)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        FSDPParam.all_gather_inputs = inputs  # type: ignore[method-assign]


@contextlib.contextmanager
def fsdp1_staging_on_the_device() -> Iterator[None]:
    """FSDP1's host -> device copy of a unit's shard before its all-gather, as a GPU run makes it (cuda target).

    torch 2.13 ``_flat_param.py``: ``FlatParamHandle.pre_unshard`` with ``CPUOffload(offload_params=True)`` calls
    ``flat_param_to(self.device, non_blocking=True)`` ("This creates a new tensor distinct from any attributes"): the
    flat parameter's data becomes a device copy of the host shard, which the all-gather reads and which is dropped
    when ``unshard`` points the flat parameter at the unsharded buffer. With a mixed-precision ``param_dtype``,
    ``_use_low_precision_shard`` allocates ``_mp_shard`` and copies ``_local_shard.to(self.device)`` into it: a
    full-precision device copy alive for that ``copy_``. With the CPU as the compute device ``.to(self.device)``
    returns the host tensor itself (and ``pre_unshard`` skips ``flat_param_to``: the devices are equal), so neither
    copy exists; here each is made (a clone outside the host context: device memory) where the GPU makes it.
    """
    import torch.distributed.fsdp._flat_param as F
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    pre_unshard = FlatParamHandle.pre_unshard
    use_low_precision_shard = FlatParamHandle._use_low_precision_shard

    def staged_low_precision_shard(self: Any) -> None:  # torch 2.13's, the device copy made
        if not self._offload_params:
            return use_low_precision_shard(self)
        self._check_low_precision_shard()
        flat_param = self.flat_param
        F._alloc_storage(flat_param._mp_shard, flat_param._local_shard.size())
        staged = flat_param._local_shard.clone()  # `_local_shard.to(self.device, non_blocking=True)` on a GPU
        flat_param._mp_shard.copy_(staged)
        del staged
        flat_param.data = flat_param._mp_shard
        return None

    def staged_pre_unshard(self: Any) -> bool:
        ret = pre_unshard(self)
        flat_param = self.flat_param
        low_precision = self._uses_param_mixed_precision and not self._force_full_precision
        # sharded, the flat parameter is on the host on a GPU (its first shard or `_local_shard`); unsharded (the
        # root kept gathered into backward) it is on the device and no copy is made
        if self._offload_params and not low_precision and self.is_sharded(flat_param):
            # the `flat_param_to(self.device)` branch, as a GPU takes it
            flat_param.data = flat_param.clone()
            if self._use_orig_params:
                self._use_sharded_views()
            ret = True
        return bool(ret)

    with patched(
        (FlatParamHandle, "pre_unshard", staged_pre_unshard),
        (FlatParamHandle, "_use_low_precision_shard", staged_low_precision_shard),
    ):
        yield


@contextlib.contextmanager
def waiting_for_gradient_copies(tracker: Any) -> Iterator[None]:
    """FSDP1's wait for its device -> host gradient copies at the end of backward, in a rank's event log.

    torch 2.13 ``_runtime_utils._post_backward_final_callback``: with ``offload_params`` the host calls
    ``current_stream().synchronize()`` ("CPU gradients do not automatically synchronize with the GPU"), so every
    pending free has completed there (``tracker.sync(0)``). Entered inside :func:`pinning_as_copies`, whose no-op
    ``synchronize`` of the CPU stream it replaces (and puts back on exit).
    """
    import torch

    def synchronize(self: Any) -> None:
        tracker.sync(0)

    with patched((torch.cpu.Stream, "synchronize", synchronize)):
        yield
