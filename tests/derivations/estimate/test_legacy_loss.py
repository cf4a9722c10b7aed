"""transformers < 4.49's causal-LM loss, modelled when a ledger declares it (known difference
``transformers-causal-lm-loss-shift-copy``): the same loss value, one more float32 copy of the shifted logits."""

from __future__ import annotations

from typing import Any

import pytest

from ledgerspec.contract.document import from_text

LEDGER = "ledgerspec: ledger/v1\nsoftware: {transformers: '%s'}\n"


@pytest.mark.parametrize(
    ("declared", "modelled"), [("4.48.1", True), ("4.46.0", True), ("4.49.0", False), ("5.2", False)]
)
def test_modelled_only_when_declared_older(declared: str, modelled: bool) -> None:
    from ledgerspec.derivations.estimate.legacy_loss import models_shift_copy

    assert models_shift_copy(from_text(LEDGER % declared, "x.ledger.yaml")) is modelled
    assert models_shift_copy(from_text("ledgerspec: ledger/v1\n", "x.ledger.yaml")) is False


def _allocations(fn: Any, *args: Any) -> tuple[Any, list[int]]:
    """The loss and the bytes of every new storage its forward and backward allocate (views excluded)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sizes: list[int] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            seen = {id(a.untyped_storage()) for a in args if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, tuple | list) else [out]:
                if isinstance(t, torch.Tensor) and not func._schema.is_mutable and t.untyped_storage() is not None:
                    if id(t.untyped_storage()) not in seen and not t._is_view():
                        sizes.append(t.untyped_storage().nbytes())
            return out

    with Record():
        loss = fn(*args)
        loss.backward()
    return loss, sizes


def test_same_loss_one_more_float32_copy_of_the_shifted_logits() -> None:
    """Real tensors: the declared (4.48) loss equals the installed one, and allocates exactly one more tensor of
    ``batch x (length - 1) x vocab`` float32 values in forward and one in backward (the slice's gradient)."""
    torch = pytest.importorskip("torch")
    from transformers.loss.loss_utils import LOSS_MAPPING

    from ledgerspec.derivations.estimate.legacy_loss import shifted_copy_loss

    batch, length, vocab = 2, 7, 11
    torch.manual_seed(0)
    labels = torch.randint(0, vocab, (batch, length))
    base = torch.randn(batch, length, vocab, dtype=torch.bfloat16)

    def run(fn: Any) -> tuple[Any, list[int]]:
        logits = base.clone().requires_grad_(True)
        return _allocations(lambda x: fn(logits=x, labels=labels, vocab_size=vocab), logits)

    new, new_sizes = run(LOSS_MAPPING["ForCausalLM"])
    old, old_sizes = run(shifted_copy_loss)
    assert torch.allclose(new.detach(), old.detach())
    copy = batch * (length - 1) * vocab * 4
    extra = list(old_sizes)
    for size in new_sizes:
        if size in extra:
            extra.remove(size)
    assert extra.count(copy) >= 1 and sum(extra) >= copy, (new_sizes, old_sizes)


def test_declared_loss_replaces_and_restores() -> None:
    pytest.importorskip("transformers")
    from transformers.loss.loss_utils import LOSS_MAPPING

    from ledgerspec.derivations.estimate.legacy_loss import declared_loss, shifted_copy_loss

    installed = LOSS_MAPPING["ForCausalLM"]
    with declared_loss(from_text(LEDGER % "4.48.1", "x.ledger.yaml")) as replaced:
        assert replaced and LOSS_MAPPING["ForCausalLM"] is shifted_copy_loss
    assert LOSS_MAPPING["ForCausalLM"] is installed
    with declared_loss(from_text(LEDGER % "4.49.0", "x.ledger.yaml")) as replaced:
        assert not replaced and LOSS_MAPPING["ForCausalLM"] is installed


def _transformers_4_48_1_causal_lm_loss(
    logits: Any, labels: Any, vocab_size: int, num_items_in_batch: Any = None, ignore_index: int = -100, **kwargs: Any
) -> Any:
    """transformers 4.48.1's ``ForCausalLMLoss`` and ``fixed_cross_entropy``, verbatim but for names
    (https://github.com/huggingface/transformers/blob/v4.48.1/src/transformers/loss/loss_utils.py#L24-L49):
    the ground truth for what that version holds alive, independent of the module under test."""
    from torch import nn

    logits = logits.float()
    labels = labels.to(logits.device)
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    shift_logits = shift_logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1)
    shift_labels = shift_labels.to(shift_logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        loss = loss / num_items_in_batch
    return loss


def _peak_live_bytes(fn: Any, logits: Any, labels: Any, vocab: int) -> tuple[int, int]:
    """Peak of live tensor bytes (unique storages, freed through a finalizer) in the loss's forward and in its
    backward, real tensors, counting only what the loss allocates."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    live: dict[int, int] = {}
    state = {"cur": 0, "peak": 0}

    def release(key: int) -> None:
        state["cur"] -= live.pop(key, 0)

    class Peak(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else [out]:
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    if s._cdata not in live:
                        live[s._cdata] = s.nbytes()
                        state["cur"] += s.nbytes()
                        weakref.finalize(s, release, s._cdata)
            state["peak"] = max(state["peak"], state["cur"])
            return out

    with Peak():
        loss = fn(logits=logits, labels=labels, vocab_size=vocab)
        forward = state["peak"]
        state["peak"] = state["cur"]
        loss.backward()
        backward = state["peak"]
    return forward, backward


def test_holds_what_transformers_4_48_1_holds() -> None:
    """Real tensors: the modelled loss reaches the same forward and backward peaks of live bytes as transformers
    4.48.1's own code, i.e. the full float32 logits stay alive beside the shifted copy and the log-softmax (three
    float32 logits-sized tensors at the cross-entropy, measured with transformers 4.48.1 on a real FSDP1 step in
    benchmarks/results/published-multi-gpu-cpu-repro.md)."""
    torch = pytest.importorskip("torch")

    from ledgerspec.derivations.estimate.legacy_loss import shifted_copy_loss

    batch, length, vocab = 2, 64, 1000
    torch.manual_seed(0)
    labels = torch.randint(0, vocab, (batch, length))
    base = torch.randn(batch, length, vocab, dtype=torch.bfloat16)
    peaks = {}
    for name, fn in (("4.48.1", _transformers_4_48_1_causal_lm_loss), ("modelled", shifted_copy_loss)):
        peaks[name] = _peak_live_bytes(fn, base.clone().requires_grad_(True), labels, vocab)
    assert peaks["modelled"] == peaks["4.48.1"], peaks
    full, shifted = batch * length * vocab * 4, batch * (length - 1) * vocab * 4
    assert peaks["4.48.1"][0] >= full + 2 * shifted  # the float32 logits, the shifted copy, the log-softmax


@pytest.mark.parametrize(("declared", "modelled"), [("4.45.2", True), ("4.46.0", False), ("4.48.1", False)])
def test_float_logits_modelled_only_before_4_46(declared: str, modelled: bool) -> None:
    from ledgerspec.derivations.estimate.legacy_loss import models_float_logits

    assert models_float_logits(from_text(LEDGER % declared, "x.ledger.yaml")) is modelled


@pytest.mark.slow  # two traced estimates of the tiny model
def test_before_4_46_the_16_bit_logits_are_gone_at_the_loss(tmp_path: Any) -> None:
    """transformers 4.45.2's ``LlamaForCausalLM.forward``: ``logits = self.lm_head(...).float()`` (the bf16 output
    is never bound), then the loss copies the shifted float32 logits as 4.46-4.48 do. So declared 4.45.2, the forward
    peak (at the loss) is one bf16 ``batch x length x vocab`` tensor lower than declared 4.48.1, and nothing else
    changes: 2 x 64 x 256 x 2 B (a multiple of 512: the CUDA rounding leaves it whole)."""
    pytest.importorskip("transformers")
    import shutil

    from ledgerspec.contract.document import load
    from ledgerspec.derivations.estimate.estimator import estimate
    from tests.support import EXAMPLES

    shutil.copytree(EXAMPLES / "tiny" / "tiny-llama", tmp_path / "tiny-llama")
    text = (EXAMPLES / "tiny" / "tiny-llama-lora.ledger.yaml").read_text(encoding="utf-8")
    text = text.replace("  loaded_dtype: float32\n", "  loaded_dtype: bfloat16\n")
    peaks = {}
    for version in ("4.45.2", "4.48.1"):
        path = tmp_path / f"{version}.ledger.yaml"
        path.write_text(
            text.replace(
                "  attention_implementation: sdpa\n", f"  attention_implementation: sdpa\n  transformers: {version}\n"
            ),
            encoding="utf-8",
        )
        peaks[version] = estimate(load(path), target="cuda").phases
    batch, length, vocab = 2, 64, 256
    assert peaks["4.48.1"]["forward_peak"] - peaks["4.45.2"]["forward_peak"] == batch * length * vocab * 2
    for phase in ("after_load", "after_optimizer_init", "optimizer_step_peak"):
        assert peaks["4.45.2"][phase] == peaks["4.48.1"][phase]
