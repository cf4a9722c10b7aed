"""The bundled examples: each validates to its expected supported status, and the hand-derived figures of
the CALCULATED ledger agree with the real model built from the bundled config (meta device, no download)."""

from __future__ import annotations

from typing import Any

import pytest

from ledgerspec.checks.validate import Report, validate
from ledgerspec.contract.document import load
from tests.support import EXAMPLES


def report_of(name: str) -> Report:
    return validate(load(EXAMPLES / name))


def rules_at(report: Report, severity: str) -> set[tuple[str, str]]:
    return {(f.rule, f.pointer) for f in report.findings if f.severity == severity}


#: every example with whether it is valid, its declared and its supported status
EXPECTED = [
    ("14b-qlora.intake.yaml", True, "INSUFFICIENT DATA", "INSUFFICIENT DATA"),
    ("llama-2-7b-lora.intake.yaml", True, "INSUFFICIENT DATA", "INSUFFICIENT DATA"),
    ("llama-2-7b-qlora.intake.yaml", True, "INSUFFICIENT DATA", "INSUFFICIENT DATA"),
    ("llama-2-7b-lora.ledger.yaml", True, "CALCULATED", "CALCULATED"),
    ("llama-2-7b-lora.estimated.ledger.yaml", True, "CANDIDATE", "CANDIDATE"),  # resolve and estimate raised it
    ("downgraded.ledger.yaml", False, "VALIDATED", "CANDIDATE"),
    ("naive-article-audit.ledger.yaml", False, "CALCULATED", "INSUFFICIENT DATA"),
]


@pytest.mark.parametrize(("name", "ok", "declared", "supported"), EXPECTED)
def test_example_status(name: str, ok: bool, declared: str, supported: str) -> None:
    report = report_of(name)
    assert (report.ok, report.declared_status, report.supported_status) == (ok, declared, supported)
    assert not [f for f in report.findings if f.rule in ("schema", "header", "load")]


def test_every_example_is_covered() -> None:
    names = {p.name for p in EXAMPLES.glob("*.y*ml")}
    assert names == {row[0] for row in EXPECTED}, "add each new example to EXPECTED with its statuses"
    assert all(n.endswith((".ledger.yaml", ".intake.yaml")) for n in names), "the pre-commit hook matches these"


@pytest.mark.parametrize("name", ["llama-2-7b-lora.intake.yaml", "llama-2-7b-qlora.intake.yaml"])
def test_complete_intakes_are_complete_and_clean(name: str) -> None:
    report = report_of(name)
    assert report.intake_complete is True
    assert [f for f in report.findings if f.severity in ("error", "warning")] == []
    assert report.reasons == [
        "an intake holds no ledger figures: `ledgerspec resolve FILE -o LEDGER` turns it into a ledger"
    ]


def test_intake_config_path_points_at_the_bundled_config() -> None:
    doc = load(EXAMPLES / "llama-2-7b-lora.intake.yaml")
    config = EXAMPLES / doc.plain["identity"]["config_path"]
    assert config.is_file()
    import hashlib

    assert hashlib.sha256(config.read_bytes()).hexdigest() == doc.plain["identity"]["config_sha256"]


def test_the_14b_request_lists_what_is_missing() -> None:
    report = report_of("14b-qlora.intake.yaml")
    assert report.intake_complete is False
    assert len(report.reasons) == 14
    unknown = {f.pointer for f in report.findings if f.rule == "LS002"}
    assert {"/identity/model_id", "/method/rank", "/base_model/quantization/type", "/optimizer/name"} <= unknown
    assert ("LS003", "/identity/total_parameters") in rules_at(report, "warning")


def test_the_calculated_ledger_has_no_warning() -> None:
    report = report_of("llama-2-7b-lora.ledger.yaml")
    assert [f for f in report.findings if f.severity != "info"] == []
    assert {f.pointer for f in report.findings} == {"/ledger/activations", "/ledger/temporary"}


def test_the_downgraded_ledger_is_caught() -> None:
    report = report_of("downgraded.ledger.yaml")
    assert rules_at(report, "error") == {("LS001", "/status"), ("LS031", "/ledger/activations")}
    assert "measurement.device is cpu: a CPU run never validates GPU memory" in report.reasons
    ls001 = next(f for f in report.findings if f.rule == "LS001")
    assert "VALIDATED is above the supported status CANDIDATE" in ls001.message


def test_the_naive_article_is_rejected_with_ls020_and_explained() -> None:
    report = report_of("naive-article-audit.ledger.yaml")
    assert not report.ok
    errors, warnings = rules_at(report, "error"), rules_at(report, "warning")
    assert ("LS020", "/gradients/parameters") in errors
    assert ("LS022", "/ledger/adapter") in errors
    assert ("LS021", "/optimizer/optimized_parameters") in warnings
    assert ("LS011", "/workload/max_length") in warnings
    ls020 = next(f for f in report.findings if f.rule == "LS020")
    assert ls020.message == (
        "gradients.parameters 7,000,000,000 exceeds method.trainable_parameters 8,388,608 "
        "(that is every model parameter: the frozen base was counted); the frozen base has no "
        "gradients in LoRA"
    )
    text = (EXAMPLES / "naive-article-audit.ledger.yaml").read_text(encoding="utf-8")
    line = text.splitlines()[ls020.line - 1]
    assert line.strip().startswith("parameters:")


def _value(doc: Any, *path: str) -> int:
    v = doc.get(*path)
    assert v.source in ("CALCULATED", "VERIFIED"), path
    assert v.method, f"{'.'.join(path)} says how it was derived"
    size = v.size()
    assert size is not None
    return size


@pytest.mark.slow
def test_calculated_ledger_figures_match_the_instantiated_model() -> None:
    """Build Llama-2-7b from the bundled config on the meta device, inject the same LoRA, create AdamW and
    take one step: every figure of the ledger equals what the tensors hold."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")

    doc = load(EXAMPLES / "llama-2-7b-lora.ledger.yaml")
    cfg = transformers.AutoConfig.from_pretrained(str(EXAMPLES / doc.plain["identity"]["config_path"]))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    frozen_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    frozen_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
    total = sum(p.numel() for p in model.parameters())
    method = doc.plain["method"]
    lora = peft.LoraConfig(
        r=method["rank"],
        lora_alpha=method["alpha"],
        lora_dropout=method["dropout"],
        target_modules=method["target_modules"],
        bias=method["bias"],
    )
    model = peft.get_peft_model(model, lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {str(p.dtype) for p in trainable} == {"torch.float32"}
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(trainable)
    optimizer.step()
    device_state = sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.device.type == "meta"
    )

    assert _value(doc, "identity", "total_parameters") == total
    assert _value(doc, "method", "trainable_parameters") == sum(p.numel() for p in trainable)
    assert _value(doc, "gradients", "parameters") == sum(p.grad.numel() for p in trainable)
    assert _value(doc, "optimizer", "optimized_parameters") == sum(
        p.numel() for g in optimizer.param_groups for p in g["params"]
    )
    assert _value(doc, "ledger", "frozen_base") == frozen_bytes
    assert _value(doc, "ledger", "adapter") == sum(p.numel() * p.element_size() for p in trainable)
    assert _value(doc, "ledger", "gradients") == sum(p.grad.numel() * p.grad.element_size() for p in trainable)
    assert _value(doc, "ledger", "optimizer") == device_state
    assert _value(doc, "ledger", "calculated_subtotal") == sum(
        _value(doc, "ledger", k) for k in ("frozen_base", "adapter", "gradients", "optimizer")
    )
