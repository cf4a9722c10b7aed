"""``ledgerspec estimate``: exact against a CPU measurement, written back with provenance, fit and OOM phase."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from ledgerspec.contract.document import load
from ledgerspec.derivations.estimate.estimator import estimate
from ledgerspec.derivations.estimate.fit import PHASES
from tests.support import EXAMPLES, CliRunner
from tests.support.estimate_docs import DATA, ledger, ledger_text

# -- exact on the CPU: the simulation against a real CPU measurement ------------------------------------------------

CPU_CASES = [  # sequences of 80 tokens: longer than the sliding window (64) of Mistral and Gemma2
    {"arch": "tiny-llama-gqa", "dtype": "float32", "seq": 80},
    {"arch": "tiny-llama-gqa", "checkpointing": True, "accumulation": 2, "microbatch": 1, "seq": 80},
    {"arch": "tiny-qwen2", "attention": "eager", "microbatch": 1, "seq": 80},
    {"arch": "tiny-mistral", "seq": 80, "microbatch": 1, "targets": "all-linear"},
    {"arch": "tiny-gemma2", "attention": "eager", "checkpointing": True, "microbatch": 1, "seq": 80},
    # QLoRA: real bitsandbytes layers in the measurement, the byte-level stand-in in the estimate
    {"arch": "tiny-qwen2", "quant": "nf4", "targets": "all-linear", "seq": 80},  # biased q/k/v: cast in place
    {
        "arch": "tiny-mistral",
        "quant": "fp4",
        "storage": "bfloat16",
        "double_quant": False,
        "targets": "all-linear",
        "microbatch": 1,
        "seq": 80,
    },
    {
        "arch": "tiny-llama-gqa",
        "quant": "nf4",
        "dtype": "float16",
        "checkpointing": True,
        "accumulation": 2,
        "optimizer": "paged_adamw_8bit",
        "targets": "all-linear",
        "microbatch": 1,
        "seq": 48,
    },
    # padded batches (microbatch > 1, packing off): an attention mask, k/v repeated for GQA under sdpa
    {"arch": "tiny-llama-gqa", "attention": "sdpa", "microbatch": 2, "seq": 80},
    {"arch": "tiny-llama-gqa", "attention": "eager", "microbatch": 2, "seq": 80},
    {"arch": "tiny-mistral", "checkpointing": True, "accumulation": 2, "microbatch": 2, "seq": 80},
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_cpu_target_agrees_with_a_cpu_measurement(case: dict[str, Any]) -> None:
    from ledgerspec.derivations.measure.measurer import make_request, run_request

    doc = ledger(**case)
    est = estimate(doc, target="cpu")
    measured = run_request(make_request(doc, "cpu", 2, None, None)).result  # real tensors, the same protocol
    for phase in PHASES:
        want = measured.phases[phase].figure
        assert abs(est.phases[phase] - want) <= 0.01 * want, phase
    assert est.activations == measured.activations_saved
    assert measured.phases["forward_peak"].figure == est.phases["forward_peak"]  # byte for byte, padded or not
    # what is alive at the peak, by component: the measurement's own categories at the same moment
    from ledgerspec.derivations.engine.tracker import by_component

    live = by_component(measured.phases[est.peak_phase].categories_at_peak or {})
    assert est.at_peak == {k: live.get(k, 0) for k in est.at_peak}
    assert sum(est.at_peak.values()) == est.peak_allocated


# -- components against the resolver's exact figures ----------------------------------------------------------------


@pytest.fixture(scope="module")
def llama7b(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The 7B example, its estimate, and an estimate cache that holds it (the command's run reads it there)."""
    from ledgerspec.derivations.estimate.cache import EstimateCache

    doc = load(EXAMPLES / "llama-2-7b-lora.ledger.yaml")
    store = tmp_path_factory.mktemp("estimate-cache-7b")
    return doc, estimate(doc, store=EstimateCache(store)), store


@pytest.mark.slow
@pytest.mark.xdist_group("estimate-llama7b")  # its module fixture, once
def test_7b_peak_is_split_into_what_is_alive_then(
    llama7b: Any, cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc, est, store = llama7b  # extrapolated from two probe depths: the split must still add up to the peak
    assert sum(est.at_peak.values()) == est.peak_allocated
    assert est.at_peak["adapter"] == doc.get("ledger", "adapter").size()
    assert abs(est.at_peak["frozen_base"] - doc.get("ledger", "frozen_base").size()) <= 512  # allocator rounding
    assert est.at_peak["temporary"] > 0  # fp32 logits and loss, gradients in flight: owned by no component
    monkeypatch.setenv("LEDGERSPEC_CACHE_DIR", str(store))  # the fixture's estimate, not traced again
    code, out, _ = cli("estimate", EXAMPLES / "llama-2-7b-lora.ledger.yaml", "--dry-run")  # writes nothing
    assert code == 0 and f"alive at the peak ({est.peak_phase}): frozen base" in out


@pytest.mark.slow
@pytest.mark.xdist_group("estimate-llama7b")  # its module fixture, once
def test_7b_components_equal_the_resolved_ledger(llama7b: Any) -> None:
    doc, est, _ = llama7b
    for key in ("frozen_base", "adapter", "gradients"):
        assert est.components[key] == doc.get("ledger", key).size(), key
    # AdamW also keeps one fp32 ``step`` scalar per trainable tensor (q_proj, v_proj x A, B x 32 layers)
    assert est.components["optimizer"] == doc.get("ledger", "optimizer").size() + 4 * 2 * 2 * 32
    assert est.plan.probes == (2, 3)


@pytest.mark.slow
@pytest.mark.xdist_group("estimate-llama7b")  # its module fixture, once
def test_7b_phases_are_ordered_as_a_training_step(llama7b: Any) -> None:
    _, est, _ = llama7b
    p = est.phases
    assert p["after_load"] < p["after_adapter_injection"] <= p["after_optimizer_init"]
    assert p["forward_peak"] > p["after_optimizer_init"] + est.activations // 2
    assert est.peak_allocated == max(p.values())
    # the 7B bf16 base alone is 13.5 GB: peak is above it, and far below the naive article's 66-76 GB
    assert 13.4e9 < est.peak_allocated < 20e9


# -- the command ----------------------------------------------------------------------------------------------------


def _copy(tmp_path: Path, text: str, name: str = "t.ledger.yaml", arch: str = "tiny-llama-gqa") -> Path:
    shutil.copytree(DATA / arch, tmp_path / arch, dirs_exist_ok=True)
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def plain() -> Any:
    """The estimate of the default tiny ledger (``ledger_text()``: Llama GQA, sdpa, microbatch 2, 128 tokens, no
    checkpointing), traced once for the tests that compare against it (their ``xdist_group``: one worker)."""
    return estimate(ledger())


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_writes_activations_and_phases_with_provenance(tmp_path: Path, cli: CliRunner) -> None:
    path = _copy(tmp_path, ledger_text(checkpointing=True))
    # 4 GiB: the unnamed device's outside-allocator range (up to 1.75 GiB) leaves room (at 1 GiB: at the edge)
    code, out, err = cli("estimate", path, "--device-memory", "4GiB")
    assert code == 0, err
    assert "fits" in out
    doc = load(path)
    act = doc.get("ledger", "activations")
    assert act.source == "CALCULATED" and act.size() and "FakeTensorMode" in (act.method or "")
    assert "attention: SDPA modelled" in (act.method or "")
    peak = doc.get("x-estimate", "peak_allocated")
    assert peak.source == "CALCULATED"
    phases = doc.get("x-estimate", "phases").value
    assert list(phases) == list(PHASES) and peak.size() == max(phases.values())
    assert doc.get("ledger", "temporary").unknown  # temporary stays MEASURED-only
    assert doc.get("result", "target_device", "memory").size() == 4 * 2**30
    assert doc.get("result", "fits").switch() is True


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
@pytest.mark.xdist_group("estimate-plain")  # its module fixture, once
def test_does_not_fit_names_the_first_phase_over_the_device(tmp_path: Path, cli: CliRunner, plain: Any) -> None:
    """Nothing outside the allocator (declared 0 B): a device between what the allocator holds before training (two
    2 MiB segments of small blocks) and the forward peak runs out in the forward pass; the headroom is the device
    minus the device-level peak (the allocator model's reserve without a limit, as the estimate writes it). The
    allocated figures are those of the plain ledger's estimate (the fixture: this ledger without the declaration)."""
    nothing_outside = "outside_allocator:\n  total: {value: 0 B, source: ASSUMPTION, note: test}\n"
    path = _copy(tmp_path, ledger_text() + nothing_outside)
    p = plain.phases
    device = max(4 * 2**20 + 1, (p["after_optimizer_init"] + p["forward_peak"]) // 2)
    code, out, _ = cli("estimate", path, "--device-memory", str(device))
    assert code == 1
    assert "does NOT fit on the device" in out and "phase forward" in out
    doc = load(path)
    assert doc.get("x-estimate", "oom_phase").text() == "forward"
    device_peak = doc.get("x-estimate", "device_peak").size()
    assert device_peak is not None and doc.get("x-estimate", "headroom").integer() == device - device_peak
    assert doc.get("x-estimate", "phases").value == p  # the allocated figures are the plain estimate's
    assert doc.get("result", "fits").switch() is False


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_status_reaches_candidate(tmp_path: Path, cli: CliRunner) -> None:
    from ledgerspec.checks.ladder import supported_status

    text = ledger_text().replace("status: CALCULATED", "status: CALCULATED") + (
        "ledger:\n"
        "  frozen_base: {value: 1, source: CALCULATED, method: test}\n"
        "  adapter: {value: 1, source: CALCULATED, method: test}\n"
        "  gradients: {value: 1, source: CALCULATED, method: test}\n"
        "  optimizer: {value: 1, source: CALCULATED, method: test}\n"
    )
    pin = hashlib.sha256((DATA / "tiny-llama-gqa" / "config.json").read_bytes()).hexdigest()  # the exact config
    text = text.replace("config_sha256: UNKNOWN", f"config_sha256: {pin}")
    path = _copy(tmp_path, text)
    assert supported_status(load(path)).status == "CALCULATED"
    code, out, err = cli("estimate", path, "--device-memory", "80GB")
    assert code == 0, err
    assert supported_status(load(path)).status == "CANDIDATE"
    # 80 GB (74.51 GiB) is replayed as the catalogue's A100 80GB, against its CUDA total: the allocated-only answer
    # stays against the declared memory, and says so (a newcomer read its smaller headroom as a contradiction)
    assert "CUDA total is 79.25 GiB" in out and "(of the declared 74.51 GiB, not the CUDA total)" in out


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_measured_activations_are_kept(tmp_path: Path, cli: CliRunner) -> None:
    path = _copy(tmp_path, ledger_text() + "ledger:\n  activations: {value: 12345, source: MEASURED}\n")
    code, _, err = cli("estimate", path)
    assert code == 0
    assert "kept /ledger/activations" in err
    doc = load(path)
    assert doc.get("ledger", "activations").size() == 12345
    assert doc.get("x-estimate", "peak_allocated").size()


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_intake_is_printed_not_written(tmp_path: Path, cli: CliRunner) -> None:
    text = ledger_text().replace("ledgerspec: ledger/v1", "ledgerspec: intake/v1").replace("status: CALCULATED\n", "")
    path = _copy(tmp_path, text, "t.intake.yaml")
    code, out, err = cli("estimate", path)
    assert code == 0 and "peak allocated" in out and "nothing written" in err
    assert path.read_text() == text
    code, _, err = cli("estimate", path, "-o", tmp_path / "out.yaml")
    assert code == 2 and "resolve" in err


@pytest.mark.parametrize(
    ("attention", "needle"),
    [
        ("flex_attention", "flex_attention"),
    ],
)
def test_unmodelled_attention_is_an_error_suggesting_measure(
    tmp_path: Path, cli: CliRunner, attention: str, needle: str
) -> None:
    path = _copy(tmp_path, ledger_text(attention=attention))
    before = path.read_text()
    code, _, err = cli("estimate", path)
    assert code == 1
    assert needle in err and "measure" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert path.read_text() == before


def test_sdpa_on_a_softcapping_model_is_an_error(tmp_path: Path, cli: CliRunner) -> None:
    path = _copy(tmp_path, ledger_text(arch="tiny-gemma2"), arch="tiny-gemma2")
    code, _, err = cli("estimate", path)
    assert code == 1 and "Traceback" not in err
    assert "sdpa" in err.lower()


def test_an_op_without_a_fake_kernel_is_named(tmp_path: Path, cli: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

    from ledgerspec.derivations.engine.step import TrainerLoop

    def forward(self: Any, i: int) -> Any:
        raise UnsupportedOperatorException(torch.ops.aten.nonzero.default)

    monkeypatch.setattr(TrainerLoop, "forward", forward)
    path = _copy(tmp_path, ledger_text())
    code, _, err = cli("estimate", path)
    assert code == 1
    assert "aten.nonzero" in err and "fake-tensor kernel" in err and "measure" in err


def test_an_untraceable_architecture_is_named(tmp_path: Path, cli: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    from ledgerspec.derivations.engine.step import TrainerLoop

    def forward(self: Any, i: int) -> Any:
        raise RuntimeError("Cannot access data pointer of Tensor (e.g. FakeTensor)")

    monkeypatch.setattr(TrainerLoop, "forward", forward)
    path = _copy(tmp_path, ledger_text())
    code, _, err = cli("estimate", path)
    assert code == 1 and "LlamaForCausalLM" in err and "measure" in err


@pytest.mark.slow
@pytest.mark.xdist_group("estimate-plain")  # its module fixture, once
def test_sweep_prints_the_matrix_and_the_largest_fitting(
    tmp_path: Path, cli: CliRunner, plain: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nothing outside the allocator, and no cuBLAS workspaces (their 20 MiB segment alone is larger than this device):
    # a device of a few MiB still holds the answer on the device that the table's allocated answer is checked
    # against (tests/derivations/devices/test_sweep_check.py follows that check)
    from ledgerspec.derivations.devices import prediction

    monkeypatch.setattr(prediction, "workspaces_of", lambda doc, target: ((), ()))
    path = _copy(tmp_path, ledger_text(seq=128) + "outside_allocator:\n  total: {value: 0, source: ASSUMPTION}\n")
    before = path.read_text()
    base = plain.peak_allocated  # this very ledger's estimate (the fixture's): microbatch 2, no checkpointing
    code, out, err = cli(
        "estimate", path, "--sweep", "microbatch=1,2,4", "gradient_checkpointing=on,off", "--device-memory", str(base)
    )
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()[2:8]]
    assert [(r[0], r[1]) for r in rows] == [
        ("1", "on"),
        ("1", "off"),
        ("2", "on"),
        ("2", "off"),
        ("4", "on"),
        ("4", "off"),
    ]
    verdict = {(r[0], r[1]): r[-1] for r in rows}
    assert verdict[("2", "off")] == "yes"  # the ledger's own configuration, exactly at the device size
    line = next(x for x in out.splitlines() if x.startswith("largest configuration whose allocated tensors fit"))
    mb = line.split("microbatch=")[1].split(",")[0]
    ckpt = line.split("gradient_checkpointing=")[1].split()[0]
    assert verdict[(mb, ckpt)] == "yes"
    assert all(v == "NO" for (m, _), v in verdict.items() if int(m) > int(mb))  # nothing bigger fits
    assert path.read_text() == before  # a sweep writes nothing
    code, out, _ = cli("estimate", path, "--sweep", "microbatch=4,8", "--device-memory", str(base))
    assert code == 1 and "no configuration has allocated tensors that fit" in out  # as an estimate that does not fit


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
@pytest.mark.xdist_group("estimate-plain")  # its module fixture, once
def test_checkpointing_and_microbatch_move_the_estimate_the_right_way(plain: Any) -> None:
    def peak(**kw: Any) -> Any:
        return estimate(ledger(seq=128, **kw))

    off, on = plain, peak(checkpointing=True)  # the fixture is the default ledger: no checkpointing, microbatch 2
    assert on.activations < off.activations and on.peak_allocated < off.peak_allocated
    assert peak(microbatch=1).activations < off.activations  # microbatch 2 by default


@pytest.mark.parametrize(
    "spec",
    [
        "microbatch",
        "microbatch=0",
        "colour=1,2",
        "gradient_checkpointing=maybe",
        "optimizer=adamw_torch,adamw_9bit",
        "attention_implementation=flash",
    ],
)
def test_bad_sweep_is_a_usage_error(tmp_path: Path, cli: CliRunner, spec: str) -> None:
    path = _copy(tmp_path, ledger_text())
    code, _, err = cli("estimate", path, "--sweep", spec)
    assert code == 2 and "--sweep" in err


def test_bad_device_memory_is_a_usage_error(tmp_path: Path, cli: CliRunner) -> None:
    path = _copy(tmp_path, ledger_text())
    code, _, err = cli("estimate", path, "--device-memory", "lots")
    assert code == 2 and "--device-memory" in err


def test_an_incomplete_intake_is_refused_with_its_gaps(cli: CliRunner) -> None:
    code, _, err = cli("estimate", EXAMPLES / "14b-qlora.intake.yaml")
    assert code == 1
    assert "incomplete configuration" in err and "method.rank is UNKNOWN" in err and "workload.microbatch" in err
