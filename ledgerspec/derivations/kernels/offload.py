"""Activation offloading (``memory_options.activation_offload``): saved activations moved to host memory.

TRL's ``OffloadActivations`` (trl 1.16, ``models/activation_offloading.py``), which ``SFTTrainer``
(``activation_offloading: true``) and axolotl (``activation_offloading``, ``gradient_checkpointing: offload``) wrap
each training step in, is a ``saved_tensors_hooks`` pair. :class:`Offload` is the same pair for the simulated step,
with the host copies counted as host bytes (they are not device memory) instead of allocated:

- pack (``pack_tensor``, :200-340): a saved tensor stays on the device when it is under 1,024 bytes, a parameter, a
  parameter's storage (``update_model_params``), or a storage already offloaded and still in the forward window;
  else a non-contiguous one is made contiguous (a view with an offset cloned) on the device, its bytes go to the
  host, and (streams mode, the default) the device tensor stays referenced until five newer tensors were packed
  (``max_fwd_stash_size``), so the copy can finish;
- unpack (``unpack_tensor_with_streams``, :385-530): a tensor still in the forward window is used as it is; any
  other is copied back to a new device tensor, kept until the next autograd node starts unpacking (the previous
  node's copies are released then); the host copy is released; at the end of backward what is left goes.

Tensors saved inside ``lm_head`` are not offloaded (TRL's ``NoOpManager`` on the output layer).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

#: ``min_offload_size`` and ``max_fwd_stash_size`` (TRL's defaults, :124-169)
MIN_OFFLOAD_BYTES = 1024
MAX_FWD_STASH = 5


class Offload:
    """The saved-tensor hooks of one micro-step (forward and backward), and the host bytes they hold."""

    def __init__(self, model: Any) -> None:
        from ledgerspec.derivations.engine.tracker import storage_key

        self.key = storage_key
        self.model = model
        self.params: set[int] = set()
        self.host_current = 0
        self.host_peak = 0
        self._next = 0
        self._packed: dict[int, tuple[Any, ...]] = {}  # id -> ("device", tensor) | ("host", shape, stride, dtype, n)
        self._fwd: OrderedDict[int, Any] = OrderedDict()  # id -> device tensor kept while its copy runs
        self._fwd_storage: dict[int, int] = {}  # storage key -> id, while in the forward window
        self._bwd: dict[int, Any] = {}
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
        self.params = {self.key(p) for p in self.model.parameters()} | {self.key(b) for b in self.model.buffers()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self.finish()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def pack(self, t: Any) -> Any:
        import torch

        tid = self._next
        self._next += 1
        key = self.key(t)
        nbytes = t.numel() * t.element_size()
        keep = (
            self._paused > 0
            or key in self._fwd_storage
            or nbytes < MIN_OFFLOAD_BYTES
            or isinstance(t, torch.nn.Parameter)
            or key in self.params
        )
        if keep:
            self._packed[tid] = ("device", t)
            return tid
        if 0 not in t.stride() and (not t.is_contiguous() or t.storage_offset() != 0):
            t = t.clone(memory_format=torch.contiguous_format) if t.storage_offset() != 0 else t.contiguous()
        for old in [i for i in self._fwd if i <= tid - MAX_FWD_STASH]:  # copies done long enough ago
            self._release_fwd(old)
        host = t.untyped_storage().nbytes() if 0 in t.stride() else t.numel() * t.element_size()
        self._packed[tid] = ("host", t.size(), t.stride(), t.dtype, host)
        self.host_current += host
        self.host_peak = max(self.host_peak, self.host_current)
        self._fwd[tid] = t
        self._fwd_storage[self.key(t)] = tid
        return tid

    def _release_fwd(self, tid: int) -> None:
        t = self._fwd.pop(tid, None)
        if t is not None:
            self._fwd_storage = {k: v for k, v in self._fwd_storage.items() if v != tid}

    def unpack(self, tid: int) -> Any:
        import torch

        entry = self._packed.pop(tid)
        if entry[0] == "device":
            return entry[1]
        _, shape, stride, dtype, host = entry
        node = torch._C._current_autograd_node()
        if node is not self._node:  # a new node: the previous node's copies can go
            self._node = node
            self._bwd.clear()
        self.host_current -= host
        if tid in self._fwd:  # still on the device: no copy back
            t = self._fwd[tid]
        else:
            t = torch.empty_strided(shape, stride, dtype=dtype)
            self._bwd[tid] = t
        for old in list(self._fwd):  # in backward now: the forward window is released after this node
            if old != tid:
                self._release_fwd(old)
        self._release_fwd(tid)
        return t

    def finish(self) -> None:
        """The end of backward (``wait_and_del_remaining_references``): what is left is released."""
        for entry in self._packed.values():  # saved but never unpacked: its host copy goes with the graph
            if entry[0] == "host":
                self.host_current -= entry[4]
        self._packed.clear()
        self._fwd.clear()
        self._fwd_storage.clear()
        self._bwd.clear()
        self._node = None


__all__ = ["MAX_FWD_STASH", "MIN_OFFLOAD_BYTES", "Offload"]
