"""The fake-tensor mode of traced steps (:mod:`ledgerspec.derivations.engine.fakemode`) against PyTorch's own.

The truth is PyTorch's ``FakeTensorMode`` itself: the same operators on the same fake tensors must give outputs of
the same metadata, and a whole traced step the same allocation stream and figures, event by event.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")


def _metadata(t: Any) -> tuple[Any, ...]:
    return (
        t.dtype,
        tuple(t.shape),
        t.stride(),
        str(t.device),
        t.storage_offset(),
        t.untyped_storage().nbytes(),
        t.requires_grad,
        t.is_conj(),
        t.is_neg(),
    )


def _battery(mode: Any) -> list[tuple[Any, ...]]:
    """Operators whose outputs depend on each field of their inputs' metadata, twice over (the second time from
    the dispatch cache), on fake tensors of ``mode`` and a real one (converted at each use). On the CPU: fake
    CUDA tensors cannot run autograd on a CPU-only torch (the estimate traces CPU fakes too)."""
    import torch

    real = torch.arange(6, dtype=torch.float32)  # a real tensor given to operators on fake ones
    out: list[tuple[Any, ...]] = []
    with mode:
        for _ in range(2):
            a = torch.empty(4, 6, dtype=torch.bfloat16, device="cpu")
            b = torch.empty(4, 6, dtype=torch.float32, device="cpu", requires_grad=True)
            c = torch.empty(4, 6, dtype=torch.float32, device="cpu")
            cases = [
                a.t(),
                a.t().contiguous(),
                a.view(24),
                a[1:].view(18),
                a[:, 1:],
                a[:, 1:].contiguous(),
                a.t().reshape(24),
                b * 2,
                (b * 2).sum(),
                c + real,
                real + c,
                torch.cat([c, c[:1]], dim=0),
                torch.stack([c, c]),
                torch.mm(a, a.t()),
                torch.mm(a.t(), a),
                a.to(torch.float16),
                a.new_empty((3,)),
                torch.empty_like(a.t()),
                torch.empty_like(a.t(), memory_format=torch.contiguous_format),
                torch.nn.functional.linear(a, a),
                torch.ops.aten._unsafe_view(a, [24]),
                torch.complex(b.detach(), b.detach()).conj(),
                torch.where(a > 0, a, a.t().t()),
                a.expand(2, 4, 6).reshape(8, 6),
                torch.narrow(a, 1, 2, 3).sum(dim=1, keepdim=True),
                torch.matmul(a.view(2, 2, 6), a.t()),  # ends with aten._unsafe_view
                torch.ops.aten._unsafe_view(c[1:], [3, 6]),
            ]
            out.extend(_metadata(t) for t in cases)
            (x, y) = torch._foreach_mul([a.float(), b.detach()], 3.0)
            out.extend([_metadata(x), _metadata(y)])
    return out


def test_a_fake_tensors_device_is_what_the_fake_mode_says() -> None:
    """The tracker's answer to a device query, in and out of a kernel invocation, is FakeTensor's own."""
    import torch
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    from ledgerspec.derivations.engine.fakemode import fake_mode
    from ledgerspec.derivations.engine.tracker import MemoryTracker, _device_query

    assert _device_query()[0] is torch.ops.prim.device.default
    mode = fake_mode()
    with mode:
        t = torch.empty(3, device="cuda")
        bare = torch.ops.prim.device.default(t)
        with MemoryTracker():
            tracked = torch.ops.prim.device.default(t)
            with in_kernel_invocation_manager(mode):
                inside = torch.ops.prim.device.default(t)
        with in_kernel_invocation_manager(mode):
            bare_inside = torch.ops.prim.device.default(t)
    assert (tracked, inside) == (bare, bare_inside) == (torch.device("cuda", 0), torch.device("meta"))


def test_the_installed_torch_has_the_fields_the_fast_key_writes() -> None:
    """Pinned to the torch this project installs (2.13): the fast key is on there; another torch whose
    ``TensorMetadata`` differs gets PyTorch's own key (tested by the next test's fallback)."""
    import torch

    from ledgerspec.derivations.engine.fakemode import fast_key_supported

    if not torch.__version__.startswith("2.13."):
        pytest.skip(f"pinned to torch 2.13, not {torch.__version__}")
    assert fast_key_supported()


def test_the_installed_torch_has_the_functions_the_fast_output_writes_out() -> None:
    """Pinned to the torch this project installs (2.13): the written-out output path is on there; a torch whose
    functions differ from those it was read from gets PyTorch's own (the next test)."""
    import torch

    from ledgerspec.derivations.engine.fakemode import fast_output_supported

    if not torch.__version__.startswith("2.13."):
        pytest.skip(f"pinned to torch 2.13, not {torch.__version__}")
    assert fast_output_supported()


def test_a_torch_whose_functions_differ_gets_pytorch_own_output_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """One function's source not the one recorded: PyTorch's own ``_get_output_tensor_from_cache_entry``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ledgerspec.derivations.engine import fakemode

    recorded = {release: dict(functions) for release, functions in fakemode.OUTPUT_CHECKED.items()}
    for functions in recorded.values():
        functions["FakeTensor.__new__"] = "0" * 64
    monkeypatch.setattr(fakemode, "OUTPUT_CHECKED", recorded)
    fakemode.fast_output_supported.cache_clear()
    fakemode._mode_class.cache_clear()
    try:
        assert not fakemode.fast_output_supported()
        mode_class = type(fakemode.fake_mode())
        assert mode_class._get_output_tensor_from_cache_entry is FakeTensorMode._get_output_tensor_from_cache_entry
    finally:
        monkeypatch.undo()
        fakemode.fast_output_supported.cache_clear()
        fakemode._mode_class.cache_clear()
    assert (
        type(fakemode.fake_mode())._get_output_tensor_from_cache_entry
        is not (FakeTensorMode._get_output_tensor_from_cache_entry)
        or not fakemode.fast_output_supported()
    )


def _made(mode: Any) -> list[tuple[Any, ...]]:
    """Every attribute of the fake tensors a few cache hits make (a plain output, a view, a view of a view, an
    output that requires grad, a tuple), and whether a view shares its input's storage."""
    import torch

    out: list[tuple[Any, ...]] = []
    with mode:
        for _ in range(2):  # the second time from the dispatch cache
            a = torch.empty(4, 6, dtype=torch.bfloat16, device="cuda")
            g = torch.empty(4, 6, device="cpu", requires_grad=True)  # autograd on fake CUDA needs CUDA
            made = [a * 2, a.t(), torch.narrow(a, 0, 1, 3).view(18), g * 2, *torch.split(a, 2)]
            made.append(torch.matmul(a.view(2, 2, 6), a.t()))  # ends with aten._unsafe_view
            for t in made:
                attributes = {k: v for k, v in vars(t).items() if k != "fake_mode"}
                out.append(
                    (
                        type(t).__name__,
                        sorted(attributes.items(), key=lambda kv: kv[0]),
                        getattr(t, "fake_mode", None) is mode,
                        str(torch._C._dispatch_keys(t)),
                        t.requires_grad,
                        t._is_view(),
                        t.untyped_storage()._cdata == a.untyped_storage()._cdata,
                        _metadata(t),
                    )
                )
    return out


def test_the_written_out_output_makes_the_tensor_pytorch_makes() -> None:
    """A cache hit's fake tensor from the written-out path (module docstring, 3.) has every attribute, dispatch key
    and storage PyTorch's own path gives it."""
    from ledgerspec.derivations.engine.fakemode import fake_mode, fast_output_supported, stock_mode

    if not fast_output_supported():
        pytest.skip("this torch gets PyTorch's own output path")
    assert _made(fake_mode()) == _made(stock_mode())


def test_an_unsafe_view_asked_again_is_made_from_what_the_first_gave(monkeypatch: pytest.MonkeyPatch) -> None:
    """``aten._unsafe_view`` (module docstring, 4.): run afresh once per input and size, then made without running
    the operator, sharing its input's storage as the operator's own output does (PyTorch's cache runs every one)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ledgerspec.derivations.engine.fakemode import fake_mode, fast_output_supported, stock_mode

    if not fast_output_supported():
        pytest.skip("this torch gets PyTorch's own output path")
    ran: list[Any] = []
    real = FakeTensorMode._dispatch_impl

    def counted(self: Any, func: Any, *rest: Any) -> Any:
        ran.append(func)
        return real(self, func, *rest)

    monkeypatch.setattr(FakeTensorMode, "_dispatch_impl", counted)
    unsafe_view = torch.ops.aten._unsafe_view.default

    def views(mode: Any) -> list[tuple[Any, ...]]:
        out = []
        with mode:
            for shape in ((2, 12, 8), (2, 12, 8), (3, 12, 8), (2, 12, 8)):
                x = torch.empty(*shape, dtype=torch.bfloat16, device="cuda")
                y = unsafe_view(x, [shape[0] * 12, 8])
                out.append((_metadata(y), y.untyped_storage()._cdata == x.untyped_storage()._cdata, vars(y).keys()))
        return out

    stock = views(stock_mode())
    assert ran.count(unsafe_view) == 4  # PyTorch's own: every one run afresh
    ran.clear()
    assert views(fake_mode()) == stock
    assert all(same_storage for _, same_storage, _ in stock)
    assert ran.count(unsafe_view) <= 2  # the two shapes once each (none when an earlier test kept them)


def test_an_unsafe_view_across_inference_modes_is_what_pytorch_gives() -> None:
    """An input made outside inference mode and viewed inside it (and the reverse), twice each: the kept unsafe view
    is not used where the tensor it makes would differ (dispatch keys, inference flag) from the operator's own."""
    import torch

    from ledgerspec.derivations.engine.fakemode import fake_mode, stock_mode

    unsafe_view = torch.ops.aten._unsafe_view.default

    def made(mode: Any) -> list[tuple[Any, ...]]:
        out = []
        with mode:
            x = torch.empty(4, 6)
            with torch.inference_mode():
                inside = [unsafe_view(x, [24]) for _ in range(2)]
                y = torch.empty(4, 6)
            outside = [unsafe_view(y, [24]) for _ in range(2)]
            plain = [unsafe_view(x, [24]) for _ in range(2)]
            for t in inside + outside + plain:
                out.append((t.is_inference(), str(torch._C._dispatch_keys(t)), sorted(vars(t)), _metadata(t)))
        return out

    assert made(fake_mode()) == made(stock_mode())


def test_every_operator_gives_what_pytorch_own_fake_mode_gives() -> None:
    """The same outputs as PyTorch's own mode; and with PyTorch's cross-check on, every answer the dispatch cache
    gives under the fast key is compared with the operator run afresh (it raises on a difference)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ledgerspec.derivations.engine.fakemode import fake_mode, stock_mode

    checked = fake_mode(allow_non_fake_inputs=True)
    checked.cache_crosscheck_enabled = True
    hits = FakeTensorMode.cache_hits
    assert _battery(checked) == _battery(stock_mode(allow_non_fake_inputs=True))
    assert FakeTensorMode.cache_hits > hits  # the cache answered (the second pass of the battery at least)
    assert _battery(fake_mode(allow_non_fake_inputs=True)) == _battery(stock_mode(allow_non_fake_inputs=True))


def test_a_key_tells_apart_tensors_that_differ_in_one_field() -> None:
    """Two tensors differing in one field of their metadata never share a key (else the cache would answer one
    with the other's output)."""
    import torch
    from torch._subclasses.fake_tensor import _CacheKeyState

    from ledgerspec.derivations.engine.fakemode import fake_mode

    mode = fake_mode()
    with mode:
        base = torch.empty(4, 6, dtype=torch.bfloat16, device="cpu")
        variants = {
            "base": base,
            "dtype": torch.empty(4, 6, dtype=torch.float16, device="cpu"),
            "device": torch.empty(4, 6, dtype=torch.bfloat16, device="cuda"),
            "shape": torch.empty(6, 4, dtype=torch.bfloat16, device="cpu"),
            "stride": base.t().contiguous().t(),
            "offset": torch.empty(25, dtype=torch.bfloat16, device="cpu")[1:].view(4, 6),
            "storage": torch.empty(30, dtype=torch.bfloat16, device="cpu")[:24].view(4, 6),
            "requires_grad": torch.empty(4, 6, dtype=torch.bfloat16, device="cpu", requires_grad=True),
        }
        complex_base = torch.empty(4, 6, dtype=torch.complex64, device="cpu")
        variants["complex"] = complex_base
        variants["conj"] = complex_base.conj()
        variants["neg"] = torch._neg_view(complex_base)
        with torch.inference_mode():
            variants["inference"] = torch.empty(4, 6, dtype=torch.bfloat16, device="cpu")
    import torch as t

    keys = {name: mode._cache_key(_CacheKeyState(), t.ops.aten.clone.default, (v,), {}) for name, v in variants.items()}
    assert len(set(keys.values())) == len(keys), keys


CASES = {
    "lora": {"arch": "tiny-llama-gqa", "seq": 32},
    "qlora-ckpt-paged8bit": {
        "arch": "tiny-llama-gqa",
        "quant": "nf4",
        "checkpointing": True,
        "optimizer": "paged_adamw_8bit",
        "targets": "all-linear",
        "seq": 32,
        "accumulation": 2,
    },
    "gemma2-eager": {"arch": "tiny-gemma2", "attention": "eager", "seq": 32},
}


# the QLoRA case (checkpointing, a paged 8-bit optimizer, accumulation 2) is the costly one: the slow tier runs it, the
# edit loop keeps the two others as its guard of the fast trace
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c == "qlora-ckpt-paged8bit" else c for c in CASES]
)
def test_a_traced_step_is_the_one_pytorch_own_fake_mode_traces(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole step (every probe event and every figure) is the same under both modes; the reference also asks
    the fake mode for every device (the tracker answers a fake tensor's device query itself)."""
    from ledgerspec.derivations.allocator.step import step_events
    from ledgerspec.derivations.engine import fakemode, tracker
    from tests.support.estimate_docs import ledger

    doc = ledger(**CASES[case])
    assert tracker._device_query()[0] is not None  # the shortcut is on in the fast trace
    fast = step_events(doc, 2)
    monkeypatch.setattr(fakemode, "STOCK", True)
    monkeypatch.setattr(tracker, "_device_query", lambda: (None, None, None))
    tracker._mode_class.cache_clear()
    try:
        stock = step_events(doc, 2)
    finally:
        monkeypatch.undo()
        tracker._mode_class.cache_clear()
    assert fast.events == stock.events
    assert fast.figures == stock.figures
    assert fast.windows == stock.windows


def _empty_like_cases() -> list[Any]:
    import torch

    class Marked(torch.Tensor):  # a tensor subclass (empty_like keeps its type)
        pass

    with torch.device("meta"):
        cases = [
            torch.empty(16, 64, dtype=torch.float32),
            torch.empty((), dtype=torch.float32),
            torch.empty(0, 3, dtype=torch.float32),
            torch.empty(4096 * 64, 1, dtype=torch.uint8),
            torch.nn.Parameter(torch.empty(8, 4, dtype=torch.bfloat16), requires_grad=False),
            torch.nn.Parameter(torch.empty(8, 4, dtype=torch.float32)),
            torch.empty(8, 4, dtype=torch.float16).t(),  # not contiguous: empty_like itself
            torch.empty(2, 3, 4, dtype=torch.float32).permute(2, 0, 1),
            # contiguous (is_contiguous() holds) with strides other than torch.empty's, which empty_like keeps
            torch.empty_strided((8, 3, 1, 1), (3, 1, 3, 3), dtype=torch.float32),  # channels-last, 1x1
            torch.empty_strided((2, 1, 4, 4), (16, 1, 4, 1), dtype=torch.bfloat16),
            torch.empty_strided((3, 1, 1, 2), (2, 2, 7, 1), dtype=torch.float32),
            torch.empty(2, 3, 1, 1, 1, dtype=torch.float32).contiguous(memory_format=torch.channels_last_3d),
            torch.nn.Parameter(torch.empty_strided((8, 3, 1, 1), (3, 1, 3, 3), dtype=torch.float32)),
            torch.empty(4, 4, dtype=torch.float32).as_subclass(Marked),
        ]
    return cases


def _made_or_refused(make: Any, t: Any) -> tuple[Any, ...]:
    """What ``make(t)`` gives (its type and metadata), or the type of the error it raises."""
    try:
        made = make(t)
    except Exception as exc:  # PyTorch's fake mode refuses some subclasses: then both must refuse
        return ("raised", type(exc))
    return (type(made), _metadata(made))


def test_a_meta_parameter_is_materialised_as_empty_like_would() -> None:
    """``_empty_as`` (a factory instead of ``empty_like``, which converts the meta tensor into the fake mode first)
    gives what ``torch.empty_like(t, device=...)`` gives, in a fake mode and outside one: the type, dtype, shape and
    strides (empty_like keeps a contiguous tensor's own strides, channels-last with dimensions of size 1 too)."""
    import torch

    from ledgerspec.derivations.engine.fakemode import fake_mode
    from ledgerspec.derivations.engine.workload import _empty_as

    def ours(t: Any) -> Any:
        return _empty_as(t, "cpu")

    def theirs(t: Any) -> Any:
        return torch.empty_like(t, device="cpu")

    cases = _empty_like_cases()
    assert any(c.is_contiguous() and c.stride() != torch.empty(c.shape).stride() for c in cases)
    for mode in (fake_mode(allow_non_fake_inputs=True), None):
        for t in cases:
            if mode is None:
                assert _made_or_refused(ours, t) == _made_or_refused(theirs, t), t.shape
            else:
                with mode:
                    assert _made_or_refused(ours, t) == _made_or_refused(theirs, t), t.shape


def test_the_kept_quantization_maps_are_not_the_optimizers() -> None:
    """The fake copies of a bitsandbytes optimizer's quantization maps are kept by the workload, not on the
    optimizer: what walks an optimizer's attributes for the tensors it made (the callback's census) finds the same
    real maps as before, and none of the copies."""
    import bitsandbytes as bnb
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    from ledgerspec.derivations.engine.fakemode import fake_mode
    from ledgerspec.derivations.engine.workload import _converted_quantization_maps
    from ledgerspec.derivations.integrations.transformers import optimizer_tensors

    with fake_mode(allow_non_fake_inputs=True):
        params = [torch.nn.Parameter(torch.empty(64, 64))]
        with unset_fake_temporarily():
            opt = bnb.optim.AdamW(params, optim_bits=8, min_8bit_size=16)
        before = [id(x) for x in optimizer_tensors(opt)]
        kept = _converted_quantization_maps(opt)
    assert len(kept) == len(opt.name2qmap) == 2
    assert all(isinstance(k, FakeTensor) for k in kept)
    assert [id(x) for x in optimizer_tensors(opt)] == before
    assert not any(isinstance(x, FakeTensor) for x in optimizer_tensors(opt))


@pytest.mark.parametrize(
    "case",
    [
        # 8-bit states for the tiny model's adapter too (bitsandbytes keeps tensors under 4,096 elements in 32-bit)
        {**CASES["qlora-ckpt-paged8bit"], "optimizer": "paged_adamw_8bit\n  min_8bit_size: 16"},
        {**CASES["lora"], "optimizer": "adamw_8bit\n  min_8bit_size: 16"},  # bf16 parameters and buffers
    ],
    ids=["qlora-paged8bit", "lora-bf16-8bit"],
)
def test_a_traced_step_converts_no_meta_tensor_and_each_real_one_once(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A QLoRA step with a paged 8-bit optimizer and a bf16 LoRA step with an 8-bit one, traced: no parameter or
    buffer goes through PyTorch's meta converter, and each real tensor an operator is given (bitsandbytes'
    quantization maps, Python numbers made tensors) is converted once per fake mode; the step (every event and
    figure) is the one traced with ``empty_like`` and the maps converted at each update, as before."""
    from torch._subclasses.fake_tensor import FakeTensorConverter
    from torch.utils.weak import WeakIdKeyDictionary

    from ledgerspec.derivations.allocator.step import step_events
    from ledgerspec.derivations.engine import workload
    from tests.support.estimate_docs import ledger

    doc = ledger(**case)
    assert doc.get("optimizer", "min_8bit_size").integer() == 16
    converted: list[bool] = []  # each conversion: whether of a meta tensor
    again: list[str] = []
    seen: dict[int, WeakIdKeyDictionary] = {}  # per fake mode: the real tensors it converted, while they live
    convert = FakeTensorConverter.from_real_tensor

    def counted(self: Any, fake_mode: Any, t: Any, *args: Any, **kwargs: Any) -> Any:
        if self._get_memo(t) is None:
            converted.append(t.is_meta)
            done = seen.setdefault(id(fake_mode), WeakIdKeyDictionary())
            if t in done:
                again.append(f"{tuple(t.shape)} {t.dtype}")
            done[t] = True
        return convert(self, fake_mode, t, *args, **kwargs)

    monkeypatch.setattr(FakeTensorConverter, "from_real_tensor", counted)
    now = step_events(doc, 2)
    assert converted, "the counter saw no conversion: it counts nothing"
    assert not any(converted), "a meta tensor was converted"
    assert not again, f"{len(again)} conversions again in the same fake mode, the first of a {again[:1]} tensor"

    import torch

    converted.clear()
    monkeypatch.setattr(workload, "_empty_as", lambda t, device: torch.empty_like(t, device=device))
    monkeypatch.setattr(workload, "_converted_quantization_maps", lambda opt: [])
    before = step_events(doc, 2)
    assert any(converted), "empty_like converts each meta tensor: the comparison is the old path"
    assert now.events == before.events
    assert now.figures == before.figures
    assert now.windows == before.windows
