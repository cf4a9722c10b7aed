"""Activation offloading (``memory_options.activation_offload``): saved activations moved to host memory.

TRL's ``OffloadActivations`` (trl 1.16, ``models/activation_offloading.py``), which ``SFTTrainer``
(``activation_offloading: true``) and axolotl (``activation_offloading``, ``gradient_checkpointing: offload``) wrap
each training step in, is a ``saved_tensors_hooks`` pair. :class:`Offload` is the same pair for the simulated step,
with the host copies counted as host bytes (they are not device memory) instead of allocated:

- pack (``pack_tensor``, :200-340): a saved tensor stays on the device when it is under 1,024 bytes, a parameter, a
  parameter's storage (``update_model_params``; TRL's manager only), or the same (storage, offset, dtype) as a
  tensor still tracked (then it is tracked again); else a non-contiguous one is made contiguous (a view with an
  offset cloned) on the device, its bytes go to the host, and (streams mode, the default) the device tensor stays
  referenced until the pack counter moved five further (``max_fwd_stash_size``), so the copy can finish;
- unpack (``unpack_tensor_with_streams``, :385-530): a tensor still in the forward window is used as it is; any
  other is copied back to a new device tensor; once the autograd node that unpacked it has run (its post-hook), the
  forward window and the previous node's copies are released; the host copy is released; at the end of backward
  what is left goes.

Tensors saved inside ``lm_head`` are not offloaded (TRL's ``NoOpManager`` on the output layer).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

#: ``min_offload_size`` and ``max_fwd_stash_size`` (TRL's defaults, :124-169)
MIN_OFFLOAD_BYTES = 1024
MAX_FWD_STASH = 5


class Offload:
    """The saved-tensor hooks of one micro-step (forward and backward), and the host bytes they hold.

    ``param_storages``: TRL's ``get_act_offloading_ctx_manager`` calls ``update_model_params`` (tensors sharing a
    parameter's storage stay on the device); axolotl's LoRA variant does not (only ``nn.Parameter`` instances stay).
    """

    def __init__(self, model: Any, param_storages: bool = True) -> None:
        from ledgerspec.derivations.engine.tracker import storage_key

        self.storage = storage_key
        self.model = model
        self.param_storages = param_storages
        self.params: set[int] = set()
        self.host_current = 0
        self.host_peak = 0
        self._next = 0
        self._packed: dict[int, tuple[Any, ...]] = {}  # id -> ("device", tensor) | ("host", shape, stride, dtype, n)
        self._fwd: OrderedDict[int, Any] = OrderedDict()  # id -> device tensor kept while its copy runs
        self._key_to_id: dict[tuple[Any, ...], int] = {}  # storage_to_tensor_id
        self._id_to_key: dict[int, tuple[Any, ...]] = {}  # _storage_key_by_tensor_id
        self._bwd: dict[int, Any] = {}  # copied back, kept until the next node's hook
        self._node: Any = None
        self._paused = 0
        self._hooks: Any = None
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self._handles = []
        if head is not None:
            self._handles.append(head.register_forward_pre_hook(lambda *a: self._pause(1)))
            self._handles.append(head.register_forward_hook(lambda *a: self._pause(-1)))

    def _pause(self, by: int) -> None:
        self._paused += by

    def __enter__(self) -> Offload:
        import torch

        # the parameters' storages as they are now (``update_model_params``): the model is materialised by now
        self.params = {self.storage(p) for p in self.model.parameters()} if self.param_storages else set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self.finish()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _key(self, t: Any) -> tuple[Any, ...]:
        """``_get_unique_tensor_key`` (:53-80): the storage, the offset into it and the dtype."""
        return (self.storage(t), t.storage_offset(), t.dtype)

    def _track(self, key: tuple[Any, ...], tid: int) -> None:
        self._key_to_id[key] = tid
        self._id_to_key[tid] = key

    def _untrack(self, tid: int) -> None:
        key = self._id_to_key.pop(tid, None)
        if key is not None and self._key_to_id.get(key) == tid:
            del self._key_to_id[key]

    def pack(self, t: Any) -> Any:
        import torch

        tid = self._next
        self._next += 1
        key = self._key(t)
        if key in self._key_to_id:  # already offloaded and tracked: kept on the device, tracked again (:218-223)
            self._packed[tid] = ("device", t)
            self._track(key, tid)
            return tid
        keep = (
            self._paused > 0
            or t.numel() * t.element_size() < MIN_OFFLOAD_BYTES
            or isinstance(t, torch.nn.Parameter)
            or self.storage(t) in self.params
        )
        if keep:
            self._packed[tid] = ("device", t)
            return tid
        broadcast = 0 in t.stride()
        if not broadcast and (not t.is_contiguous() or t.storage_offset() != 0):
            t = t.clone(memory_format=torch.contiguous_format) if t.storage_offset() != 0 else t.contiguous()
        for old in [i for i in self._fwd if i <= tid - MAX_FWD_STASH]:  # copies done long enough ago (:280-290)
            self._fwd.pop(old)
            self._untrack(old)
        host = t.untyped_storage().nbytes() if broadcast else t.numel() * t.element_size()
        self._packed[tid] = ("host", t.size(), t.stride(), t.dtype, host)
        self.host_current += host
        self.host_peak = max(self.host_peak, self.host_current)
        self._fwd[tid] = t
        self._track(key, tid)
        return tid

    def unpack(self, tid: int) -> Any:
        import torch

        entry = self._packed.pop(tid)
        if entry[0] == "device":
            self._untrack(tid)
            return entry[1]
        _, shape, stride, dtype, host = entry
        node = torch._C._current_autograd_node()
        previous: list[int] = []
        if node is not self._node:  # a new node: the previous node's copies go once this node has run
            self._node = node
            previous = list(self._bwd)
        self.host_current -= host
        if tid in self._fwd:  # still on the device: no copy back
            t = self._fwd[tid]
        else:
            t = torch.empty_strided(shape, stride, dtype=dtype)
            self._bwd[tid] = t

        def after(outputs: Any, inputs: Any) -> Any:  # the node's post-hook (:470-524)
            for old in list(self._fwd):  # in backward now: the forward window is released
                self._fwd.pop(old)
                self._untrack(old)
            for old in previous:
                self._bwd.pop(old, None)
            return outputs

        if node is not None:
            node.register_hook(after)
        self._untrack(tid)
        return t

    def finish(self) -> None:
        """The end of backward (``wait_and_del_remaining_references``): what is left is released."""
        for entry in self._packed.values():  # saved but never unpacked: its host copy goes with the graph
            if entry[0] == "host":
                self.host_current -= entry[4]
        self._packed.clear()
        self._fwd.clear()
        self._key_to_id.clear()
        self._id_to_key.clear()
        self._bwd.clear()
        self._node = None


__all__ = ["MAX_FWD_STASH", "MIN_OFFLOAD_BYTES", "Offload"]
