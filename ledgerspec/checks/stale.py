"""Stale evidence: figures a command computed from inputs that were edited after it ran.

The status ladder calls :func:`stale_evidence` once per rung; rule LS006 reports the edit itself. Both read the
fingerprints of :mod:`ledgerspec.contract.fingerprint`, so they agree. A MEASURED figure is what was measured:
the resolver's fingerprint never discounts it, only a stale ``x-measure`` (a measurement of other inputs)
holds VALIDATED. Pure: no I/O, no torch.
"""

from __future__ import annotations

from ledgerspec.contract import fields as F
from ledgerspec.contract.document import Document
from ledgerspec.contract.fingerprint import SHARD_ESTIMATE, stale

COMPONENTS = F.RESIDENT
#: the command that writes the per-rank estimate again (N: the ranks)
SHARD_AGAIN = "ledgerspec shard FILE --nproc N --estimate"


def shard_again(ranks: int | None) -> str:
    """:data:`SHARD_AGAIN` for ``ranks`` (None: as it is)."""
    return SHARD_AGAIN if ranks is None else SHARD_AGAIN.replace("--nproc N", f"--nproc {ranks}")


_PEAKS = ("peak_allocated", "peak_reserved", "device_peak")


#: how to refresh a stamp, where it is not ``ledgerspec COMMAND FILE``
AGAIN = {
    "measure": "measure again",
    "shard": f"run `{SHARD_AGAIN}`",
}


def edited_since(command: str, sections: list[str]) -> str:
    """``method, adapter changed since `ledgerspec resolve` ran (run `ledgerspec resolve FILE`)``."""
    again = AGAIN.get(command, f"run `ledgerspec {command} FILE`")
    ran = "shard --estimate" if command == "shard" else command
    return f"{', '.join(sections)} changed since `ledgerspec {ran}` ran ({again})"


def stale_evidence(doc: Document, level: str, best_peak_from: str | None = None) -> list[str]:
    """Why figures computed from since-edited inputs cannot support ``level`` (CALCULATED, CANDIDATE, VALIDATED).

    CALCULATED: the four resident components, when resolve's inputs changed (unless MEASURED). CANDIDATE: the
    estimate's activation figure and predicted peak, when its inputs changed and nothing measured stands in.
    VALIDATED: the measurement, when its inputs changed. ``best_peak_from``: where the ladder's best peak came from.
    """
    changed = stale(doc)
    out: list[str] = []
    if level == "CALCULATED" and "resolve" in changed:
        why = edited_since("resolve", changed["resolve"])
        for key in COMPONENTS:
            source = doc.get("ledger", key).source
            if source in ("CALCULATED", "VERIFIED"):
                out.append(f"ledger.{key} is {source} from other inputs: {why}")
    elif level == "CANDIDATE" and "estimate" in changed:
        why = edited_since("estimate", changed["estimate"])
        measured_peak = any(doc.get("metrics", k).source == "MEASURED" for k in _PEAKS)
        if doc.get("ledger", "activations").source == "CALCULATED" and not measured_peak:
            out.append(f"ledger.activations is CALCULATED from other inputs: {why}")
        if best_peak_from in ("x-estimate.peak_allocated", "x-estimate.device_peak"):
            out.append(f"the predicted peak {best_peak_from} is from other inputs: {why}")
    elif level == "VALIDATED" and "measure" in changed:
        why = edited_since("measure", changed["measure"])
        out.append(f"the measurement (x-measure, phases, metrics) is of other inputs: {why}")
    if level == "CANDIDATE" and "shard" in changed and (best_peak_from or "").startswith(SHARD_ESTIMATE):
        # the per-rank estimate's peak, beside the estimate's evidence above (each command's own stamp)
        out.append(
            f"the predicted peak {best_peak_from} is from other inputs: {edited_since('shard', changed['shard'])}"
        )
    return out


__all__ = ["AGAIN", "SHARD_AGAIN", "edited_since", "shard_again", "stale_evidence"]
