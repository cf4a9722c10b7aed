"""The tensor memory tracker and the census: exact bytes of unique storages, real and fake tensors."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ledgerspec.derivations.engine.tracker import (  # noqa: E402
    SIMULATED_OOM_MARKER,
    MemoryTracker,
    SimulatedOOM,
    by_component,
    census,
)


@contextlib.contextmanager
def maybe_fake(fake: bool) -> Iterator[None]:
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            yield
    else:
        yield


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_counts_storages_once_and_releases_them(fake: bool) -> None:
    with maybe_fake(fake), MemoryTracker() as tr:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        view = a[10:20].view(2, 5)  # a view: same storage
        b = torch.empty(300, dtype=torch.bfloat16)  # 600 B
        assert tr.current == 4000 + 600
        del a
        assert tr.current == 4000 + 600  # the view keeps the storage alive
        del view
        assert tr.current == 600
        del b
        assert tr.current == 0
        assert tr.peak == 4600


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_peak_window_and_categories(fake: bool) -> None:
    with maybe_fake(fake), MemoryTracker() as tr:
        tr.context = "frozen_params"
        keep = torch.zeros(256)  # 1024 B
        tr.reset_peak()
        tr.context = "activations"
        tmp = torch.ones(512)  # 2048 B
        assert tr.peak == 1024 + 2048
        assert tr.peak_categories["activations"] == 2048
        del tmp
        tr.reset_peak()
        assert tr.peak == 1024
        assert tr.categories()["frozen_params"] == 1024
        assert tr.categories()["activations"] == 0
        del keep


def test_outputs_of_ops_are_tracked_and_in_place_ops_add_nothing() -> None:
    with MemoryTracker() as tr:
        x = torch.randn(64, 32)  # 8192 B
        y = x @ x.T  # 64 x 64 fp32 = 16384 B
        assert tr.current == 8192 + 16384
        y.add_(1.0)
        x.mul_(2.0)
        assert tr.current == 8192 + 16384
        del x, y
        assert tr.current == 0


def test_granularity_rounds_each_storage_up() -> None:
    with MemoryTracker(granularity=512) as tr:
        a = torch.empty(3, dtype=torch.uint8)  # 3 B -> 512
        b = torch.empty(129, dtype=torch.float32)  # 516 B -> 1024
        c = torch.empty(0)  # empty stays 0
        assert tr.current == 512 + 1024
        del a, b, c
    with pytest.raises(ValueError):
        MemoryTracker(granularity=0)


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_limit_raises_a_labelled_simulated_oom(fake: bool) -> None:
    with maybe_fake(fake), MemoryTracker(limit=10_000) as tr:
        a = torch.empty(2000)  # 8000 B: under the limit
        with pytest.raises(SimulatedOOM) as info:
            torch.empty(1000)  # +4000 B: over
        assert SIMULATED_OOM_MARKER in str(info.value)
        assert tr.peak == 12000
        del info  # its traceback holds the frame with the tensor that broke the limit
        gc.collect()
        assert tr.current == 8000
        del a


def _lora_like() -> tuple[Any, list[Any]]:  # (torch.nn.Module, its trainable parameters)
    base = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16))
    base.requires_grad_(False)
    a = torch.nn.Parameter(torch.zeros(4, 32))
    b = torch.nn.Parameter(torch.zeros(48, 4))
    base.register_parameter("lora_a", a)
    base.register_parameter("lora_b", b)
    base.register_buffer("scale", torch.ones(7))
    return base, [a, b]


def test_census_counts_params_buffers_grads_and_adam_state_exactly() -> None:
    model, adapters = _lora_like()
    opt = torch.optim.AdamW(adapters, lr=1e-3)
    x = torch.randn(3, 32)
    h = model[0](x) + (x @ adapters[0].T) @ adapters[1].T
    model[1](h).sum().backward()
    opt.step()
    got = census(model, opt)
    frozen = (32 * 48 + 48 + 48 * 16 + 16) * 4
    trainable = (4 * 32 + 48 * 4) * 4
    assert got["frozen_params"] == frozen
    assert got["buffers"] == 7 * 4
    assert got["adapter"] == trainable
    assert got["gradients"] == trainable
    # AdamW: exp_avg + exp_avg_sq like each parameter, plus one float32 `step` scalar per parameter tensor
    assert got["optimizer"] == 2 * trainable + 2 * 4
    assert census(model, opt, device_type="cuda")["optimizer"] == 0  # nothing of it is on a GPU here
    comps = by_component({**got, "activations": 5, "temporary": 6})
    assert comps["frozen_base"] == frozen + 28
    assert comps["activations"] == 5


def test_tied_weights_count_once() -> None:
    emb = torch.nn.Embedding(100, 16)
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    model.requires_grad_(False)
    assert census(model)["frozen_params"] == 100 * 16 * 4


def test_gradients_are_labelled_when_autograd_stores_them() -> None:
    model, adapters = _lora_like()
    with MemoryTracker() as tr:
        tr.track_existing(list(model.parameters()), "frozen_params")
        tr.reclassify(model)
        tr.watch_gradients(model)
        tr.context = "temporary"
        x = torch.randn(3, 32)
        loss = ((x @ adapters[0].T) @ adapters[1].T).sum()
        loss.backward()
        del loss, x
        assert tr.categories()["gradients"] == (4 * 32 + 48 * 4) * 4
        assert tr.categories()["adapter"] == (4 * 32 + 48 * 4) * 4
        tr.unwatch()


# -- storage resize_ (FSDP2 frees gathered parameters this way) -----------------------------------------------------


def test_a_storage_resize_is_counted_at_once() -> None:
    """``untyped_storage().resize_`` is no tensor op: FSDP2's free (resize to 0) and re-allocation must still count."""
    import torch

    with MemoryTracker() as tr:
        t = torch.empty(1000, dtype=torch.float32)
        assert tr.current == 4000
        t.untyped_storage().resize_(0)
        assert tr.current == 0
        t.untyped_storage().resize_(8000)
        assert tr.current == 8000 and tr.peak == 8000


def test_the_resize_wrapper_is_removed_whatever_the_exit_order() -> None:
    import torch

    outer, inner = MemoryTracker(), MemoryTracker()
    outer.__enter__()
    a = torch.empty(100)
    inner.__enter__()
    a.untyped_storage().resize_(0)
    assert outer.current == 0  # the outer tracker hears of resizes while an inner one is active
    inner.__exit__(None, None, None)
    assert "resize_" in torch.UntypedStorage.__dict__  # the outer one still tracks
    outer.__exit__(None, None, None)
    assert "resize_" not in torch.UntypedStorage.__dict__
    with pytest.raises(RuntimeError), MemoryTracker():
        raise RuntimeError("boom")
    assert "resize_" not in torch.UntypedStorage.__dict__


MATMULS = {
    "mm": lambda a, b: torch.mm(a, b),
    "addmm": lambda a, b: torch.addmm(a.new_zeros(4, 4), a, b),
    "bmm": lambda a, b: torch.bmm(a[None], b[None]),
    "baddbmm": lambda a, b: torch.baddbmm(a.new_zeros(1, 4, 4), a[None], b[None]),
}


#: whether torch's own meta kernel (what fake tensors run) refuses mixed dtypes (torch 2.13: bmm/baddbmm do)
META_CHECKS = {"mm": False, "addmm": False, "bmm": True, "baddbmm": True}


@pytest.mark.parametrize("op", sorted(MATMULS))
def test_a_mixed_dtype_matrix_product_fails_in_the_simulation_as_it_fails_for_real(op: str) -> None:
    """The real CPU kernel refuses fp32 x bf16 operands; the meta kernels fake tensors run for ``mm``/``addmm`` do
    not (so a simulation would go on with figures for a step that cannot run); under the tracker every fake product
    of mixed dtypes fails, by :class:`MixedDtypeMatmul`. Same-dtype operands pass everywhere."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ledgerspec.derivations.engine.tracker import MixedDtypeMatmul

    run = MATMULS[op]
    with pytest.raises(RuntimeError, match=r"dtype|scalar type"):  # the truth: the real kernel
        run(torch.ones(4, 4), torch.ones(4, 4, dtype=torch.bfloat16))
    with FakeTensorMode():  # the gap (mm, addmm): their meta kernels check no dtypes
        if META_CHECKS[op]:
            with pytest.raises(RuntimeError, match=r"dtype|scalar type"):
                run(torch.ones(4, 4), torch.ones(4, 4, dtype=torch.bfloat16))
        else:
            run(torch.ones(4, 4), torch.ones(4, 4, dtype=torch.bfloat16))
    with FakeTensorMode(), MemoryTracker():
        with pytest.raises(MixedDtypeMatmul, match="float32 and bfloat16"):
            run(torch.ones(4, 4), torch.ones(4, 4, dtype=torch.bfloat16))
        run(torch.ones(4, 4, dtype=torch.bfloat16), torch.ones(4, 4, dtype=torch.bfloat16))


def test_index_add_of_another_dtype_fails_in_the_simulation_as_it_fails_for_real() -> None:
    """``index_add_`` of a float32 source into a bfloat16 buffer: the real CPU kernel refuses it ("must have the
    same scalar type"), the meta kernel fake tensors run does not (torch 2.13), the tracker does
    (:class:`MixedDtypeMatmul`; transformers 4.57.6's DeepSeek-V3 MoE loop under k-bit preparation). The int64 index
    is no operand: same-dtype self and source pass."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ledgerspec.derivations.engine.tracker import MixedDtypeMatmul

    def run(dtype: Any) -> None:
        torch.zeros(4, 3, dtype=torch.bfloat16).index_add_(0, torch.tensor([0, 2]), torch.ones(2, 3, dtype=dtype))

    with pytest.raises(RuntimeError, match="must have the same scalar type"):  # the truth: the real kernel
        run(torch.float32)
    with FakeTensorMode():  # the gap
        run(torch.float32)
    with FakeTensorMode(), MemoryTracker():
        with pytest.raises(MixedDtypeMatmul, match=r"index_add_.* of bfloat16 and float32"):
            run(torch.float32)
        run(torch.bfloat16)


def test_a_step_that_cannot_run_is_reported_as_such_not_simulated(tmp_path: Any, monkeypatch: Any) -> None:
    """PEFT casts a LoRA layer's input to the adapter's dtype; with that cast off (what PEFT's own
    ``peft.helpers.disable_input_dtype_casting`` does), fp32 adapters on a bf16 base without autocast cannot run:
    the real step fails in ``F.linear`` (the truth, run here on real CPU tensors), and ``estimate`` says the declared
    step cannot run, at one line, instead of giving figures."""
    import shutil

    pytest.importorskip("peft")
    from peft.tuners.tuners_utils import BaseTunerLayer

    from ledgerspec.contract.document import load
    from ledgerspec.derivations.estimate.estimator import estimate
    from ledgerspec.derivations.measure.measurer import make_request, run_request
    from ledgerspec.errors import LedgerspecError
    from tests.support import TESTS

    data = TESTS / "data" / "sharding"
    shutil.copytree(data / "tiny", tmp_path / "tiny")
    text = (data / "tiny-lora-bf16-r2.ledger.yaml").read_text(encoding="utf-8")
    path = tmp_path / "bf16.ledger.yaml"
    one_device = text.split("\nmemory_options:")[0] + "\nmemory_options:\n  gradient_checkpointing: false\n"
    path.write_text(one_device, encoding="utf-8")  # one device, no autocast
    monkeypatch.setattr(BaseTunerLayer, "_cast_input_dtype", lambda self, x, dtype: x)
    with pytest.raises(RuntimeError, match="dtype"):  # the real run
        run_request(make_request(load(path), "cpu", 2, None, None))
    with pytest.raises(LedgerspecError) as caught:
        estimate(load(path), target="cpu")
    assert "the declared step cannot run: aten.mm.default of " in str(caught.value)
    assert "bfloat16" in str(caught.value) and "float32" in str(caught.value)


def test_a_profiler_range_in_a_fake_session_skips_the_modes_below_the_tracker_and_still_reaches_the_profiler() -> None:
    """``record_function`` (FSDP1 opens one around each hook of each unit) takes and makes no tensor: in a session of
    fake tensors the tracker runs its two operators below the Python modes (``tracker._profiler_marks``), so no mode
    under the tracker (PyTorch's fake mode among them) dispatches them, and a running profiler still records the
    range; the tensors inside it are tracked as before."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):  # between the fake mode and the tracker: what the tracker passes down
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with FakeTensorMode(), Seen() as seen, MemoryTracker() as tr:
            with record_function("ledgerspec-range"):
                a = torch.empty(256)
            assert tr.current == 1024
            del a
    assert "ledgerspec-range" in {e.name for e in prof.events()}
    assert [op for op in seen.ops if "profiler" in op] == []
    assert any("empty" in op for op in seen.ops)  # what the range holds still goes down

    with FakeTensorMode(), Seen() as seen:  # without the tracker both operators go down the modes
        with record_function("ledgerspec-range"):
            pass
    assert [op for op in seen.ops if "profiler" in op] == [
        "profiler._record_function_enter_new.default",
        "profiler._record_function_exit._RecordFunction",
    ]


# -- the allocation event log (replayed by ledgerspec.derivations.allocator) ---------------------------------------


def test_the_event_log_is_off_by_default() -> None:
    with MemoryTracker(granularity=512) as tr:
        a = torch.empty(100)
        tr.mark("forward")
        del a
    assert tr.events is None


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_the_event_log_records_requests_in_order(fake: bool) -> None:
    """What the caching allocator is asked: one request per new storage, with the bytes requested (the allocator
    rounds them itself), none for views, in-place ops or empty storages (``NativeCachingAllocator::allocate`` calls
    ``malloc`` only ``if (size != 0)``), a free when the storage dies, markers where they were set."""
    with maybe_fake(fake), MemoryTracker(granularity=512, events=True) as tr:
        a = torch.empty(3, dtype=torch.uint8)
        tr.mark("next")
        b = torch.empty(129, dtype=torch.float32)
        view = b[1:5]
        b.add_(1.0)
        empty = torch.empty(0)
        del a
        gc.collect()
        assert tr.current == 1024  # the tracker's own count: 516 B rounded to 1024
    assert tr.events is not None
    ids = [e[1] for e in tr.events if e[0] == "alloc"]
    assert tr.events == [("alloc", ids[0], 3, 0), ("phase", "next"), ("alloc", ids[1], 516, 0), ("free", ids[0])]
    del b, view, empty


def test_a_storage_resize_is_logged_as_the_gpu_does_it() -> None:
    """``resize_bytes_cuda`` (aten/src/ATen/native/cuda/Resize.cpp): ``size_bytes == 0`` replaces the data pointer
    with null (the old buffer is freed, nothing allocated); otherwise ``allocator->allocate(size_bytes)`` runs
    first and the old buffer is freed when ``set_data_ptr_noswap`` overwrites it: alloc new, then free old."""
    with MemoryTracker(granularity=512, events=True) as tr:
        t = torch.empty(1000, dtype=torch.float32)
        storage = t.untyped_storage()
        storage.resize_(0)  # FSDP2's free of a gathered parameter
        storage.resize_(8000)  # and its gathering again
        storage.resize_(6000)
        storage.resize_(6000)  # no change: nothing asked
    assert tr.events is not None
    kinds = [(e[0], e[2] if e[0] == "alloc" else None) for e in tr.events]
    assert kinds == [("alloc", 4000), ("free", None), ("alloc", 8000), ("alloc", 6000), ("free", None)]
    first, _, second, third, last = tr.events
    assert tr.events[1][1] == first[1] and last[1] == second[1] and third[1] not in (first[1], second[1])
    del t
