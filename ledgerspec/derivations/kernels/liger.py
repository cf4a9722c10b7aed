"""Liger-Kernel's autograd functions as the simulated step allocates them, release by release.

Liger's kernels are Triton kernels: they do not run on this CPU, and under fake tensors nothing runs anyway. Each
class below is an allocation model: its forward and backward allocate, keep and free the tensors the Liger function
of the same name does, in the same order and of the same shapes and dtypes, and write nothing (the Triton kernels'
in-place writes allocate nothing). The values are garbage: these classes are for the estimate's fake tensors only.

Which release: liger-kernel 0.8.5 (its wheel, ``liger_kernel/ops/...``, the lines cited without a release) unless
``software.kernels.packages`` declares another (``{liger-kernel: 0.4.2}``, :func:`declared_release`). Where an
allocation changed between releases, :data:`CHANGES` names the first release with the new allocation and cites both
sides: linkedin/Liger-Kernel's release tags (``src/liger_kernel/...`` at the tag's commit) up to v0.8.2, the PyPI
wheels of 0.8.3 to 0.8.5 after it (the repository's history this was read from ends at v0.8.2). A declared release
gets the allocations of the newest rule it is not older than; a release newer than 0.8.5 gets 0.8.5's. SwiGLU, GeGLU
and RoPE allocate the same in every release from 0.0.1 to 0.8.5 (``torch.zeros_like`` became ``torch.empty_like``
for the output in 0.3.0, the same bytes; the rest changed indexing and dtypes inside the kernels only).

On the CUDA target, the RMSNorm models also allocate, for the length of their explicit ``sum(dim=0)`` of the weight
gradient, the staging buffer and semaphores PyTorch's CUDA reduction takes from the caching allocator when it splits
one output's rows across thread blocks (:mod:`ledgerspec.derivations.engine.cuda_reduce`): large for liger-kernel
< 0.4.0's (rows, H) buffer, none for the (SMs, H) partial sums of later releases. Other reductions of the step are
left as the CPU kernels run them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any

#: (major, minor, patch) of a liger-kernel release
Release = tuple[int, int, int]
#: the package's name in ``software.kernels.packages`` (PyPI's; ``liger_kernel`` is read as the same)
PACKAGE = "liger-kernel"
#: the release the models follow when none is declared, and the newest they know
LATEST: Release = (0, 8, 5)

_REPO = "linkedin/Liger-Kernel"
_OPS = "src/liger_kernel/ops"


@dataclass(frozen=True)
class Change:
    """One allocation of a Liger function that changed between releases."""

    key: str
    #: the first release with the new allocation: a declared release older than this gets the old one
    release: Release
    #: the old allocation and the new one, in words
    what: str
    #: where both are read: repository, tag (commit) or wheel, file:line
    source: str


CHANGES: dict[str, Change] = {
    c.key: c
    for c in (
        Change(
            "rms_dw_dtype",
            (0, 2, 0),
            "RMSNorm: the (rows, H) weight-gradient buffer and the reciprocal RMS per row in X's dtype "
            "(`dW = torch.zeros_like(X)`, `torch.sum(dW, dim=0)`); from 0.2.0 the buffer in W's dtype (float32 under "
            "Gemma casting), the sum cast `.to(W.dtype)`, the reciprocal RMS in float32",
            f"{_REPO} v0.1.1 (b418557) {_OPS}/rms_norm.py:124, :164, :184; v0.2.0 (c6fb35e) rms_norm.py:228-233, "
            ":277-284, :306",
        ),
        Change(
            "rms_dw_rows",
            (0, 4, 0),
            "RMSNorm backward: a (rows, H) weight-gradient buffer (`dW = torch.empty_like(X, dtype=...)`) summed "
            "over the rows (`torch.sum(dW, dim=0).to(W.dtype)`); from 0.4.0 a (SMs, H) float32 one "
            "(`_dW = torch.empty((sm_count, n_cols), dtype=torch.float32)`, `_dW.sum(dim=0).to(W.dtype)`)",
            f"{_REPO} v0.3.1 (1520999) {_OPS}/rms_norm.py:241-244, :265; v0.4.0 (e985195) rms_norm.py:262, :290 "
            "(e1e9d2e3, #255)",
        ),
        Change(
            "rms_in_place_option",
            (0, 4, 1),
            "RMSNorm backward: dX always written into dY; from 0.4.1 `in_place=False` (Gemma 2/3's norms) "
            "allocates it (`dX = torch.zeros_like(dY)`)",
            f"{_REPO} v0.4.0 (e985195) {_OPS}/rms_norm.py:262-290; v0.4.1 (d784664) rms_norm.py:276-279 "
            "(563e5e53, #376)",
        ),
        Change(
            "rms_dw_needs_grad",
            (0, 8, 5),
            "RMSNorm backward: the (SMs, H) float32 partial sums and their sum allocated for every norm with a "
            "weight, frozen or not; from 0.8.5 only when the weight needs a gradient (`needs_dw`)",
            "liger-kernel 0.8.4 wheel liger_kernel/ops/rms_norm.py:539, :615; 0.8.5 wheel rms_norm.py:542-544, "
            ":622, :697",
        ),
        Change(
            "flce_frozen_grad_weight",
            (0, 3, 0),
            "fused linear cross-entropy: a weight gradient (`torch.zeros_like(weight)`, the lm_head's size) "
            "allocated, accumulated into and kept for backward even for a frozen lm_head; from 0.3.0 only for one "
            "that trains",
            f"{_REPO} v0.2.1 (e5d6ad7) {_OPS}/fused_linear_cross_entropy.py:54; v0.3.0 (793785f) "
            "fused_linear_cross_entropy.py:46-48 (acd82728, #237)",
        ),
        Change(
            "flce_alpha_tensor",
            (0, 3, 0),
            "fused linear cross-entropy: the count of valid tokens read to the host (`.sum().item()`) and a Python "
            "float scale; from 0.3.0 (to 0.5.2) the count kept as a tensor, the scale `alpha` a 0-d tensor (mean) "
            "and the chunk's losses scaled into a copy (`loss_1d_slice * alpha`)",
            f"{_REPO} v0.2.1 (e5d6ad7) {_OPS}/fused_linear_cross_entropy.py:60, :113; v0.3.0 (793785f) "
            "fused_linear_cross_entropy.py:55, :112-117",
        ),
        Change(
            "flce_autocast_dtype",
            (0, 4, 0),
            "fused linear cross-entropy: the upcast chunk cast back to the autocast dtype when autocast is on "
            "(`torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else _input.dtype`); from 0.4.0 to "
            "the input's dtype",
            f"{_REPO} v0.3.1 (1520999) {_OPS}/fused_linear_cross_entropy.py:24-26; v0.4.0 (e985195) "
            "fused_linear_cross_entropy.py:27 (6cdc93de, #318)",
        ),
        Change(
            "flce_upcast",
            (0, 5, 0),
            "fused linear cross-entropy: each chunk's logits copied to float32 for the loss kernel and back "
            "(`logits_chunk = logits_chunk.float()`, `logits_chunk = logits_chunk.to(dtype)`); from 0.5.0 the "
            "kernel upcasts inside",
            f"{_REPO} v0.4.2 (cbebed6) {_OPS}/fused_linear_cross_entropy.py:78, :111; v0.5.0 (37ffbe9) "
            "(90fb5e4a, #406)",
        ),
        Change(
            "flce_scaled_copy",
            (0, 5, 3),
            "fused linear cross-entropy: the chunk's gradient a scaled copy of its logits "
            "(`grad_logits_chunk = logits_chunk * alpha`); from 0.5.3 the logits themselves "
            "(`grad_logits_chunk = logits_chunk`)",
            f"{_REPO} v0.5.2 (966eb73) {_OPS}/fused_linear_cross_entropy.py:114; v0.5.3 (80b409a) "
            "fused_linear_cross_entropy.py:122 (42ff02ac, #420)",
        ),
        Change(
            "flce_grad_weight_mm",
            (0, 6, 2),
            "fused linear cross-entropy, an lm_head that trains: `torch.addmm(..., out=grad_weight)` in place; from "
            "0.6.2 `grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()`, a weight-sized product "
            "and its float32 copy per chunk (0.8.1: in place again for a float32 grad_weight, 0.8.3 for a bf16/fp16 "
            "one)",
            f"{_REPO} v0.6.1 (7705dcc) {_OPS}/fused_linear_cross_entropy.py:127-136; v0.6.2 (77a4c1a) "
            "fused_linear_cross_entropy.py:134; v0.8.1 (a5234df) :216-237; 0.8.3 wheel :349-375",
        ),
        Change(
            "flce_fp32_addmm",
            (0, 8, 1),
            "fused linear cross-entropy, an lm_head that trains with a float32 grad_weight: in place again "
            "(`torch.addmm(..., out_dtype=torch.float32, out=grad_weight)`, torch >= 2.8)",
            f"{_REPO} v0.8.1 (a5234df) {_OPS}/fused_linear_cross_entropy.py:216-235 (c9fc646f, #1239)",
        ),
        Change(
            "flce_mm_out",
            (0, 8, 3),
            "fused linear cross-entropy: each chunk's logits allocated anew (`_input_chunk @ weight.t()`) while "
            "the previous chunk's are still referenced; from 0.8.3 one reused (chunk, V) buffer on CUDA "
            "(`torch.mm(..., out=logits_chunk)`) and the chunk released before the next (`del grad_logits_chunk`), "
            "and a bf16/fp16 grad_weight accumulated in place",
            f"{_REPO} v0.8.2 (000be60) {_OPS}/fused_linear_cross_entropy.py:114, :212, :257; 0.8.3 wheel "
            "liger_kernel/ops/fused_linear_cross_entropy.py:105, :147-154, :285, :349-368, :388",
        ),
        Change(
            "lce_shift_copy",
            (0, 5, 6),
            "the patched causal-LM forward shifts the hidden states with a copy "
            "(`shift_hidden_states = hidden_states[..., :-1, :].contiguous()`, labels likewise); from 0.5.6 "
            "`LigerForCausalLMLoss` pads the labels instead and passes the hidden states as they are",
            f"{_REPO} v0.5.5 (a6dc70d) src/liger_kernel/transformers/model/llama.py:217-229 (every model's "
            "lce_forward the same); v0.5.6 (c3c2d4f) model/llama.py:216, model/loss_utils.py:41-42 (b4cb31f1, #614)",
        ),
    )
}


def parse_release(text: str) -> Release | None:
    """``0.4.2`` (a ``v`` before, a suffix such as ``.dev0`` or ``rc1`` after, a missing patch read as 0); None
    when the text is no version."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def declared_version(packages: Iterable[tuple[str, str]]) -> str | None:
    """The liger-kernel version ``software.kernels.packages`` declares, as written (None: not declared)."""
    for name, version in packages:
        if str(name).strip().lower().replace("_", "-") == PACKAGE:
            return str(version)
    return None


def declared_release(packages: Iterable[tuple[str, str]]) -> Release:
    """The release whose allocations the models follow: the declared one (capped at :data:`LATEST`), else
    :data:`LATEST`."""
    version = declared_version(packages)
    release = parse_release(version) if version is not None else None
    return LATEST if release is None else min(release, LATEST)


def older(release: Release, key: str) -> bool:
    """Whether ``release`` has the allocation :data:`CHANGES` ``[key]`` replaced."""
    return release < CHANGES[key].release


def differences(release: Release) -> list[Change]:
    """The changes ``release`` predates: where its allocations are not 0.8.5's."""
    return [c for c in CHANGES.values() if release < c.release]


def release_text(release: Release) -> str:
    return ".".join(map(str, release))


def version_note(packages: Iterable[tuple[str, str]]) -> str | None:
    """What the method text says of the modelled release (None: 0.8.5, as declared or by default)."""
    version = declared_version(packages)
    if version is None:
        return None
    release = parse_release(version)
    if release is None:
        return f"{PACKAGE} {version!r} is no version: {release_text(LATEST)}'s allocations modelled"
    if release > LATEST:
        return (
            f"{PACKAGE} {version}: newer than the newest release modelled, {release_text(LATEST)}, whose "
            "allocations are used"
        )
    changed = differences(release)
    if not changed:
        return None
    keys = ", ".join(c.key for c in changed)
    return f"{PACKAGE} {version}'s allocations modelled (differing from {release_text(LATEST)}'s: {keys})"


@cache
def functions() -> Any:
    """The module's autograd functions and helpers, built on first use (torch is imported here, not on import)."""
    import torch

    IGNORE_INDEX = -100
    #: ``_CHUNK_MEM_CONST`` (ops/fused_linear_cross_entropy.py:27): the chunk's logits are bounded by this many
    #: times the chunk's hidden states
    CHUNK_MEM_CONST = 1

    def _cdiv(a: int, b: int) -> int:
        return (a + b - 1) // b

    def _next_power_of_2(n: int) -> int:
        return 1 if n <= 1 else 1 << (n - 1).bit_length()

    def flce_chunk_size(bt: int, hidden: int, vocab: int) -> int:
        """The tokens per chunk (ops/fused_linear_cross_entropy.py:102-105, verbatim)::

        inc_factor = triton.cdiv(V, chunk_mem_const * H)
        chunk_size = triton.next_power_of_2(triton.cdiv(BT, inc_factor))
        chunk_size = min(chunk_size, BT)

        Releases before 0.8.3 have the same first two lines with ``triton.cdiv(V, H)`` and no ``min``; their chunks
        are slices of the input, which end at ``BT``, so the rows per chunk are the same.
        """
        inc_factor = _cdiv(vocab, CHUNK_MEM_CONST * hidden)
        return min(_next_power_of_2(_cdiv(bt, inc_factor)), bt)

    def can_use_mm_out(x: Any, weight: Any, on_cuda: bool, autocast_dtype: Any) -> bool:
        """``_can_use_mm_out`` (ops/fused_linear_cross_entropy.py:32-48): on CUDA (not HIP), with the input and the
        weight of one 16/32-bit dtype and autocast off or in that dtype, the chunk's logits go into one reused buffer
        and its gradient straight into ``grad_input`` (``torch.mm(..., out=...)``)."""
        same = x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        return on_cuda and same and (autocast_dtype is None or autocast_dtype == x.dtype)

    def _dtype_name(dtype: Any) -> str:
        return str(dtype).removeprefix("torch.")

    def reduction_staging(rows: Any, device: Any) -> None:
        """``rows.sum(dim=0)`` on CUDA takes a staging buffer and semaphores from the caching allocator for the
        kernel's launch when it splits the rows across thread blocks (:mod:`ledgerspec.derivations.engine.
        cuda_reduce`): allocated after the sum's output, released when it returns. ``device`` None: not CUDA."""
        if device is None:
            return
        from ledgerspec.derivations.engine import cuda_reduce

        n, h = rows.shape
        st = cuda_reduce.rows_sum_staging(n, h, _dtype_name(rows.dtype), device)
        if st.buffer:
            buffer = torch.empty(st.buffer, dtype=torch.uint8, device=rows.device)
            semaphores = torch.empty(st.semaphores, dtype=torch.uint8, device=rows.device)
            del buffer, semaphores

    class FusedLinearCrossEntropy(torch.autograd.Function):
        """``LigerFusedLinearCrossEntropyFunction`` without bias, z-loss, class weights or softcap, reduction
        ``sum`` (transformers passes ``num_items_in_batch``) or ``mean``. A frozen ``lm_head`` (LoRA/QLoRA) gets no
        weight gradient from 0.3.0 on; one that trains gets it accumulated as its release does (the CUDA fast paths
        of 0.8.1/0.8.3 on: in place)."""

        @staticmethod
        def forward(
            ctx: Any,
            x: Any,
            weight: Any,
            target: Any,
            on_cuda: bool,
            autocast_dtype: Any,
            release: Release = LATEST,
            reduction: str = "sum",
        ) -> Any:
            bt, hidden = x.shape
            vocab = weight.shape[0]
            chunk = flce_chunk_size(bt, hidden, vocab)
            mean = reduction == "mean"
            grad_weight = None
            needs_weight_grad = weight.requires_grad or older(release, "flce_frozen_grad_weight")
            if needs_weight_grad and older(release, "flce_grad_weight_mm"):  # v0.4.2 :48-52: before grad_input
                grad_weight = torch.zeros_like(weight)  # v0.2.1 :54 even for a frozen weight
            grad_input = torch.zeros_like(x)  # :108, saved: the input's gradient, computed in forward
            if needs_weight_grad and grad_weight is None:  # :114-120 the weight's gradient, param dtype
                grad_weight = torch.zeros_like(weight)
            loss_1d = torch.zeros(bt, dtype=torch.float32, device=x.device)  # :125
            total = None
            if older(release, "flce_alpha_tensor"):  # v0.2.1 :60 `(target != ignore_index).sum().item()`
                target_mask = target != IGNORE_INDEX
                del target_mask
            elif older(release, "flce_scaled_copy"):  # v0.4.2 :58 `total_n_non_ignore = (...).sum()`, kept
                target_mask = target != IGNORE_INDEX
                total = target_mask.sum()
                del target_mask
            else:  # :131-132, `total_n_non_ignore = target_mask.sum().item()`
                target_mask = target != IGNORE_INDEX
                total = target_mask.sum()
                del target_mask, total
                total = None
            # the dtype the upcast chunk returns to (< 0.5.0): the autocast dtype under autocast before 0.4.0
            back = autocast_dtype if autocast_dtype is not None and older(release, "flce_autocast_dtype") else x.dtype
            mm_out = not older(release, "flce_mm_out") and can_use_mm_out(x, weight, on_cuda, autocast_dtype)
            storage = torch.empty((chunk, vocab), dtype=x.dtype, device=x.device) if mm_out else None  # :150-154
            alpha: Any = 1.0
            for start in range(0, bt, chunk):
                end = min(start + chunk, bt)
                x_chunk = x[start:end]
                if storage is not None:  # :160-166 `torch.mm(_input_chunk, weight.t(), out=logits_chunk)`
                    logits_chunk = storage[: end - start]
                else:  # :168 `logits_chunk = _input_chunk @ weight.t()` (autocast casts as it does there)
                    logits_chunk = x_chunk @ weight.t()
                if older(release, "flce_scaled_copy"):  # v0.4.2 :74 `(target_chunk != ignore_index).sum().item()`
                    chunk_mask = target[start:end] != IGNORE_INDEX
                    n_valid = chunk_mask.sum()
                    del chunk_mask, n_valid
                if older(release, "flce_upcast"):  # v0.4.2 :78 `logits_chunk = logits_chunk.float()`
                    logits_chunk = logits_chunk.float()
                # :212-250 the cross-entropy kernel writes the loss into loss_1d and d(loss)/d(logits) into the chunk
                if older(release, "flce_upcast"):  # v0.4.2 :111 `logits_chunk = logits_chunk.to(dtype)`
                    logits_chunk = logits_chunk.to(back)
                if older(release, "flce_scaled_copy"):
                    if total is not None and mean:  # v0.4.2 :119-120: `n_non_ignore / total_n_non_ignore` (0-d)
                        positive = total > 0
                        del positive
                        alpha = total.reciprocal() * 1  # Tensor.__rtruediv__: `self.reciprocal() * other`
                    if not older(release, "flce_alpha_tensor"):  # v0.4.2 :124 `loss_1d[...] = loss_1d_slice * alpha`
                        loss_1d[start:end] = loss_1d[start:end] * alpha
                    grad_logits_chunk = logits_chunk * alpha  # v0.4.2 :125, v0.2.1 :113: a new (chunk, V)
                else:  # v0.5.3 :122 `grad_logits_chunk = logits_chunk`
                    grad_logits_chunk = logits_chunk
                if storage is not None and grad_logits_chunk.dtype == grad_input.dtype:
                    pass  # :319 `torch.mm(grad_logits_chunk, weight, out=grad_input[start:end])`
                else:  # :321 `grad_input[start_idx:end_idx] = grad_logits_chunk @ weight`
                    grad_input[start:end] = grad_logits_chunk @ weight
                if grad_weight is not None:
                    _accumulate_grad_weight(release, grad_weight, logits_chunk, grad_logits_chunk, x_chunk)
                if not older(release, "flce_mm_out"):
                    del logits_chunk, grad_logits_chunk  # :285, :388 the chunk goes before the next one's logits
            del storage  # :391
            loss = torch.sum(loss_1d)  # :404
            if older(release, "flce_alpha_tensor"):  # v0.2.1 `loss = torch.sum(loss_1d) / total_n_non_ignore`
                loss = loss / 1
            del loss_1d
            ctx.save_for_backward(grad_input.detach(), grad_weight)  # :554-578
            return loss

        @staticmethod
        def backward(ctx: Any, grad_output: Any) -> Any:
            grad_input, grad_weight = ctx.saved_tensors
            # fused_linear_cross_entropy_backward (:418-464): `torch.equal(grad_output, torch.tensor(1.0, ...))`, then
            # element_mul in place on grad_input (and grad_weight): no other allocation
            one = torch.tensor(1.0, dtype=grad_output.dtype, device=grad_output.device)
            del one
            return grad_input, grad_weight, None, None, None, None, None

    def _accumulate_grad_weight(
        release: Release, grad_weight: Any, logits_chunk: Any, grad_logits_chunk: Any, x_chunk: Any
    ) -> None:
        """What a chunk adds to the weight's gradient allocates (:data:`CHANGES` ``flce_grad_weight_mm``)."""
        if older(release, "flce_scaled_copy"):  # v0.4.2 :127-134 `torch.addmm(..., mat1=logits_chunk.t(), ...)`
            return
        if older(release, "flce_grad_weight_mm"):  # v0.5.3 :127-136 `mat1=logits_chunk.t().to(_input_chunk.dtype)`
            mat1 = logits_chunk.t().to(x_chunk.dtype)
            del mat1
            return
        if not older(release, "flce_mm_out"):  # :324-368 `torch.addmm(grad_weight, ..., out=grad_weight)` (sm80+)
            return
        low = grad_logits_chunk.dtype in (torch.float16, torch.bfloat16)
        if not older(release, "flce_fp32_addmm") and grad_weight.dtype == torch.float32 and low:  # v0.8.1 :216-235
            return
        # v0.6.2 :134, :375 `grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()`
        product = torch.mm(grad_logits_chunk.t(), x_chunk)
        grad_weight += product.float()
        del product

    def fused_linear_cross_entropy_loss(
        hidden: Any,
        weight: Any,
        labels: Any,
        num_items_in_batch: Any,
        on_cuda: bool,
        autocast_dtype: Any,
        release: Release = LATEST,
    ) -> Any:
        """``LigerForCausalLMLoss`` (transformers/model/loss_utils.py:67-106): the labels padded by one ignored position
        and shifted, the hidden states flattened, reduction ``sum`` divided by ``num_items_in_batch`` when given.
        Before 0.5.6 (:data:`CHANGES` ``lce_shift_copy``) the patched forward copies the shifted hidden states and
        labels instead (``mean`` before 0.4.0, which did not read ``num_items_in_batch``)."""
        import torch.nn.functional as nnf

        if older(release, "lce_shift_copy"):  # v0.5.5 model/llama.py:217-229
            shift_hidden = hidden[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            x = shift_hidden.view(-1, hidden.shape[-1])
            del shift_hidden
            use_sum = num_items_in_batch is not None and not older(release, "flce_autocast_dtype")  # v0.4.0
        else:
            labels = nnf.pad(labels, (0, 1), value=IGNORE_INDEX)
            shift_labels = labels[..., 1:].contiguous()
            del labels
            x = hidden.view(-1, hidden.shape[-1])
            use_sum = num_items_in_batch is not None
        reduction = "sum" if use_sum else "mean"
        loss = FusedLinearCrossEntropy.apply(
            x, weight, shift_labels.view(-1), on_cuda, autocast_dtype, release, reduction
        )
        if use_sum:
            loss = loss / num_items_in_batch
        return loss

    class RMSNorm(torch.autograd.Function):
        """``LigerRMSNormFunction`` (ops/rms_norm.py): the output and a reciprocal RMS per row (float32 from 0.2.0);
        saves the input itself (a view, no copy), the weight and the RMS; backward writes dX into dY in place
        (``in_place=True``, the llama casting mode's default; always before 0.4.1) and sums the weight's gradient:
        float32 partial sums per SM (0.4.0 on; from 0.8.5 only for a weight that trains), a (rows, H) buffer before.
        ``gemma``: Gemma's casting mode (a float32 (rows, H) buffer in 0.2.0-0.3.1). ``device``: the CUDA device
        (:class:`ledgerspec.derivations.engine.cuda_reduce.CudaDevice`) whose reduction staging the weight-gradient
        sum takes, None off CUDA."""

        @staticmethod
        def forward(
            ctx: Any,
            x: Any,
            weight: Any,
            in_place: bool,
            sm_count: int,
            release: Release = LATEST,
            gemma: bool = False,
            device: Any = None,
        ) -> Any:
            shape = x.shape
            x2 = x.contiguous().view(-1, shape[-1])  # ensure_contiguous, `X.view(-1, dim)` (:449-460)
            y = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)  # :462
            # :465-466 (llama/gemma: fp32); v0.1.1 :124 `r = torch.empty(n_rows, dtype=X.dtype)`
            rstd_dtype = x2.dtype if older(release, "rms_dw_dtype") else torch.float32
            rstd = torch.empty(x2.shape[0], dtype=rstd_dtype, device=x2.device)
            ctx.in_place, ctx.sm_count, ctx.release, ctx.gemma, ctx.device = in_place, sm_count, release, gemma, device
            ctx.save_for_backward(x2, weight, rstd)  # :674-676
            return y.view(shape)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            x2, weight, _rstd = ctx.saved_tensors
            release, device = ctx.release, ctx.device
            dw: Any = None
            partial: Any = None
            shape = dy.shape
            dy2 = dy.contiguous().view(-1, shape[-1])
            if older(release, "rms_dw_rows"):  # the (rows, H) buffer, summed after the kernel
                if older(release, "rms_dw_dtype"):  # v0.1.1 :164 `dW = torch.zeros_like(X)`
                    rows = torch.zeros_like(x2)
                else:  # v0.3.1 :241-244 `torch.empty_like(X, dtype=(fp32 if gemma else W.dtype))`
                    rows = torch.empty_like(x2, dtype=torch.float32 if ctx.gemma else weight.dtype)
                dx = dy2  # v0.3.1 :247-262: dX written into dY
                dw = rows.sum(dim=0)  # v0.3.1 :265 `torch.sum(dW, dim=0)`, v0.1.1 :184
                reduction_staging(rows, device)
                if not older(release, "rms_dw_dtype"):  # `.to(W.dtype)`
                    dw = dw.to(weight.dtype)
                del rows
                return dx.view(shape), dw if ctx.needs_input_grad[1] else None, None, None, None, None, None
            if ctx.needs_input_grad[1] or older(release, "rms_dw_needs_grad"):  # :541-546 (0.8.4 :539: always)
                partial = torch.empty((ctx.sm_count, x2.shape[-1]), dtype=torch.float32, device=x2.device)
            in_place = ctx.in_place or older(release, "rms_in_place_option")
            dx = dy2 if in_place else torch.zeros_like(dy2)  # :555-558
            if partial is not None:  # `_dW.sum(dim=0).to(W.dtype)` (:622)
                dw = partial.sum(dim=0)
                reduction_staging(partial, device)
                dw = dw.to(weight.dtype)
                del partial
            if not ctx.needs_input_grad[1]:
                dw = None  # autograd drops the gradient of a weight that does not train
            return dx.view(shape), dw, None, None, None, None, None

    class GatedActivation(torch.autograd.Function):
        """``LigerSiLUMulFunction`` (ops/swiglu.py:240-306) and ``LigerGELUMulFunction`` (ops/geglu.py:133-146): the
        product ``act(a) * b`` in a new tensor; saves ``a`` and ``b`` only; backward recomputes the activation and
        writes the gradients into ``a`` and ``b`` in place, and returns them."""

        @staticmethod
        def forward(ctx: Any, a: Any, b: Any) -> Any:
            a2 = a.contiguous().view(-1, a.shape[-1])  # ensure_contiguous
            b2 = b.contiguous().view(-1, b.shape[-1])
            c = torch.empty_like(a2)  # swiglu.py:165 / geglu.py:93
            ctx.save_for_backward(a2, b2)  # swiglu.py:272 / geglu.py:138
            ctx.shape = a.shape
            return c.view(a.shape)

        @staticmethod
        def backward(ctx: Any, dc: Any) -> Any:
            a2, b2 = ctx.saved_tensors
            dc.contiguous()  # a copy only when the incoming gradient is not contiguous
            return a2.view(ctx.shape), b2.view(ctx.shape)  # the kernel wrote da into a, db into b

    class Rope(torch.autograd.Function):
        """``LigerRopeFunction`` (ops/rope.py): rotates q and k in place (no new tensor), saves the model's cos and sin
        (shared by every layer); backward makes ``dq.transpose(1, 2).contiguous()`` (a copy when the attention's
        gradient is not laid out as (batch, tokens, heads, dim)) and rotates it in place."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, cos: Any, sin: Any) -> Any:
            qt = q.transpose(1, 2).contiguous()  # :153-154, :169-172: no-ops in the HF layout
            kt = k.transpose(1, 2).contiguous()
            ctx.save_for_backward(cos, sin)  # :289
            return qt.transpose(1, 2), kt.transpose(1, 2)  # :198

        @staticmethod
        def backward(ctx: Any, dq: Any, dk: Any) -> Any:
            dqt = dq.transpose(1, 2).contiguous()  # :216-217, :233-234
            dkt = dk.transpose(1, 2).contiguous()
            return dqt.transpose(1, 2), dkt.transpose(1, 2), None, None

    def rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
        """``liger_rotary_pos_emb`` in place of transformers' ``apply_rotary_pos_emb``."""
        return Rope.apply(q, k, cos, sin)

    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "torch"})


__all__ = ["functions"]
