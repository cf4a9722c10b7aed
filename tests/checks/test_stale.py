"""Stale figures: a figure written by `resolve` / `estimate` / `measure` describes the inputs it was computed from.

- `resolve` stores a fingerprint of the fields it reads in `x-resolve.inputs`, `estimate` in `x-estimate.inputs`,
  `measure` in `x-measure.inputs`; `validate` (no torch) recomputes them: an edited input is an LS006 error at the
  edited section, and the stale CALCULATED figures no longer support CALCULATED / CANDIDATE (the reason says so).
- An edit to anything the tool does not read (title, notes, comments, the target device, lora alpha) changes nothing.
- Running the tool again makes the ledger clean; a ledger with no fingerprint is not checked.
- `resolve` refreshes the plain values it wrote itself (`x-resolve.written`) and keeps the ones a user wrote.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from ledgerspec.checks.validate import Report, validate
from ledgerspec.contract.document import Document, from_text, load
from ledgerspec.contract.fingerprint import RESOLVE_INPUTS, WORKLOAD_INPUTS, changed_sections, digests, section_digest
from tests.support import EXAMPLES, CliRunner

pytestmark = pytest.mark.skipif(  # checked without importing them: collection stays light
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("peft") is None,
    reason="needs torch and peft (resolve)",
)

TINY = EXAMPLES / "tiny" / "tiny-llama-lora.ledger.yaml"
QLORA = {  # the tiny example as QLoRA: a bf16 base quantized to nf4
    "  kind: LoRA": "  kind: QLoRA",
    "  loaded_dtype: float32\n  quantized: false": (
        "  loaded_dtype: bfloat16\n  quantized: true\n"
        "  quantization: {type: nf4, double_quant: true, compute_dtype: bfloat16, storage_dtype: uint8}"
    ),
}


def edit(text: str, old: str, new: str) -> str:
    """Replace ``old`` where a line starts with it (exactly once in the document)."""
    if not old.startswith((" ", "\n")) and text.count(old) == 1:
        return text.replace(old, new)
    assert text.count("\n" + old) == 1, f"{old!r} does not start exactly one line of the ledger"
    return text.replace("\n" + old, "\n" + new)


def variant(**replacements: str) -> str:
    text = TINY.read_text(encoding="utf-8")
    for old, new in replacements.items():
        text = edit(text, old, new)
    return text


@pytest.fixture
def work(tmp_path: Path) -> Path:
    shutil.copytree(EXAMPLES / "tiny", tmp_path / "tiny")
    return tmp_path / "tiny" / "ledger.yaml"


def resolved(work: Path, cli: CliRunner, text: str) -> str:
    work.write_text(text, encoding="utf-8")
    code, _, err = cli("resolve", work, "--offline")
    assert code == 0, err
    return work.read_text(encoding="utf-8")


def report(work: Path, text: str) -> Report:
    work.write_text(text, encoding="utf-8")
    return validate(load(work))


def stale_findings(r: Report) -> list[tuple[str, str, str]]:
    return [(f.severity, f.pointer, f.message) for f in r.findings if f.rule == "LS006"]


# -- resolve: an edited input makes the resolved figures stale --------------------------------------------------

INPUT_EDITS = [  # (what, the ledger before, the edit, the section it is in)
    ("rank", {}, ("  rank: 4", "  rank: 8"), "method"),
    ("target_modules", {}, ("target_modules: [q_proj, v_proj]", "target_modules: [q_proj]"), "method"),
    ("loaded_dtype", {}, ("loaded_dtype: float32", "loaded_dtype: bfloat16"), "base_model"),
    ("quantization type", QLORA, ("type: nf4", "type: fp4"), "base_model"),
    ("optimizer name", {}, ("name: adamw_torch", "name: adamw_8bit"), "optimizer"),
    ("adapter dtype", {}, ("adapter:\n  dtype: float32", "adapter:\n  dtype: bfloat16"), "adapter"),
    ("config pin", {}, ("  config_sha256: 8c7c", "  config_sha256: 0c7c"), "identity"),
]


@pytest.mark.parametrize(("what", "before", "change", "section"), INPUT_EDITS, ids=[e[0] for e in INPUT_EDITS])
def test_an_edited_input_is_reported_and_lowers_the_status_until_resolve_runs_again(
    work: Path, cli: CliRunner, what: str, before: dict[str, str], change: tuple[str, str], section: str
) -> None:
    text = resolved(work, cli, variant(**before))
    fresh = report(work, text)
    assert stale_findings(fresh) == [] and fresh.supported_status == "CALCULATED"

    edited = edit(text, *change)
    stale = report(work, edited)
    [(severity, pointer, message)] = stale_findings(stale)
    assert (severity, pointer) == ("error", f"/{section}") and not stale.ok
    assert message.endswith(f"{section} changed since `ledgerspec resolve` ran (run `ledgerspec resolve FILE`)")
    assert stale.supported_status == "INSUFFICIENT DATA"
    assert any(
        r.startswith(
            "CALCULATED needs exact figures: ledger.adapter is CALCULATED from other inputs: "
            f"{section} changed since `ledgerspec resolve`"
        )
        for r in stale.reasons
    ), stale.reasons

    if section == "identity":  # a changed pin is resolve's own error, not something it refreshes
        return
    again = resolved(work, cli, edited)
    clean = report(work, again)
    assert stale_findings(clean) == [] and clean.supported_status == "CALCULATED"


NON_INPUT_EDITS = [
    ("title", ("title: tiny Llama", "title: a tinier Llama")),
    ("notes", ("ledgerspec: ledger/v1\n", "ledgerspec: ledger/v1\nnotes: measured next week\n")),
    ("a comment", ("  rank: 4", "  rank: 4  # small on purpose")),
    ("target device", ("memory_options:", "result:\n  target_device: {name: tiny, memory: 2MiB}\nmemory_options:")),
    ("lora alpha", ("  alpha: 8", "  alpha: 32")),
    ("a workload field", ("  microbatch: 2", "  microbatch: 4")),
    ("a long form with the same value", ("  rank: 4", "  rank: {value: 4, source: VERIFIED, note: from the recipe}")),
]


@pytest.mark.parametrize(("what", "change"), NON_INPUT_EDITS, ids=[e[0] for e in NON_INPUT_EDITS])
def test_an_edit_resolve_does_not_read_changes_nothing(
    work: Path, cli: CliRunner, what: str, change: tuple[str, str]
) -> None:
    text = resolved(work, cli, variant())
    before, after = report(work, text), report(work, edit(text, *change))
    assert stale_findings(after) == []
    assert after.supported_status == before.supported_status == "CALCULATED"


def test_writing_to_another_folder_is_no_edit(work: Path, cli: CliRunner) -> None:
    """`-o OUT` elsewhere rewrites identity.config_path to name the same file: the config pin is the input."""
    work.write_text(variant(), encoding="utf-8")
    out = work.parent.parent / "elsewhere" / "out.ledger.yaml"
    out.parent.mkdir()
    code, _, err = cli("resolve", work, "--offline", "-o", out)
    assert code == 0, err
    doc = load(out)
    assert doc.get("identity", "config_path").text() == "../tiny/tiny-llama/config.json"
    r = validate(doc)
    assert stale_findings(r) == [] and r.supported_status == "CALCULATED"


def test_an_unresolved_or_older_ledger_is_not_checked() -> None:
    """No fingerprint (hand-written, or an older ledgerspec): no finding, the status as before."""
    doc = load(EXAMPLES / "llama-2-7b-lora.ledger.yaml")
    assert "x-resolve" not in doc.plain
    r = validate(doc)
    assert stale_findings(r) == [] and r.supported_status == "CALCULATED"


# -- the fingerprint itself --------------------------------------------------------------------------------------


def test_the_fingerprint_is_a_sha256_of_the_canonical_values_per_section() -> None:
    doc = from_text(
        "ledgerspec: ledger/v1\nmethod:\n  rank: 16  # r\n  kind: LoRA\n  alpha: 32\n"
        "  target_modules: [q_proj, v_proj]\n  trainable_parameters: {value: 1, source: VERIFIED}\n"
    )
    canonical = '{"kind":"LoRA","rank":16,"target_modules":["q_proj","v_proj"]}'  # alpha and outputs left out
    assert digests(doc, RESOLVE_INPUTS)["method"] == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert section_digest(doc, "optimizer", RESOLVE_INPUTS["optimizer"]) == hashlib.sha256(b"{}").hexdigest()[:16]


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("rank: 16", "rank: {value: 16, source: VERIFIED, method: read off the recipe}", True),
        ("rank: {value: 16, source: ASSUMPTION, note: a}", "rank: {value: 16, source: ASSUMPTION, note: b}", True),
        ("rank: 16", "rank: 16  # a comment", True),
        ("rank: 16", "rank: 17", False),
        ("rank: 16", "rank: UNKNOWN", False),
        ("rank: 16", "{}", False),
        ("dropout: 0.0", "dropout: 0.1", True),  # resolve does not read dropout (no tensor) ...
    ],
)
def test_what_changes_the_resolve_fingerprint(a: str, b: str, same: bool) -> None:
    def method(text: str) -> str:
        return digests(from_text(f"ledgerspec: ledger/v1\nmethod:\n  {text}\n"), RESOLVE_INPUTS)["method"]

    assert (method(a) == method(b)) is same


@pytest.mark.parametrize(
    ("section", "a", "b", "same"),
    [
        # spelling an input differently is no edit: the fingerprint holds what the tools read
        ("workload", "packing: false", "packing: OFF", True),
        ("workload", "packing: false", "packing: no", True),
        ("memory_options", "gradient_checkpointing: true", "gradient_checkpointing: ON", True),
        ("workload", "max_length: 2048", "max_length: 2048.0", True),
        ("workload", "max_length: 2048", "max_length: '2048'", True),
        ("base_model", "loaded_dtype: bfloat16", "loaded_dtype: bf16", True),
        ("optimizer", "name: adamw_torch", "name: AdamW_Torch", True),
        ("method", "target_modules: [q_proj, v_proj]", "target_modules: [v_proj, q_proj]", True),
        ("method", "kind: LoRA", "kind: QLoRA", False),
        ("identity", "config_sha256: ABCDEF", "config_sha256: abcdef", True),  # a pin is read in any case
        # ... and a different meaning is one
        ("workload", "packing: false", "packing: true", False),
        ("workload", "max_length: 2048", "max_length: 2049", False),
        ("base_model", "loaded_dtype: bfloat16", "loaded_dtype: float16", False),
        ("method", "target_modules: [q_proj, v_proj]", "target_modules: [q_proj, k_proj]", False),
        ("method", "target_modules: [q_proj]", "target_modules: q_proj", False),  # a string is a regex in PEFT
        ("workload", "microbatch: 2", "microbatch: 2\n  padding_free: true", False),  # padded batches or not
    ],
)
def test_what_changes_the_workload_fingerprint(section: str, a: str, b: str, same: bool) -> None:
    def digest(text: str) -> str:
        return digests(from_text(f"ledgerspec: ledger/v1\n{section}:\n  {text}\n"), WORKLOAD_INPUTS)[section]

    assert (digest(a) == digest(b)) is same


def test_a_stamp_of_the_values_as_written_still_matches() -> None:
    """The first version of the stamp hashed the values as written: such a ledger is not stale after an upgrade."""
    doc = from_text(
        "ledgerspec: ledger/v1\nmethod: {kind: LoRA, rank: 8, target_modules: [v_proj, q_proj]}\n"
        "x-resolve:\n  inputs: {method: PLACEHOLDER}\n"
    )
    old = section_digest(doc, "method", RESOLVE_INPUTS["method"], verbatim=True)
    assert old != section_digest(doc, "method", RESOLVE_INPUTS["method"])  # the list order is normalised now
    doc = from_text(doc.text.replace("PLACEHOLDER", old))
    assert changed_sections(doc, "x-resolve", RESOLVE_INPUTS) == []
    edited = from_text(doc.text.replace("rank: 8", "rank: 16"))
    assert changed_sections(edited, "x-resolve", RESOLVE_INPUTS) == ["method"]
    # the first version did not read workload.padding_free: a ledger that sets it still matches its old stamp
    text = "ledgerspec: ledger/v1\nworkload: {microbatch: 2, packing: false, padding_free: false}\n"
    first = hashlib.sha256(b'{"microbatch":2,"packing":false}').hexdigest()[:16]
    doc = from_text(text + f"x-estimate:\n  inputs: {{workload: {first}}}\n")
    assert changed_sections(doc, "x-estimate", WORKLOAD_INPUTS) == []


def test_estimate_and_measure_read_more_than_resolve() -> None:
    """... but estimate does (a dropout mask is an activation), and the workload, checkpointing and attention."""
    assert {"workload", "memory_options", "software"} <= set(WORKLOAD_INPUTS) - set(RESOLVE_INPUTS)
    a = from_text("ledgerspec: ledger/v1\nmethod: {dropout: 0.0}\n")
    b = from_text("ledgerspec: ledger/v1\nmethod: {dropout: 0.1}\n")
    assert digests(a, WORKLOAD_INPUTS)["method"] != digests(b, WORKLOAD_INPUTS)["method"]


def test_measure_writing_the_default_attention_in_is_no_edit() -> None:
    """`measure` records the attention implementation it ran with; for a ledger that named none that is the
    default (sdpa) the estimate used, so the estimate's fingerprint does not change."""

    def software(text: str) -> str:
        return digests(from_text(f"ledgerspec: ledger/v1\n{text}"), WORKLOAD_INPUTS)["software"]

    assert software("") == software("software: {attention_implementation: sdpa}\n")
    assert software("") != software("software: {attention_implementation: eager}\n")


# -- estimate ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_edited_workload_makes_the_estimate_stale(work: Path, cli: CliRunner) -> None:
    text = resolved(work, cli, variant())
    code, _, err = cli("estimate", work, "--device-memory", "2GiB")  # the tiny step + the CUDA context
    assert code == 0, err
    estimated = work.read_text(encoding="utf-8")
    assert set(load(work).plain["x-estimate"]["inputs"]) == set(WORKLOAD_INPUTS)
    fresh = report(work, estimated)
    assert stale_findings(fresh) == [] and fresh.supported_status == "CANDIDATE"

    edited = edit(estimated, "  microbatch: 2", "  microbatch: 4")
    stale = report(work, edited)
    [(severity, pointer, message)] = stale_findings(stale)
    assert (severity, pointer) == ("error", "/workload")
    assert "ledger.activations and x-estimate" in message and "run `ledgerspec estimate FILE`" in message
    assert stale.supported_status == "CALCULATED"  # the resolved figures still hold; the estimate does not
    assert any(
        "ledger.activations is CALCULATED from other inputs: workload changed since `ledgerspec estimate`" in r
        for r in stale.reasons
    ), stale.reasons

    both = report(work, edit(estimated, "  rank: 4", "  rank: 8"))  # an input of both
    assert {m.split(" describe")[0] for _, _, m in stale_findings(both)} == {
        "the exact figures (ledger.frozen_base, adapter, gradients, optimizer, parameter counts)",
        "ledger.activations and x-estimate",
    }

    work.write_text(edited, encoding="utf-8")
    code, _, err = cli("estimate", work, "--device-memory", "2GiB")  # the tiny step + the CUDA context
    assert code == 0, err
    again = validate(load(work))
    assert stale_findings(again) == [] and again.supported_status == "CANDIDATE"

    def head(t: str) -> list[str]:  # the first lines but the status, which follows the evidence
        return [line for line in t.splitlines()[:12] if not line.startswith("status:")]

    assert head(text) == head(work.read_text(encoding="utf-8"))  # comments kept


@pytest.mark.slow
def test_measure_stamps_its_inputs(work: Path, cli: CliRunner) -> None:
    """A real (cpu) measurement stores x-measure.inputs; an edited workload then makes it stale."""
    resolved(work, cli, variant())
    out = work.parent / "measured.ledger.yaml"
    code, _, err = cli("measure", work, "--device", "cpu", "-o", out)
    assert code == 0, err
    measured = out.read_text(encoding="utf-8")
    assert set(load(out).plain["x-measure"]["inputs"]) == set(WORKLOAD_INPUTS)
    assert stale_findings(report(out, measured)) == []
    [(_, pointer, message)] = stale_findings(report(out, edit(measured, "  microbatch: 2", "  microbatch: 4")))
    assert pointer == "/workload" and message.startswith("phases, metrics and x-measure describe other inputs")


def test_a_stale_measurement_is_reported_and_cannot_validate() -> None:
    """The measurement of other inputs (x-measure.inputs): LS006, and VALIDATED is held with the reason."""
    base = "ledgerspec: ledger/v1\nmethod: {kind: LoRA, rank: 16}\n"
    stamp = digests(from_text(base), WORKLOAD_INPUTS)
    doc = from_text(base.replace("rank: 16", "rank: 64") + "x-measure:\n  inputs: " + json.dumps(stamp) + "\n")
    r = validate(doc)
    [(severity, pointer, message)] = stale_findings(r)
    assert (severity, pointer) == ("error", "/method") and message.startswith("phases, metrics and x-measure")
    from ledgerspec.checks.stale import stale_evidence

    assert stale_evidence(doc, "VALIDATED") == [
        "the measurement (x-measure, phases, metrics) is of other inputs: method changed since `ledgerspec measure` "
        "ran (measure again)"
    ]
    assert stale_evidence(from_text(base + "x-measure:\n  inputs: " + json.dumps(stamp) + "\n"), "VALIDATED") == []


# -- (A) resolve refreshes what it wrote, keeps what the user wrote ---------------------------------------------


def skipped(cli_err: str) -> list[str]:
    return [line for line in cli_err.splitlines() if ": kept /" in line]


def test_switching_optimizer_refreshes_what_resolve_wrote(work: Path, cli: CliRunner) -> None:
    text = resolved(work, cli, variant(**{"name: adamw_torch": "name: paged_adamw_8bit\n  # the 8-bit state"}))
    first = load(work)
    assert (first.get("optimizer", "state_format").text() or "").startswith("paged (unified memory), 2 x uint8")
    assert (first.get("optimizer", "bits").value, first.get("optimizer", "paged").value) == (8, True)

    work.write_text(edit(text, "name: paged_adamw_8bit", "name: adamw_torch"), encoding="utf-8")
    code, _, err = cli("resolve", work, "--offline")
    assert code == 0 and skipped(err) == [], err
    doc = load(work)
    state = doc.get("optimizer", "state_format").text() or ""
    assert "uint8" not in state and "paged" not in state and "moments" in state
    assert not doc.get("optimizer", "bits").present and not doc.get("optimizer", "paged").present
    assert doc.plain["x-resolve"]["written"]["optimizer.state_format"] == state
    written = work.read_text(encoding="utf-8")
    assert "  # the 8-bit state\n" in written and "\nmemory_options:\n" in written  # comments and layout kept
    assert report(work, written).supported_status == "CALCULATED"
    code, _, err = cli("resolve", work, "--offline", "--check")
    assert code == 0, err  # idempotent


@pytest.mark.parametrize("when", ["before the first resolve", "after resolve wrote its own"])
def test_a_user_written_state_format_is_kept(work: Path, cli: CliRunner, when: str) -> None:
    mine = "two fp32 moments, as in my notes"
    text = variant(**{"name: adamw_torch": "name: paged_adamw_8bit"})
    if when == "before the first resolve":
        text = edit(text, "name: paged_adamw_8bit", f"name: paged_adamw_8bit\n  state_format: {mine}")
        text = resolved(work, cli, text)
    else:
        text = resolved(work, cli, text)
        text = edit(
            text,
            "  state_format: " + (load(work).get("optimizer", "state_format").text() or ""),
            "  state_format: " + mine,
        )
    work.write_text(edit(text, "name: paged_adamw_8bit", "name: adamw_torch"), encoding="utf-8")
    code, _, err = cli("resolve", work, "--offline")
    assert code == 0, err
    assert skipped(err) == [
        f"{work}: kept /optimizer/state_format: kept the declared value (not written by "
        "resolve; delete it to let resolve fill it)"
    ]
    doc = load(work)
    assert doc.get("optimizer", "state_format").text() == mine
    assert "optimizer.state_format" not in doc.plain["x-resolve"].get("written", {})


def test_a_ledger_resolved_before_x_resolve_existed_is_adopted(work: Path, cli: CliRunner) -> None:
    """Older ledgers have resolve's x-breakdown but no x-resolve: values equal to the derived ones are resolve's."""
    text = resolved(work, cli, variant(**{"name: adamw_torch": "name: paged_adamw_8bit"}))
    older = text[: text.index("x-resolve:")].rstrip("\n") + "\n"
    assert "x-breakdown" in older
    switched = edit(older, "name: paged_adamw_8bit", "name: adamw_torch")
    assert stale_findings(report(work, switched)) == []  # no fingerprint: not checked

    resolved(work, cli, older)  # the first run of this version: what equals the derived value is recorded
    written = load(work).plain["x-resolve"]["written"]
    assert written["optimizer.bits"] == 8 and written["optimizer.state_format"].startswith("paged")
    work.write_text(
        edit(work.read_text(encoding="utf-8"), "name: paged_adamw_8bit", "name: adamw_torch"), encoding="utf-8"
    )
    code, _, err = cli("resolve", work, "--offline")
    assert code == 0 and skipped(err) == [], err
    assert "uint8" not in (load(work).get("optimizer", "state_format").text() or "")

    work.write_text(switched, encoding="utf-8")  # edited before this version ever ran: nothing says who wrote it
    code, _, err = cli("resolve", work, "--offline")
    assert code == 0 and [line.split(": kept ", 1)[1] for line in skipped(err)] == [
        "/optimizer/state_format: kept the declared value (not written by resolve; delete it to let resolve fill it)"
    ]


def test_a_hand_written_value_equal_to_the_derived_one_stays_the_users(work: Path, cli: CliRunner) -> None:
    """The tiny example declares `identity.architecture: LlamaForCausalLM` itself: resolve records only what it
    wrote, so that value is never resolve's to refresh or remove."""
    resolved(work, cli, variant())
    doc: Document = load(work)
    assert doc.get("identity", "architecture").text() == "LlamaForCausalLM"
    assert "identity.architecture" not in doc.plain["x-resolve"]["written"]
    assert doc.plain["x-resolve"]["written"]["gradients.dtype"] == "float32"  # absent before: resolve wrote it


def test_a_stamp_from_before_the_training_fields_still_matches_a_ledger_without_them() -> None:
    """The fields of the step users run (``training.*``, ``base_model.module_dtypes``) are new inputs; a ledger
    stamped before they existed, which does not write them, is not stale (its sections hash as they did)."""
    old_inputs = {k: v for k, v in WORKLOAD_INPUTS.items() if k != "training"}
    old_inputs["base_model"] = tuple(p for p in WORKLOAD_INPUTS["base_model"] if p != ("module_dtypes",))
    doc = load(EXAMPLES / "llama-2-7b-lora.estimated.ledger.yaml")
    assert not doc.get("training").present and not doc.get("base_model", "module_dtypes").present
    assert digests(doc, old_inputs) == {k: v for k, v in digests(doc, WORKLOAD_INPUTS).items() if k != "training"}
    stamped = json.dumps(digests(doc, old_inputs))
    text = (EXAMPLES / "llama-2-7b-lora.estimated.ledger.yaml").read_text(encoding="utf-8")
    old = from_text(text.split("\nx-estimate:")[0] + f"\nx-estimate:\n  inputs: {stamped}\n")
    assert changed_sections(old, "x-estimate", WORKLOAD_INPUTS) == []


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        # a separate reference model is a second copy of the frozen base resolve writes; a reward model another head
        ("objective: dpo", "objective: dpo\n  objective_settings: {reference: model}", False),
        ("objective: kto", "objective: kto\n  objective_settings: {reference: model}", False),
        ("objective: sft", "objective: reward", False),
        # the defaults are left out: a stamp written before resolve read the training section still matches
        ("objective: sft", "loop: trainer", True),
        ("objective: dpo", "objective: dpo\n  objective_settings: {reference: adapter_disabled}", True),
        # only DPO/KTO read the reference
        ("objective: grpo", "objective: grpo\n  objective_settings: {reference: adapter_disabled}", True),
    ],
)
def test_resolve_reads_the_objective_and_a_separate_reference_model(a: str, b: str, same: bool) -> None:
    def training(text: str) -> str:
        return digests(from_text(f"ledgerspec: ledger/v1\ntraining:\n  {text}\n"), RESOLVE_INPUTS)["training"]

    assert (training(a) == training(b)) is same
    # an older stamp has no training section: not checked, so the ledger is not stale after the upgrade
    doc = from_text(f"ledgerspec: ledger/v1\ntraining:\n  {b}\nx-resolve:\n  inputs: {{method: x}}\n")
    assert "training" not in (changed_sections(doc, "x-resolve", RESOLVE_INPUTS) or [])


#: ``shard --estimate``'s ``software`` digest of a ledger declaring one version (and SDPA attention), as ledgerspec
#: computed it at d51a3e3, before the first window difference was known
STAMPED_BEFORE = {
    ("transformers", "4.37.2"): "72a03ff47f5eca0b",
    ("transformers", "4.39.1"): "72a03ff47f5eca0b",
    ("transformers", "5.24.0"): "618a35c53ae507d7",
    ("transformers", "main"): "3f14ee0f38a05beb",
    ("bitsandbytes", "0.43.0"): "6ef8d3675f5d6ec5",
    ("peft", "0.10.0"): "e846ba5b406826bd",
}


def _software(package: str, version: str) -> Document:
    return from_text(f"ledgerspec: ledger/v1\nsoftware:\n  {package}: '{version}'\n  attention_implementation: sdpa\n")


@pytest.mark.parametrize(("package", "version"), list(STAMPED_BEFORE))
def test_a_shard_stamp_written_before_the_window_difference_still_matches(package: str, version: str) -> None:
    """transformers-sdpa-explicit-causal-mask is not modelled: it changes no shard figure, so it enters no stamp, and
    every stamp written before it was known matches, inside its window too."""
    from ledgerspec.contract.fingerprint import SHARD_INPUTS

    doc = _software(package, version)
    assert section_digest(doc, "software", SHARD_INPUTS["software"]) == STAMPED_BEFORE[(package, version)]


@pytest.mark.parametrize(
    ("version", "stale"),
    [("4.37.2", False), ("4.38.2", True), ("4.39.1", True), ("4.40.0", False), ("5.24.0", False), ("main", False)],
)
def test_a_modelled_difference_known_later_makes_stale_only_the_stamps_of_its_older_side(
    monkeypatch: pytest.MonkeyPatch, version: str, stale: bool
) -> None:
    """Were a modelled difference added now (here: the window, as if a derivation modelled it), a stamp written before
    still matches for a transformers outside its older side and not for one inside it (its figures would change)."""
    import dataclasses

    from ledgerspec.contract import fingerprint
    from ledgerspec.contract.differences import KNOWN
    from ledgerspec.contract.fingerprint import SHARD_INPUTS

    before = section_digest(_software("transformers", version), "software", SHARD_INPUTS["software"])
    window = next(d for d in KNOWN if d.introduced_in is not None)
    modelled = dataclasses.replace(window, id="a-modelled-window", modelled=True)
    monkeypatch.setattr(fingerprint, "KNOWN", (*KNOWN, modelled))
    now = section_digest(_software("transformers", version), "software", SHARD_INPUTS["software"])
    assert (now != before) is stale


def test_the_ids_named_on_every_side_are_the_differences_known_before_the_rule() -> None:
    """Renaming, removing or adding an id here would change what every shard stamp of its package hashed."""
    from ledgerspec.contract.differences import BY_ID
    from ledgerspec.contract.fingerprint import DIGEST_EVERY_SIDE

    assert set(DIGEST_EVERY_SIDE) <= set(BY_ID)
    assert len(DIGEST_EVERY_SIDE) == 6 and "transformers-sdpa-explicit-causal-mask" not in DIGEST_EVERY_SIDE
