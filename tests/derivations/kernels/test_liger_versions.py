"""The liger-kernel release a ledger declares (``software.kernels.packages``) selects the allocations of that release.

Expected figures are shapes x bytes read from the cited sources (linkedin/Liger-Kernel at the release tags, the
0.8.3-0.8.5 wheels), not from the models: each case counts what the release's function allocates, in bytes (the
tracker at granularity 1), during forward (fused linear cross-entropy) or backward (RMSNorm), from the state before.
"""

from __future__ import annotations

from typing import Any

import pytest

from ledgerspec.contract.config import Kernels
from ledgerspec.derivations.engine import cuda_reduce
from ledgerspec.derivations.kernels import apply, liger

MiB = 2**20


# -- which release -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("packages", "release"),
    [
        ((), (0, 8, 5)),
        ((("liger-kernel", "0.4.2"),), (0, 4, 2)),
        ((("liger_kernel", "v0.5"),), (0, 5, 0)),
        ((("Liger-Kernel", "0.3.1.dev0"),), (0, 3, 1)),
        ((("liger-kernel", "0.9.1"),), (0, 8, 5)),  # newer than the newest modelled: 0.8.5's
        ((("liger-kernel", "latest"),), (0, 8, 5)),  # no version
        ((("trl", "0.4.2"),), (0, 8, 5)),  # another package
    ],
)
def test_the_declared_release(packages: tuple[tuple[str, str], ...], release: tuple[int, int, int]) -> None:
    assert liger.declared_release(packages) == release


def test_every_change_is_a_release_up_to_the_newest_and_cites_its_source() -> None:
    for change in liger.CHANGES.values():
        assert (0, 0, 1) < change.release <= liger.LATEST
        assert "Liger-Kernel" in change.source or "wheel" in change.source
        assert ":" in change.source  # file:line


def test_the_method_text_names_the_release_and_what_differs() -> None:
    default = Kernels(norm="liger_rms_norm")
    assert (
        apply.method_note(default) == "declared kernels modelled (allocation models of their sources): liger_rms_norm"
    )
    old = Kernels(norm="liger_rms_norm", packages=(("liger-kernel", "0.2.1"),))
    note = apply.method_note(old)
    assert note is not None and "liger-kernel 0.2.1's allocations modelled" in note
    assert "rms_dw_rows" in note and "flce_upcast" in note
    newer = apply.method_note(Kernels(norm="liger_rms_norm", packages=(("liger-kernel", "1.0.0"),)))
    assert newer is not None and "newer than the newest release modelled, 0.8.5" in newer
    # a package version without a Liger kernel declared says nothing of Liger
    assert "liger" not in (
        apply.method_note(Kernels(cross_entropy="cut_cross_entropy", packages=(("liger-kernel", "0.2.1"),))) or ""
    )


# -- the fused linear cross-entropy, per release ------------------------------------------------------------------

BT, H, V = 512, 64, 8192
CHUNK = 4  # next_pow2(ceil(512 / ceil(8192 / 64))) = next_pow2(4), the same rule in every release
LOGITS = CHUNK * V * 2  # one chunk's bf16 logits
GRAD_INPUT = BT * H * 2  # `grad_input = torch.zeros_like(_input)`, kept for backward
LOSS_1D = BT * 4  # `loss_1d = torch.zeros(BT, dtype=torch.float32)`
WEIGHT = V * H * 2  # a (V, H) bf16 tensor: the lm_head's gradient or product


def _flce_forward(release: tuple[int, int, int], trains: bool = False, reduction: str = "sum") -> tuple[int, int]:
    """(forward's peak, what forward leaves) in bytes over the inputs, bf16 input and lm_head, on CUDA."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ledgerspec.derivations.engine.tracker import MemoryTracker

    F = liger.functions()
    with FakeTensorMode():
        tracker = MemoryTracker(granularity=1)
        with tracker:
            weight = torch.nn.Parameter(torch.empty(V, H, dtype=torch.bfloat16), requires_grad=trains)
            x = torch.empty(BT, H, dtype=torch.bfloat16, requires_grad=True)
            target = torch.zeros(BT, dtype=torch.long)
            before = tracker.current
            tracker.reset_peak()
            loss = F.FusedLinearCrossEntropy.apply(x, weight, target, True, None, release, reduction)
            peak, left = tracker.peak - before, tracker.current - before
            del loss
    return peak, left


FLCE_CASES = [
    # 0.8.5 (0.8.3 on): one (chunk, V) buffer reused (wheel :150-154, `torch.mm(..., out=logits_chunk)`)
    ((0, 8, 5), GRAD_INPUT + LOSS_1D + LOGITS),
    ((0, 8, 3), GRAD_INPUT + LOSS_1D + LOGITS),
    # 0.5.3-0.8.2: new logits per chunk (v0.8.2 :114) while the previous chunk's, held as grad_logits_chunk
    # (:212), are still referenced: two
    ((0, 8, 2), GRAD_INPUT + LOSS_1D + 2 * LOGITS),
    ((0, 5, 3), GRAD_INPUT + LOSS_1D + 2 * LOGITS),
    # 0.5.0-0.5.2: `grad_logits_chunk = logits_chunk * alpha` (v0.5.2 :114): the previous chunk's pair and the new
    # logits; the token count kept as an int64 tensor (v0.5.0 :57)
    ((0, 5, 2), GRAD_INPUT + LOSS_1D + 3 * LOGITS + 8),
    # 0.3.0-0.4.2: and `.float()` (v0.4.2 :78, 2 units) beside the new bf16 logits and the previous scaled copy
    ((0, 4, 2), GRAD_INPUT + LOSS_1D + 4 * LOGITS + 8),
    # 0.2.1: the same four units, the count read to the host (v0.2.1 :60), and a (V, H) weight gradient allocated
    # for the frozen lm_head (v0.2.1 :54)
    ((0, 2, 1), WEIGHT + GRAD_INPUT + LOSS_1D + 4 * LOGITS),
]


@pytest.mark.parametrize(("release", "expected"), FLCE_CASES, ids=lambda v: str(v))
def test_the_fused_loss_holds_what_its_release_does(release: tuple[int, int, int], expected: int) -> None:
    peak, left = _flce_forward(release)
    assert peak == expected
    # kept for backward: the input's gradient (and 0.2.1's weight gradient), the 4-byte loss
    assert left == GRAD_INPUT + 4 + (WEIGHT if release < (0, 3, 0) else 0)


def test_a_mean_loss_keeps_a_scale_tensor_from_0_3_0_to_0_5_2() -> None:
    """v0.4.2 :119-120: `alpha = n_non_ignore / total_n_non_ignore`, a 0-d float32 tensor beside the int64 count."""
    assert _flce_forward((0, 4, 2), reduction="mean")[0] == _flce_forward((0, 4, 2))[0] + 4
    assert _flce_forward((0, 2, 1), reduction="mean")[0] == _flce_forward((0, 2, 1))[0]  # a Python float there


def test_a_trainable_lm_head_from_0_6_2_to_0_8_2_adds_a_weight_sized_product_and_its_float32_copy() -> None:
    """v0.6.2 :134 `grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()`: the bf16 (V, H) product and
    its float32 copy (2 units) at once, beside the weight gradient and one chunk's logits; 0.8.3 on accumulates a bf16
    gradient in place (wheel :349-368)."""
    assert _flce_forward((0, 6, 2), trains=True)[0] == WEIGHT + GRAD_INPUT + LOSS_1D + LOGITS + WEIGHT + 2 * WEIGHT
    assert _flce_forward((0, 8, 5), trains=True)[0] == WEIGHT + GRAD_INPUT + LOSS_1D + LOGITS
    assert _flce_forward((0, 6, 1), trains=True)[0] == WEIGHT + GRAD_INPUT + LOSS_1D + 2 * LOGITS  # addmm in place


def _loss_allocations(release: tuple[int, int, int]) -> list[int]:
    """The sizes of the allocations of the patched loss (shifted labels, the fused function) on a (2, 128, 64)
    bf16 hidden state."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ledgerspec.derivations.engine.tracker import MemoryTracker

    with FakeTensorMode():
        tracker = MemoryTracker(granularity=1, events=True)
        with tracker:
            weight = torch.nn.Parameter(torch.empty(V, H, dtype=torch.bfloat16), requires_grad=False)
            hidden = torch.empty(2, 128, H, dtype=torch.bfloat16, requires_grad=True)
            labels = torch.zeros(2, 128, dtype=torch.long)
            tracker.mark("loss")
            loss = liger.functions().fused_linear_cross_entropy_loss(hidden, weight, labels, None, True, None, release)
            del loss
    assert tracker.events is not None
    start = tracker.events.index(("phase", "loss"))
    return [e[2] for e in tracker.events[start:] if e[0] == "alloc"]


def test_before_0_5_6_the_patched_forward_copies_the_shifted_hidden_states() -> None:
    """v0.5.5 model/llama.py:217-218: `hidden_states[..., :-1, :].contiguous()` (2 x 127 x 64 bf16) and the shifted
    labels (2 x 127 int64); 0.5.6's LigerForCausalLMLoss pads the labels (2 x 129, loss_utils.py:41) and copies the
    shifted ones (2 x 128) instead."""
    old, new = _loss_allocations((0, 5, 5)), _loss_allocations((0, 5, 6))
    assert old[:2] == [2 * 127 * H * 2, 2 * 127 * 8]
    assert new[:2] == [2 * 129 * 8, 2 * 128 * 8]
    assert 2 * 127 * H * 2 not in new


# -- RMSNorm, per release -------------------------------------------------------------------------------------------

M, N = 2048, 1024  # rows, hidden size
A100 = cuda_reduce.A100
# x.sum(dim=0) of a (2048, 1024) float32 or bf16 tensor on an A100 (Reduce.cuh 2.4.1, followed by hand in
# tests/derivations/engine/test_cuda_reduce.py): 32 blocks per column, 16 MiB of float32 staging, 8 semaphores
STAGING = 16 * MiB + 8 * 4


def _rms_norm(
    release: tuple[int, int, int],
    trains: bool = True,
    weight_dtype: str = "float32",
    in_place: bool = True,
    device: Any = A100,
) -> tuple[int, int]:
    """(forward's peak, backward's peak) in bytes over what exists before each, bf16 x of (M, N)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ledgerspec.derivations.engine.tracker import MemoryTracker

    F = liger.functions()
    with FakeTensorMode():
        tracker = MemoryTracker(granularity=1)
        with tracker:
            w = torch.nn.Parameter(torch.ones(N, dtype=getattr(torch, weight_dtype)), requires_grad=trains)
            x = torch.empty(M, N, dtype=torch.bfloat16, requires_grad=True)
            dy = torch.empty_like(x)
            before = tracker.current
            tracker.reset_peak()
            y = F.RMSNorm.apply(x, w, in_place, A100.sm_count, release, False, device)
            forward = tracker.peak - before
            before = tracker.current
            tracker.reset_peak()
            y.backward(dy)
            backward = tracker.peak - before
    return forward, backward


RMS_CASES = [
    # 0.2.0-0.3.1: `dW = torch.empty_like(X, dtype=W.dtype)` (v0.3.1 :241-244), float32 here, its sum (N float32)
    # and the reduction's staging
    ("0.2.1, a float32 weight that trains", (0, 2, 1), {}, M * N * 4 + N * 4 + STAGING),
    ("0.2.1 off CUDA: no staging", (0, 2, 1), {"device": None}, M * N * 4 + N * 4),
    # a frozen bf16 weight still gets the (M, N) buffer (in its dtype); `.to(W.dtype)` of a bf16 sum copies nothing
    (
        "0.2.1, a frozen bf16 weight",
        (0, 2, 1),
        {"trains": False, "weight_dtype": "bfloat16"},
        M * N * 2 + N * 2 + STAGING,
    ),
    # before 0.2.0: `dW = torch.zeros_like(X)` (v0.1.1 :164), bf16 like x, its bf16 sum (:184)
    ("0.1.1", (0, 1, 1), {}, M * N * 2 + N * 2 + STAGING),
    # 0.4.0-0.8.4: (SMs, N) float32 partials (v0.4.0 :262), their sum; no staging (27 values per thread); frozen: the
    # same, and the sum's copy in W's dtype (`.to(W.dtype)`, :290)
    ("0.4.0", (0, 4, 0), {}, 108 * N * 4 + N * 4),
    (
        "0.8.4, a frozen bf16 weight",
        (0, 8, 4),
        {"trains": False, "weight_dtype": "bfloat16"},
        108 * N * 4 + N * 4 + N * 2,
    ),
    ("0.8.5, a frozen weight: nothing", (0, 8, 5), {"trains": False}, 0),
    # in_place=False (Gemma 2/3's norms) allocates dX from 0.4.1 (v0.4.1 :276-279); before, dX went into dY anyway
    ("0.4.1 out of place", (0, 4, 1), {"in_place": False}, M * N * 2 + 108 * N * 4 + N * 4),
    ("0.4.0 out of place: in place", (0, 4, 0), {"in_place": False}, 108 * N * 4 + N * 4),
]


@pytest.mark.parametrize(("case", "release", "kwargs", "expected"), RMS_CASES, ids=[c[0] for c in RMS_CASES])
def test_the_rms_norm_backward_allocates_what_its_release_does(
    case: str, release: tuple[int, int, int], kwargs: dict[str, Any], expected: int
) -> None:
    assert _rms_norm(release, **kwargs)[1] == expected


def test_the_reciprocal_rms_is_float32_from_0_2_0() -> None:
    """The output (M, N) bf16 and one reciprocal RMS per row: in x's dtype before 0.2.0 (v0.1.1 :124), float32 from
    0.2.0 (v0.2.0 :228-233)."""
    assert _rms_norm((0, 1, 1))[0] == M * N * 2 + M * 2
    assert _rms_norm((0, 2, 0))[0] == M * N * 2 + M * 4
