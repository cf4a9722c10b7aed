"""cuBLAS workspaces in the replayed stream: blocks of the caching allocator that no tensor tracker sees.

PyTorch allocates each cuBLAS handle's workspace from ``c10::cuda::CUDACachingAllocator`` the first time the handle
runs on a stream and keeps it (``cublas_handle_stream_to_workspace`` in ``aten/src/ATen/cuda/CublasHandlePool.cpp``):
pytorch/pytorch#95668 saw 8,519,680 B of it in ``torch.cuda.memory_allocated`` after one matmul (the default
``CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8``: 2 x 4 MiB + 8 x 16 KiB). The Python thread's handle and the autograd
engine's device thread's each get one.
"""

from __future__ import annotations

from ledgerspec.derivations.allocator.replay import replay
from ledgerspec.derivations.allocator.workspaces import with_workspaces

MiB = 2**20
EACH = 8_519_680  # pytorch/pytorch#95668
WINDOWS = ["0:frozen_params", "1:adapter", "2:optimizer", "3:activations", "4:temporary", "5:optimizer"]


def _stream() -> list[tuple]:
    """A small step: every tensor under 1 MiB (the small pool), so the workspaces (large-pool requests) find no
    cached block of their size and their blocks are easy to tell apart."""
    events: list[tuple] = []
    for n, label in enumerate(WINDOWS):
        events.append(("phase", label))
        events.append(("alloc", n, 4096, 0))
        if n >= 3:
            events.append(("free", n))
    return events


def test_each_handle_s_workspace_is_allocated_where_its_thread_first_runs_and_kept() -> None:
    events = with_workspaces(_stream(), WINDOWS, (EACH,), (EACH,))
    added = [(i, e) for i, e in enumerate(events) if len(e) > 4]
    assert [e[2] for _, e in added] == [EACH, EACH] and all(e[3] == 0 and e[4] is False for _, e in added)
    # right after the first forward window's marker, and the first loss-and-backward window's
    assert [events[i - 1] for i, _ in added] == [("phase", "3:activations"), ("phase", "4:temporary")]
    assert not [e for e in events if e[0] == "free" and e[1] in {a[1] for _, a in added}]  # never freed


def test_the_replay_holds_them_outside_the_counted_figures() -> None:
    plain = replay(_stream())
    with_ws = replay(with_workspaces(_stream(), WINDOWS, (EACH,), (EACH,)))
    for label, held in zip(WINDOWS[3:], (1, 2, 2), strict=True):  # the autograd thread's from the backward on
        a, b = plain.phases[label], with_ws.phases[label]
        assert b.peak_counted == a.peak_counted  # the tracker's count: no tensor
        assert b.end_allocated - a.end_allocated == held * EACH, label
    # the first is cut from a new 20 MiB segment (requests of 1 to 10 MiB: kLargeBuffer); the second fits in what
    # that segment has left (20 MiB - 8,519,680 B), so both take one segment
    assert with_ws.peak_reserved - plain.peak_reserved == 20 * MiB


def test_a_stream_without_those_windows_is_left_as_it_is() -> None:
    events = [("alloc", 1, 4096, 0), ("free", 1)]
    assert with_workspaces(events, [], (EACH,), (EACH,)) == events
