"""cuBLAS workspaces in a step's allocation stream: caching-allocator blocks that no tensor tracker sees.

PyTorch gives each cuBLAS handle a workspace per stream the first time the handle runs there
(``at::cuda::getCurrentCUDABlasHandle``: ``cublas_handle_stream_to_workspace``, a ``DataPtr`` from
``c10::cuda::CUDACachingAllocator``, ``CUBLAS_WORKSPACE_CONFIG`` bytes), and keeps it until the process ends: it is
in ``memory_allocated`` and ``memory_reserved``, never outside the allocator. Handles are per thread: the Python
thread's (forward, loss, optimizer) and the autograd engine's device thread's (backward) each get one. The estimate's
tensor tracking does not see them (they are no tensors), so the replay adds them: the Python thread's at the start of
the first micro-step (its first window: the forward, or a generation), the autograd thread's at the start of the first
loss-and-backward window, each on the compute stream (0) and left out of the ``counted`` figures. Their sizes are the
outside-allocator catalogue's (``devices/outside.yaml``, ``cublas``: 8 MiB + 128 KiB per handle on most GPUs,
32 MiB on compute capability 9.x and later; :func:`ledgerspec.derivations.devices.outside.cublas_workspaces`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ledgerspec.derivations.allocator.replay import Event

#: the id of the ``i``-th workspace in the stream (a tuple: never one of the tracker's integer ids)
WORKSPACE = "cublas-workspace"


def with_workspaces(
    events: Sequence[Event], windows: Sequence[str], python: Sequence[int], autograd: Sequence[int]
) -> list[Event]:
    """``events`` with the Python thread's workspaces (``python``, bytes each) allocated after the marker of the first
    micro-step's first window and the autograd thread's (``autograd``) after the marker of the first loss-and-backward
    window (``N:temporary`` after ``N-1:activations``); never freed. ``windows``: the stream's window labels in order
    (:class:`~ledgerspec.derivations.allocator.step.StepEvents`). A stream without such windows is returned as it is."""
    contexts = [w.split(":", 1)[1] if ":" in w else w for w in windows]
    first = windows[3] if len(windows) > 3 else None
    backward = next(
        (windows[i] for i in range(1, len(windows)) if contexts[i] == "temporary" and contexts[i - 1] == "activations"),
        None,
    )
    at = {first: tuple(python), backward: tuple(autograd)} if first != backward else {first: (*python, *autograd)}
    out: list[Event] = []
    serial = 0
    for event in events:
        out.append(event)
        if event[0] == "phase" and event[1] in at:
            for size in at.pop(event[1]):
                out.append(("alloc", (WORKSPACE, serial), int(size), 0, False))
                serial += 1
    return out


__all__ = ["WORKSPACE", "with_workspaces"]
