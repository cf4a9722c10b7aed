"""The cuda write-back of ``ledgerspec measure`` with a fake ``torch.cuda`` (:mod:`tests.support.fake_cuda`): a complete
cuda result becomes MEASURED figures with which the validator reaches VALIDATED; an out-of-memory is recorded with its
snapshot beside the ledger; every nccl rank needs its own GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import TESTS
from tests.support.fake_cuda import (
    CONTEXT,
    DEVICE_NAME,
    DRIVER,
    TOTAL,
    FakeCuda,
    FakeNVML,
    cuda_output,
    expected_phases,
    resolved_ledger,
    roundup,
    stack_versions,
)

# -- write-back and the status ladder ---------------------------------------------------------------------------------

DATA = TESTS / "data" / "measure"


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    """The tiny Llama ledger, resolved (CPU), with a target device and an activation estimate."""
    return resolved_ledger(tmp_path)


def test_write_back_records_measured_cuda_figures_and_the_ladder_reaches_validated(
    ledger: Path, fake_cuda: FakeCuda, fake_nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ledgerspec.checks.validate import validate
    from ledgerspec.contract.document import load
    from ledgerspec.contract.edit import set_plain
    from ledgerspec.derivations.measure.measurer import write_back

    out = cuda_output(fake_cuda, monkeypatch)
    doc = load(ledger)
    notes = write_back(doc, out, "ledgerspec measure tiny-llama-lora.yaml --device cuda --steps 2")
    assert not any("cpu backend" in n for n in notes)
    exp = expected_phases()
    for name, figure in exp.items():
        v = doc.get("phases", name)
        assert v.source == "MEASURED" and v.size() == figure, name
    top = roundup(max(exp.values()))
    figures = {k: doc.get("metrics", k) for k in ("peak_allocated", "peak_reserved", "device_peak")}
    assert {k: (v.source, v.size()) for k, v in figures.items()} == {
        "peak_allocated": ("MEASURED", max(exp.values())),
        "peak_reserved": ("MEASURED", top),
        "device_peak": ("MEASURED", CONTEXT + top),
    }
    assert "max_memory_reserved" in str(figures["peak_reserved"].method)
    assert "NVML per-process" in str(figures["device_peak"].method)
    assert doc.get("ledger", "activations").source == "MEASURED"
    software = {k: doc.get("software", k).value for k in ("cuda", "driver", "gpu_name", "torch", "peft")}
    assert software == {
        "cuda": "12.8",
        "driver": DRIVER,
        "gpu_name": DEVICE_NAME,
        "torch": stack_versions()["torch"],
        "peft": stack_versions()["peft"],
    }
    assert doc.get("measurement", "device").value == "cuda"
    assert doc.get("measurement", "device_name").value == DEVICE_NAME
    assert doc.get("measurement", "device_memory").size() == TOTAL
    assert doc.get("result", "oom").switch() is False
    report = validate(doc)
    assert not [f for f in report.findings if f.severity == "error"], report.findings
    # the fake run holds no real tensors, so the census cannot explain the difference: the one gap left is the
    # human's known_explanation (the spec leaves it to the human unless the measured categories explain it)
    assert report.supported_status == "CANDIDATE"
    assert report.reasons == ["VALIDATED needs comparison filled, with known_explanation"]
    set_plain(doc, ("comparison", "known_explanation"), "activations and temporaries (reviewed by a human)")
    report = validate(doc)
    assert report.supported_status == "VALIDATED", report.reasons
    assert not [f for f in report.findings if f.severity == "error"], report.findings


def test_measure_on_cuda_asks_for_a_snapshot_beside_the_ledger_and_writes_an_oom(
    ledger: Path, fake_cuda: FakeCuda, fake_nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ledgerspec.checks.validate import validate
    from ledgerspec.contract.document import load
    from ledgerspec.derivations.measure import measurer as M

    seen: list[Any] = []

    def child(req: Any, timeout: float | None = None) -> Any:  # the child process, replaced by the fakes
        seen.append(req)
        return cuda_output(fake_cuda, monkeypatch, req.snapshot_path, fail_at=("backward", 1))

    monkeypatch.setattr(M, "run_child", child)
    before = ledger.read_bytes()
    target = ledger.with_name("measured.yaml")
    from ledgerspec.contract.document import load_ledger
    from ledgerspec.contract.writer import save
    from ledgerspec.faces.status import settle

    measured = load_ledger(str(ledger), "measure")
    outcome = M.measure(measured, device="cuda", snapshot_path=M.snapshot_path_for(str(target)))
    settle(measured)
    save(measured, str(target))
    assert seen[0].device == "cuda" and seen[0].memory_limit is None
    assert seen[0].snapshot_path == str(target.with_name("measured.oom-snapshot.pickle"))
    assert Path(seen[0].snapshot_path).exists()
    assert ledger.read_bytes() == before
    doc = load(target)
    assert doc.get("result", "oom").switch() is True and doc.get("result", "oom_phase").value == "backward"
    assert doc.get("x-measure", "oom", "snapshot").value == seen[0].snapshot_path
    assert any("memory_viz" in n for n in outcome.notes)
    assert validate(doc).supported_status != "VALIDATED"
    findings = {f.rule for f in validate(doc).findings if f.severity == "error"}
    assert not findings & {"LS040", "LS070", "LS080"}, findings


# -- nccl --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("available", "count", "local_rank", "nproc", "needle"),
    [
        (False, 0, 0, 2, "no CUDA device"),
        (True, 1, 0, 2, "one GPU per rank"),  # two ranks on one GPU: nccl refuses; every rank says so
        (True, 1, 1, 2, "one GPU per rank"),
        (True, 8, 1, 2, None),
    ],
)
def test_each_nccl_rank_needs_its_own_gpu(
    available: bool, count: int, local_rank: int, nproc: int, needle: str | None
) -> None:
    from ledgerspec.derivations.measure.dist import cuda_rank_problem

    problem = cuda_rank_problem(available, count, local_rank, nproc)
    assert (problem is None) if needle is None else (needle in (problem or ""))


# -- outside the caching allocator (issue 23) ---------------------------------------------------------------------


def test_write_back_records_what_lay_outside_the_allocator_as_measured(
    ledger: Path, fake_cuda: FakeCuda, fake_nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch
) -> None:
    """outside_allocator.context = NVML before the first allocation, after_load = used - reserved at the end of the
    phase, total = device_peak - peak reserved at the device peak; the fake's modules load at the first forward."""
    from ledgerspec.checks.validate import validate
    from ledgerspec.contract.document import load
    from ledgerspec.derivations.measure.measurer import write_back

    fake_cuda.lazy_modules = 64 * 2**20
    doc = load(ledger)
    write_back(doc, cuda_output(fake_cuda, monkeypatch), "ledgerspec measure x --device cuda")
    got = {k: doc.get("outside_allocator", k) for k in ("context", "after_load", "total")}
    assert {k: (v.source, v.size()) for k, v in got.items()} == {
        "context": ("MEASURED", CONTEXT),
        "after_load": ("MEASURED", CONTEXT),
        "total": ("MEASURED", CONTEXT + 64 * 2**20),
    }
    assert "before the first allocation" in str(got["context"].method)
    assert "NVML per-process" in str(got["total"].method)
    # the device peak is the allocator's reserved peak plus what lay outside it
    assert doc.get("metrics", "device_peak").size() == (doc.get("metrics", "peak_reserved").size() or 0) + (
        got["total"].size() or 0
    )
    assert doc.get("x-measure", "context", "used").value == CONTEXT
    report = validate(doc)
    assert not [f for f in report.findings if f.severity == "error"], report.findings


def test_a_new_measurement_replaces_measured_outside_figures_and_keeps_a_declared_one(
    ledger: Path, fake_cuda: FakeCuda, fake_nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ledgerspec.contract.document import load
    from ledgerspec.contract.edit import set_figure
    from ledgerspec.derivations.measure.measurer import write_back

    doc = load(ledger)
    write_back(doc, cuda_output(fake_cuda, monkeypatch), "first")
    assert doc.get("outside_allocator", "context").source == "MEASURED"
    set_figure(doc, ("outside_allocator", "nccl"), "300 MiB", "ASSUMPTION", note="the user's own figure", force=True)
    cpu = cuda_output(fake_cuda, monkeypatch)
    cpu.result.backend = "cpu"  # a later cpu run reads no device: the cuda run's figures must not outlive it
    write_back(doc, cpu, "second")
    assert not doc.get("outside_allocator", "context").present
    assert not doc.get("outside_allocator", "total").present
    assert doc.get("outside_allocator", "nccl").size() == 300 * 2**20


def test_per_rank_outside_figures_and_the_worst_rank(fake_cuda: FakeCuda, fake_nvml: FakeNVML) -> None:
    """measure --nproc: one MEASURED figure per rank, the worst as total (never a sum)."""
    from ledgerspec.contract.document import from_text
    from ledgerspec.derivations.engine.protocol import ProtocolResult
    from ledgerspec.derivations.measure.dist import RankOutput, _write_outside
    from tests.support.fake_cuda import run_fake

    outs = []
    for rank, modules in ((0, 10 * 2**20), (1, 40 * 2**20)):
        cuda = FakeCuda()
        fake_nvml.cuda = cuda
        cuda.lazy_modules = modules
        result, _, _ = run_fake(cuda)
        outs.append(RankOutput(rank, ProtocolResult.from_json(result.to_json())))
    doc = from_text("ledgerspec: ledger/v1\n")
    _write_outside(doc, outs)
    per_rank = doc.get("outside_allocator", "per_rank").value
    assert [(p["value"], p["source"]) for p in per_rank] == [
        (CONTEXT + 10 * 2**20, "MEASURED"),
        (CONTEXT + 40 * 2**20, "MEASURED"),
    ]
    total = doc.get("outside_allocator", "total")
    assert total.size() == CONTEXT + 40 * 2**20 and "rank 1" in str(total.method)
    # after the load, NVML's used less the reserve: the context alone on both ranks (the fake loads the step's
    # modules at the first forward), written as the worst rank's reading, never a sum
    after = doc.get("outside_allocator", "after_load")
    assert after.source == "MEASURED" and after.size() == CONTEXT and "the worst of 2 ranks" in str(after.method)
