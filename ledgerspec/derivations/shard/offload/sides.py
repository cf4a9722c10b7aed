"""Which side of the PCIe bus each storage is on, in a simulated step under CPU offload (FSDP's and ZeRO's).

On a CPU-only run both sides are host memory, so the simulation keeps them apart itself: :func:`split_tracker_class`
counts every storage once, as the base tracker does, and keeps the host's bytes apart (a storage is the host's when
it was allocated while :meth:`hosting` was on, or was moved there); :func:`recording_sides` records each phase's
``(device, host)`` while the protocol runs. Which storages are the host's is each strategy's own rule set:
:mod:`.fsdp` (by role: shards, their gradients, the optimizer) and :mod:`.zero` (where DeepSpeed names the host).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

#: the protocol's phases and the per-window keys the split is kept under
HELD = ("after_load", "after_adapter_injection", "after_optimizer_init")


def split_tracker_class() -> type:
    """:class:`ledgerspec.derivations.engine.tracker.MemoryTracker` that also keeps the host's bytes apart.

    With ``events=True`` its event log is the device's allocation stream only (what the caching allocator sees): a
    host storage logs nothing, a storage moved to the host logs its device buffer's free, one moved to the device
    an allocation.

    A storage is on the host when it was allocated while :meth:`hosting` is on (or in the optimizer step: the
    optimizer steps the host shards), or was moved there by :meth:`to_host`; everything else is on the device. The
    total (``current``, ``peak``) is what the base tracker counts; ``host_current`` is its host part, and each
    window (between ``reset_peak`` calls) keeps the device's and the host's own peaks.
    """
    from ledgerspec.derivations.engine.tracker import MemoryTracker, local_tensor

    class SplitTracker(MemoryTracker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.host_keys: set[int] = set()
            self.host_current = 0
            self.host_window = 0
            self.device_window = 0
            self.host_max = 0  # over the whole run, never reset: the rank's host_peak
            self.grads_to_host = True  # FSDP2: the sharded gradient is copied to the host at reduce-scatter
            self._hosting = 0
            self._side_host = False

        @contextlib.contextmanager
        def hosting(self) -> Iterator[None]:
            self._hosting += 1
            try:
                yield
            finally:
                self._hosting -= 1

        def _host_now(self) -> bool:
            return self._hosting > 0 or self.context == "optimizer"

        def _register(self, t: Any) -> None:
            lt = local_tensor(t)
            if lt.device.type == "meta":
                return
            key = int(lt.untyped_storage()._cdata)
            if key not in self._live and self._host_now():
                self.host_keys.add(key)
            self._side_host = key in self.host_keys
            try:
                super()._register(t)
            finally:
                self._side_host = False

        def _resized(self, storage: Any) -> None:
            self._side_host = int(storage._cdata) in self.host_keys
            try:
                super()._resized(storage)
            finally:
                self._side_host = False

        def _release(self, key: int) -> None:
            self._side_host = key in self.host_keys
            try:
                super()._release(key)
            finally:
                self._side_host = False
                self.host_keys.discard(key)

        def _add(self, category: str, nbytes: int) -> None:
            super()._add(category, nbytes)
            if self._side_host:
                self.host_current += nbytes

        def _check_peak(self) -> None:
            super()._check_peak()
            self.host_window = max(self.host_window, self.host_current)
            self.host_max = max(self.host_max, self.host_current)
            self.device_window = max(self.device_window, self.current - self.host_current)

        def reset_peak(self) -> None:
            super().reset_peak()
            self.host_window = self.host_current
            self.device_window = self.current - self.host_current

        def to_side(self, tensor: Any, host: bool) -> None:
            """Put one live tensor's storage on the host (``host``) or on the device; in the event log (the
            device's allocation stream) its device buffer is freed, or allocated."""
            storage = local_tensor(tensor).untyped_storage()
            key = int(storage._cdata)
            entry = self._live.get(key)
            if entry is None or (key in self.host_keys) == host:
                return
            if host:
                self.host_keys.add(key)
                self.host_current += entry.nbytes
                if self.events is not None:
                    self._log_free(key)
            else:
                self.host_keys.discard(key)
                self.host_current -= entry.nbytes
                if self.events is not None:
                    self._log_alloc(key, int(storage.nbytes()))
            self._check_peak()

        # -- the event log (``events=True``): the device's allocation stream, host memory left out ----------------
        def _log_alloc(self, key: int, nbytes: int) -> None:
            if key not in self.host_keys:
                super()._log_alloc(key, nbytes)

        def _log_resize(self, key: int, nbytes: int) -> None:
            if key not in self.host_keys:
                super()._log_resize(key, nbytes)

        def _on_grad(self, p: Any) -> None:
            super()._on_grad(p)
            if self.grads_to_host and p.grad is not None:
                self.to_side(p.grad, host=True)

    return SplitTracker


def split_backend(granularity: int = 1, fake: bool = True) -> Any:
    """A :class:`ledgerspec.derivations.engine.backends.TrackerBackend` counting with a split tracker."""
    from ledgerspec.derivations.engine.backends import TrackerBackend

    backend = TrackerBackend(fake=fake, granularity=granularity)
    backend.tracker = split_tracker_class()(granularity=granularity)
    backend.sides = {}  # type: ignore[attr-defined]
    return backend


@contextlib.contextmanager
def recording_sides(backend: Any) -> Iterator[dict[str, tuple[int, int]]]:
    """While the protocol runs with ``backend``: ``{phase: (device, host)}`` of every phase.

    A held phase (``after_*``) takes what each side holds at its end, as the protocol's figure does; the others
    take each side's peak in the phase (the forward and backward peaks over the micro-steps of the first step, the
    steady state over the repeated steps). Wraps ``ProtocolRun.record`` and ``ProtocolRun._keep`` for that run only.
    """
    from ledgerspec.derivations.engine import protocol as P

    sides: dict[str, tuple[int, int]] = {}
    tracker = backend.tracker
    record, keep = P.ProtocolRun.record, P.ProtocolRun._keep

    def now() -> tuple[int, int]:
        return tracker.current - tracker.host_current, tracker.host_current

    def window() -> tuple[int, int]:
        return tracker.device_window, tracker.host_window

    def most(key: str, value: tuple[int, int]) -> None:
        old = sides.get(key, (0, 0))
        sides[key] = (max(old[0], value[0]), max(old[1], value[1]))

    def record_sides(self: Any, name: str, t0: float, held_figure: bool) -> Any:
        if self.backend is backend:
            sides[name] = now() if held_figure else window()
        return record(self, name, t0, held_figure)

    def keep_sides(self: Any, peaks: Any, cats: Any, extra: Any, key: str) -> None:
        if self.backend is backend:
            if self.later:
                most("steady_state_peak", window())
            else:
                most(f"{key}_peak", window())
        keep(self, peaks, cats, extra, key)

    P.ProtocolRun.record = record_sides  # type: ignore[method-assign]
    P.ProtocolRun._keep = keep_sides  # type: ignore[method-assign]
    try:
        yield sides
    finally:
        P.ProtocolRun.record = record  # type: ignore[method-assign]
        P.ProtocolRun._keep = keep  # type: ignore[method-assign]


__all__ = ["recording_sides", "split_backend", "split_tracker_class"]
