"""``ledgerspec triage``: the article's OOM Triage Worksheet, filled by controlled measurements.

A baseline measurement of the ledger's configuration, then one measurement per controlled change,
each in its own child process (see :mod:`ledgerspec.derivations.measure.measurer`):

* ``microbatch_reduced``: microbatch halved (not applicable at microbatch 1);
* ``sequence_reduced``: worst and typical sequence lengths halved;
* ``checkpointing_changed``: gradient checkpointing toggled;
* ``optimizer_changed``: the optimizer switched to 8-bit AdamW (a stateless SGD when it already is 8-bit).

Each test is PASS when the changed configuration runs without out-of-memory, FAIL otherwise. The
worksheet's hypotheses come from the measured categories at the peak (or where the baseline ran
out) and from the measured effect of each change; the Memory Sensitivity Matrix (``x-sensitivity``)
records direction and size of every change. This locates the component to fix; it does not prove
a cause (the article: "это именно triage, а не доказательство причины").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ledgerspec.contract import fields as F
from ledgerspec.contract.document import Document
from ledgerspec.contract.edit import set_extension, set_plain
from ledgerspec.contract.units import format_size
from ledgerspec.derivations.engine.tracker import by_component
from ledgerspec.derivations.measure.measurer import make_request, run_child

TESTS = ("microbatch_reduced", "sequence_reduced", "checkpointing_changed", "optimizer_changed")
COMPONENTS = F.COMPONENTS


@dataclass
class Trial:
    """One measured configuration of the triage."""

    name: str
    change: str
    result: Any  # ProtocolResult

    @property
    def passed(self) -> bool:
        return not self.result.oom

    @property
    def peak(self) -> int:
        return int(self.result.peak_allocated() or 0)


@dataclass
class TriageOutcome:
    baseline: Trial
    trials: dict[str, Trial] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    hypothesis: dict[str, str] = field(default_factory=dict)

    def summary(self, path: str) -> list[str]:
        """The lines to print, for the ledger written at ``path``."""
        b = self.baseline
        state = f"OOM in {b.result.oom_phase}" if b.result.oom else "no OOM"
        lines = [f"{path}: baseline peak {format_size(b.peak)} ({state})"]
        if not b.result.oom:
            lines.append(
                "  no out-of-memory to triage: the OOM Triage Worksheet (triage) is not written, only the "
                "Memory Sensitivity Matrix (x-sensitivity); reproduce the OOM on the target device, or on "
                "the cpu with --memory-limit SIZE"
            )
        for name in TESTS:
            if name in self.trials:
                t = self.trials[name]
                lines.append(
                    f"  {name:<22} {'PASS' if t.passed else 'FAIL'}  {t.change:<34} peak "
                    f"{format_size(t.peak)} ({_signed(t.peak - b.peak)})"
                )
            else:
                lines.append(f"  {name:<22} n/a   {self.skipped.get(name, '')}")
        return lines


def _signed(n: int) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "±") + format_size(abs(n))


def controlled_changes(spec: Any) -> tuple[dict[str, tuple[str, Any]], dict[str, str]]:
    """``{test: (description, changed spec)}`` and ``{test: why not applicable}``."""
    changes: dict[str, tuple[str, Any]] = {}
    skipped: dict[str, str] = {}
    if spec.microbatch > 1:
        mb = spec.microbatch // 2
        changes["microbatch_reduced"] = (f"microbatch {spec.microbatch} -> {mb}", spec.changed(microbatch=mb))
    else:
        skipped["microbatch_reduced"] = "microbatch is already 1"
    if spec.seq_worst > 1:
        worst = spec.seq_worst // 2
        typical = max(1, min(spec.seq_typical, worst))
        changes["sequence_reduced"] = (
            f"sequence {spec.seq_worst} -> {worst} tokens",
            spec.changed(seq_worst=worst, seq_typical=typical),
        )
    else:
        skipped["sequence_reduced"] = "sequence length is already 1"
    gc = not spec.gradient_checkpointing
    changes["checkpointing_changed"] = (
        f"gradient checkpointing {'on' if gc else 'off'}",
        spec.changed(gradient_checkpointing=gc),
    )
    target = "sgd" if "8bit" in spec.optimizer else "adamw_8bit"
    changes["optimizer_changed"] = (f"optimizer {spec.optimizer} -> {target}", spec.changed(optimizer=target))
    return changes, skipped


def breakdown(result: Any) -> dict[str, int]:
    """Bytes by ledger component at the peak (or at the failure): tracker categories, else census + activations."""
    if result.oom:
        cats, cen, peak = result.failed_categories, result.failed_census, result.failed_phase_peak or 0
    else:
        top = max(result.phases.values(), key=lambda p: p.peak)
        cats, cen, peak = top.categories_at_peak, top.census, top.peak
    if cats:
        return {k: v for k, v in by_component(cats).items() if k in COMPONENTS}
    out = {k: v for k, v in by_component(cen or {}).items() if k in COMPONENTS}
    static = sum(out.values())
    act = result.activations_saved or 0
    out["activations"] = act
    out["temporary"] = max(0, peak - static - act)
    return out


def hypotheses(baseline: Trial, trials: dict[str, Trial]) -> dict[str, str]:
    """One line per worksheet component, from measured bytes and measured effects of the changes."""
    r = baseline.result
    parts = breakdown(r)
    peak = (r.failed_phase_peak if r.oom else r.peak_allocated()) or 1
    where = f"at the failure in {r.oom_phase}" if r.oom else "at the peak"

    def share(key: str) -> str:
        n = parts.get(key, 0)
        return f"{format_size(n)} ({n / peak:.0%} of {format_size(peak)} {where})"

    def effect(test: str) -> str:
        t = trials.get(test)
        if t is None:
            return ""
        return f"; {t.change}: {'PASS' if t.passed else 'FAIL'}, peak {_signed(t.peak - baseline.peak)}"

    limit = r.memory_limit
    base = parts.get("frozen_base", 0) + parts.get("adapter", 0)
    resident = "fits" if limit is None or base <= limit else "alone exceeds the memory limit"
    out = {
        "base_residency": f"frozen base + adapter {format_size(base)} ({resident}); {share('frozen_base')} is the "
        "frozen base",
        "activations": f"{share('activations')}"
        + effect("sequence_reduced")
        + effect("microbatch_reduced")
        + effect("checkpointing_changed"),
        "gradients": f"{share('gradients')}: gradients exist only for trainable tensors",
        "optimizer": f"{share('optimizer')}" + effect("optimizer_changed"),
        "temporary_runtime": f"{share('temporary')} (loss upcast, backward intermediates, kernel outputs)",
    }
    if r.backend == "cuda":
        phases = list(r.phases.values())
        res = max((p.reserved_peak or 0) for p in phases) if phases else 0
        dev = max((p.device_peak or 0) for p in phases) if phases else 0
        alloc = r.peak_allocated() or 0
        out["allocator"] = f"reserved - allocated at the peak: {format_size(max(0, res - alloc))}"
        out["unknown"] = f"device - reserved (CUDA context, cuBLAS/NCCL workspaces): {format_size(max(0, dev - res))}"
    else:
        out["allocator"] = "not observable on the cpu backend (no caching allocator)"
        out["unknown"] = "memory outside PyTorch tensors (kernel scratch, CUDA context) is not tracked on cpu"
    return out


def matrix(baseline: Trial, trials: dict[str, Trial], skipped: dict[str, str]) -> dict[str, Any]:
    """The Memory Sensitivity Matrix: direction and measured size of each change, per component."""
    b = baseline.result
    base_parts = breakdown(b)
    rows: dict[str, Any] = {}
    for name in TESTS:
        if name in skipped:
            rows[name] = {"applicable": False, "why": skipped[name]}
            continue
        t = trials[name]
        delta = t.peak - baseline.peak
        parts = breakdown(t.result)
        rows[name] = {
            "change": t.change,
            "result": "PASS" if t.passed else "FAIL",
            "peak_allocated": t.peak,
            "delta": delta,
            "direction": "down" if delta < 0 else "up" if delta > 0 else "none",
            "relative": round(delta / baseline.peak, 4) if baseline.peak else None,
            "components": {k: parts.get(k, 0) - base_parts.get(k, 0) for k in COMPONENTS},
        }
        if t.result.oom:
            rows[name]["oom_phase"] = t.result.oom_phase
    return {
        "method": "each change measured alone in its own process; deltas are measured peak bytes, not universal "
        "factors (a lower bound when the run ran out of memory)",
        "baseline": {
            "peak_allocated": baseline.peak,
            "oom": b.oom,
            "oom_phase": b.oom_phase,
            "microbatch": b.microbatch,
            "sequence": b.seq_worst,
            "backend": b.backend,
            "memory_limit": b.memory_limit,
            "components": base_parts,
        },
        "changes": rows,
    }


def triage(doc: Document, device: str = "cpu", steps: int = 2, memory_limit: int | None = None) -> TriageOutcome:
    """Run the baseline and the controlled tests; write ``x-sensitivity`` into the ledger ``doc`` (in memory; the
    caller saves it), and ``triage`` (the OOM Triage Worksheet) when the baseline runs out of memory."""
    from ledgerspec.derivations.engine.workload import WorkloadSpec

    spec = WorkloadSpec.from_document(doc)
    changes, skipped = controlled_changes(spec)
    jobs = {"baseline": ("as declared", spec), **changes}
    requests = {name: make_request(doc, device, steps, memory_limit, None, s) for name, (_, s) in jobs.items()}
    # one after another: measurements must not share a device, and Ctrl-C stops the one running
    results = {name: run_child(req).result for name, req in requests.items()}
    baseline = Trial("baseline", "as declared", results.pop("baseline"))
    trials = {name: Trial(name, changes[name][0], result) for name, result in results.items()}
    outcome = TriageOutcome(baseline, trials, skipped, hypotheses(baseline, trials))
    if baseline.result.oom:  # the worksheet triages an out-of-memory: without one every test would PASS
        set_plain(doc, ("triage", "phase"), baseline.result.oom_phase, force=True)
        for name, t in trials.items():
            set_plain(doc, ("triage", "controlled_tests", name), "PASS" if t.passed else "FAIL", force=True)
        for key, text in outcome.hypothesis.items():
            set_plain(doc, ("triage", "hypothesis", key), text, force=True)
    set_extension(doc, ("x-sensitivity",), matrix(baseline, trials, skipped))
    return outcome


__all__ = ["TESTS", "TriageOutcome", "Trial", "breakdown", "controlled_changes", "hypotheses", "matrix", "triage"]
