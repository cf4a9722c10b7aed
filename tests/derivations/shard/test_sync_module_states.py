"""FSDP1's ``sync_module_states`` in a simulated rank's allocation stream (issue 23, :mod:`.shard.fsdp.sync`).

Independent truths:

- torch's own bucketing, ``torch._C._distributed_c10d._compute_bucket_assignment_by_size`` (what the C++
  ``broadcast_coalesced`` calls), asked of real tensors, and the in-flight rule of ``comm.cpp`` (at most two flat
  buckets alive; a bucket's only tensor is broadcast in place, ``flatten_dense_tensors`` returning a view);
- the sequence real FSDP1 makes on two gloo ranks of real CPU tensors (``tests/truths/sync_module_states_probe.py``,
  committed as ``tests/data/sync_module_states/tiny-2ranks.json`` with its command and versions): the tensors each
  unit broadcasts, in order, and the flat buckets' allocations and frees.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import load
from tests.support import DATA

LEDGER = DATA / "sharding" / "tiny-lora-fsdp1-sync.ledger.yaml"
TRUTH = DATA / "sync_module_states" / "tiny-2ranks.json"
#: ``--bucket`` of the committed truth (PARAM_BROADCAST_BUCKET_SIZE for the tiny model: several buckets per unit)
BUCKET = 65536


def _expected(sizes: list[int], buckets: list[list[int]]) -> list[tuple[str, int]]:
    """The flat buckets' allocations and frees by comm.cpp's rule: each bucket of more than one tensor flattened into
    a new tensor of their bytes; before the third is flattened the oldest is finished and freed; then the rest in
    order. ``("alloc", bucket)`` / ``("free", bucket)``."""
    out: list[tuple[str, int]] = []
    flight: list[int] = []
    for b, bucket in enumerate(buckets):
        if len(flight) >= 2:
            done = flight.pop(0)
            if len(buckets[done]) > 1:
                out.append(("free", done))
        flight.append(b)
        if len(bucket) > 1:
            out.append(("alloc", b))
    out.extend(("free", b) for b in flight if len(buckets[b]) > 1)
    return out


@pytest.mark.slow  # imports torch.distributed.fsdp (a few seconds) for a second of work
def test_the_buckets_and_the_flights_are_torchs() -> None:
    """Real CPU tensors of two dtypes through FSDP1's own ``_sync_module_params_and_buffers`` (fake process group):
    the tracker logs one allocation per bucket of several tensors, of their bytes, in torch's bucket order, at most
    two alive, each freed pending (used on the NCCL stream); a lone tensor is broadcast in place (no allocation) and
    its storage's later free is pending too; buffers go first and only once."""
    import torch
    import torch.distributed.fsdp._init_utils as init_utils

    from ledgerspec.derivations.engine.tracker import MemoryTracker
    from ledgerspec.derivations.shard.fsdp import sync
    from ledgerspec.derivations.shard.simulation import fake_process_group

    tracker = MemoryTracker(events=True)
    with tracker:
        module = torch.nn.Module()
        module.register_buffer("table", torch.zeros(300))  # float32, 1,200 B
        shapes = [(100, 3), (50,), (700,), (20, 5), (10,), (600,), (30,)]
        bf16, f32 = torch.bfloat16, torch.float32
        dtypes = [bf16, f32, bf16, f32, bf16, f32, bf16]
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
            module.register_parameter(f"p{i}", torch.nn.Parameter(torch.ones(shape, dtype=dtype)))
    states: list[Any] = [module.get_buffer("table"), *module.parameters()]
    sizes = [int(t.numel() * t.element_size()) for t in states]
    limit = 1000
    buckets, _ = torch._C._distributed_c10d._compute_bucket_assignment_by_size(states, [limit])
    assert len(buckets) >= 4 and any(len(b) == 1 for b in buckets) and any(len(b) > 1 for b in buckets)
    saved = init_utils.PARAM_BROADCAST_BUCKET_SIZE
    init_utils.PARAM_BROADCAST_BUCKET_SIZE = limit
    try:
        with fake_process_group(1, 2), sync.broadcasting(tracker, 7) as seen, tracker:
            group = torch.distributed.distributed_c10d._get_default_group()
            init_utils._sync_module_params_and_buffers(module, list(module.parameters()), group)
            init_utils._sync_module_params_and_buffers(module, [], group)  # the buffer was broadcast already
    finally:
        init_utils.PARAM_BROADCAST_BUCKET_SIZE = saved
    assert seen.tensors == [sizes, []]  # the second call had nothing left to broadcast
    first, end = seen.spans[0]
    assert tracker.events is not None
    events = tracker.events[first:end]
    several = [b for b in range(len(buckets)) if len(buckets[b]) > 1]
    ids = {e[1]: b for b, e in zip(several, [e for e in events if e[0] == "alloc"], strict=True)}
    got = [(e[0], ids[e[1]]) for e in events if e[0] in ("alloc", "free")]
    assert got == _expected(sizes, buckets)
    for e in events:
        if e[0] == "alloc":
            assert e[2] == sum(sizes[i] for i in buckets[ids[e[1]]]) and e[3] == 0
        if e[0] == "free":
            assert e[2:] == ("pending",)
    lone = [states[b[0]] for b in buckets if len(b) == 1]
    pending = tracker.pending_frees
    with tracker:
        del states, module
        lone.clear()
    assert tracker.pending_frees - pending == sum(1 for b in buckets if len(b) == 1)


@pytest.mark.slow  # imports torch.distributed.fsdp
def test_the_4bit_quantization_constants_are_not_broadcast() -> None:
    """The simulation's fake 4-bit layer holds absmax, code and the nested state as buffers; in a real run they are a
    bitsandbytes ``QuantState``'s attributes, which FSDP1 does not broadcast: only its packed weight goes."""
    from types import SimpleNamespace

    import torch
    import torch.distributed.fsdp._init_utils as init_utils

    from ledgerspec.derivations.engine.tracker import MemoryTracker
    from ledgerspec.derivations.estimate.qlora import fake_4bit_linear_class
    from ledgerspec.derivations.shard.fsdp import sync
    from ledgerspec.derivations.shard.simulation import fake_process_group

    weight = SimpleNamespace(quant_storage=torch.bfloat16, blocksize=64, compress_statistics=True)
    src = SimpleNamespace(weight=weight, out_features=64, in_features=32, bias=None, compute_dtype=torch.bfloat16)
    module = torch.nn.Sequential(fake_4bit_linear_class()(src, torch.bfloat16), torch.nn.LayerNorm(64))
    module.to_empty(device="cpu")
    assert len(list(module.buffers())) == 5
    tracker = MemoryTracker(events=True)
    with fake_process_group(0, 2), sync.broadcasting(tracker, 7) as seen, tracker:
        group = torch.distributed.distributed_c10d._get_default_group()
        init_utils._sync_module_params_and_buffers(module, list(module.parameters()), group)
    assert seen.tensors == [[p.numel() * p.element_size() for p in module.parameters()]]


def test_the_field_is_read_with_accelerates_default(tmp_path: Path) -> None:
    from ledgerspec.derivations.shard.options import fsdp1_options

    text = LEDGER.read_text(encoding="utf-8")
    (tmp_path / "tiny").symlink_to(LEDGER.parent / "tiny")
    absent = tmp_path / "absent.ledger.yaml"
    absent.write_text(text.replace("  sync_module_states: true\n", ""), encoding="utf-8")
    bad = tmp_path / "bad.ledger.yaml"
    bad.write_text(text.replace("sync_module_states: true", "sync_module_states: maybe"), encoding="utf-8")
    assert fsdp1_options(load(LEDGER)).sync_module_states is True
    assert fsdp1_options(load(absent)).sync_module_states is False
    with pytest.raises(Exception, match="sync_module_states must be true or false"):
        fsdp1_options(load(bad))


def _unknown(tmp_path: Path, old: str, new: str, key: str) -> tuple[Path, int]:
    """The tiny FSDP1 ledger with ``old`` replaced by ``new`` (once) beside its model, and the line declaring
    ``key`` UNKNOWN (or CONFIGURATION-SPECIFIC) in it."""
    text = LEDGER.read_text(encoding="utf-8")
    assert old in text
    text = text.replace(old, new, 1)
    (tmp_path / "tiny").symlink_to(LEDGER.parent / "tiny")
    path = tmp_path / "unknown.ledger.yaml"
    path.write_text(text, encoding="utf-8")
    line = next(i for i, t in enumerate(text.splitlines(), 1) if t.strip().startswith(f"{key}: "))
    return path, line


SWITCHES = [
    "sync_module_states",
    "forward_prefetch",
    "limit_all_gathers",
    "use_orig_params",
    "activation_checkpointing",
]


@pytest.mark.parametrize("key", SWITCHES)
def test_an_unknown_fsdp1_switch_is_an_error_at_its_line_not_the_default(tmp_path: Path, key: str) -> None:
    """UNKNOWN is not "absent": the simulated step needs the switch, so it is not read as FSDP1's default."""
    from ledgerspec.derivations.shard.options import fsdp1_options
    from ledgerspec.errors import EXIT_USAGE, LedgerspecError

    unknown, line = _unknown(tmp_path, "  sync_module_states: true\n", f"  {key}: UNKNOWN\n", key)
    with pytest.raises(LedgerspecError) as caught:
        fsdp1_options(load(unknown))
    assert caught.value.exit_code == EXIT_USAGE
    assert f":{line}:" in str(caught.value)
    assert f"{key} must be true or false (it is UNKNOWN" in str(caught.value)


def test_an_unknown_backward_prefetch_is_an_error_at_its_line(tmp_path: Path) -> None:
    from ledgerspec.derivations.shard.options import fsdp1_options
    from ledgerspec.errors import EXIT_USAGE, LedgerspecError

    unknown = "parallelism:\n  backward_prefetch: UNKNOWN\n"
    path, line = _unknown(tmp_path, "parallelism:\n", unknown, "backward_prefetch")
    with pytest.raises(LedgerspecError) as caught:
        fsdp1_options(load(path))
    assert caught.value.exit_code == EXIT_USAGE and f":{line}:" in str(caught.value)
    assert "backward_prefetch is UNKNOWN" in str(caught.value)


def test_the_truth_is_a_real_broadcast() -> None:
    """The committed observation: both ranks hold rank 0's weights after the wrapping (they drew different ones), and
    torch's bucketing of the logged tensors is the one logged."""
    truth = json.loads(TRUTH.read_text(encoding="utf-8"))
    assert [r["same_weights_as_rank0"] for r in truth["ranks"]] == [True, True]
    assert {r["bucket_size"] for r in truth["ranks"]} == {BUCKET}
    for r in truth["ranks"]:
        for call in r["calls"]:
            sizes = [t["bytes"] for t in call["tensors"]]
            allocs = [e[2] for e in call["events"] if e[0] == "alloc"]
            assert allocs == [sum(sizes[i] for i in b) for b in call["buckets"] if len(b) > 1]
            assert sorted(e[1] for e in call["events"] if e[0] == "free") == list(range(len(allocs)))


@pytest.fixture(scope="module")
def simulated() -> dict[str, Any]:
    """The tiny FSDP1 ledger's estimate with its streams (``sync_module_states`` replayed, the truth's bucket size)
    and without (the plain simulation: no stream, nothing broadcast)."""
    pytest.importorskip("peft")
    import torch.distributed.fsdp._init_utils as init_utils

    from ledgerspec.derivations.shard.fsdp import simulate, sync
    from ledgerspec.derivations.shard.model import document_descriptors

    seen: list[Any] = []
    original = sync.broadcasting

    @contextlib.contextmanager
    def keep(*args: Any) -> Iterator[Any]:
        with original(*args) as broadcasts:
            seen.append(broadcasts)
            yield broadcasts

    doc = load(LEDGER)
    saved = init_utils.PARAM_BROADCAST_BUCKET_SIZE
    init_utils.PARAM_BROADCAST_BUCKET_SIZE = BUCKET
    sync.broadcasting = keep  # type: ignore[assignment]
    try:
        descs = document_descriptors(doc)
        with_sync = simulate.estimate_per_rank(doc, 2, descs, target="cuda", streams=True)
        plain = simulate.estimate_per_rank(doc, 2, descs, target="cuda")  # no stream: nothing broadcast
    finally:
        sync.broadcasting = original
        init_utils.PARAM_BROADCAST_BUCKET_SIZE = saved
    return {"with": with_sync, "without": plain, "seen": seen}


@pytest.mark.slow
def test_the_simulated_rank_broadcasts_what_fsdp1_broadcasts(simulated: dict[str, Any]) -> None:
    """Unit by unit, the tensors broadcast and the flat buckets allocated are the real run's (every rank the same),
    each free pending on the NCCL stream."""
    truth = json.loads(TRUTH.read_text(encoding="utf-8"))
    seen = simulated["seen"]
    assert len(seen) == 1
    step = simulated["with"].ranks[0].step
    assert step is not None
    for r in truth["ranks"]:
        assert seen[0].tensors == [[t["bytes"] for t in c["tensors"]] for c in r["calls"]]
    events = step.events
    for (first, end), call in zip(seen[0].spans, truth["ranks"][0]["calls"], strict=True):
        got = [e for e in events[first:end] if e[0] in ("alloc", "free")]
        assert [e[2] for e in got if e[0] == "alloc"] == [e[2] for e in call["events"] if e[0] == "alloc"]
        assert all(e[2:] == ("pending",) for e in got if e[0] == "free")
        live = peak = 0
        for e in got:
            live += 1 if e[0] == "alloc" else -1
            peak = max(peak, live)
        assert peak <= 2 and live == 0


@pytest.mark.slow
def test_the_held_bytes_do_not_change(simulated: dict[str, Any]) -> None:
    """The flat buckets are freed during the load: every allocated figure is the plain simulation's (which broadcasts
    nothing); only the load window's peak may grow (two flat buckets beside a unit), and the stream gains syncs."""
    a, b = simulated["with"].ranks, simulated["without"].ranks
    for x, y in zip(a, b, strict=True):
        assert x.phases == y.phases
    step = a[0].step
    assert step is not None
    assert step.tracker_windows[step.windows[0]][1] == b[0].phases["after_load"]
    start = step.events.index(("phase", step.windows[0]))
    end = step.events.index(("phase", step.windows[1]))
    syncs = [e for e in step.events[start:end] if e[0] == "sync"]
    # each unit's pending frees complete once, when the next unit starts or the wrapping ends
    assert syncs == [("sync", 0)] * sum(1 for sizes in simulated["seen"][0].tensors if sizes)


@pytest.mark.parametrize(
    ("declared", "replaced"),
    [
        ("  reshard_after_forward: UNKNOWN\n", "  reshard_after_forward: true\n"),
        ("  cpu_offload: UNKNOWN\n", "  sync_module_states: true\n"),
        ("  sharding: fsdp1\n  cpu_offload: CONFIGURATION-SPECIFIC\n", "  sharding: fsdp1\n"),
    ],
)
def test_an_unknown_sharding_switch_stops_shard_at_its_line(tmp_path: Path, declared: str, replaced: str) -> None:
    """``shard`` (no simulation) reads reshard_after_forward and CPU offload for its per-rank plan: declared UNKNOWN
    they are one line at their place, exit 2, not the default read silently."""
    from tests.support import run_cli

    new = declared if "cpu_offload: UNKNOWN" not in declared else replaced + declared
    key = next(t for t in declared.splitlines() if "UNKNOWN" in t or "SPECIFIC" in t).strip().split(":")[0]
    path, line = _unknown(tmp_path, replaced, new, key)
    code, out, err = run_cli("shard", path, "--check")
    assert code == 2, (out, err)
    assert f"{path}:{line}:" in err and "the sharded step depends on it" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2  # the error and its hint
