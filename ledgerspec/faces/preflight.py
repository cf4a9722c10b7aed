"""The input checks a command runs before it imports torch: ``validate``'s own checks of the inputs.

``resolve``, ``estimate``, ``measure``, ``triage`` and ``shard`` spend seconds importing torch and building a model.
A bad input (``rank: sixteen``, a typo ``target_module``, an optimizer name that does not exist, a config path
that names no file) is found by ``validate`` without torch; :func:`preflight` runs the same checks first and fails
with validate's line (and its did-you-mean) before anything heavy is imported.
"""

from __future__ import annotations

from ledgerspec.checks.findings import ERROR, Finding
from ledgerspec.checks.validate import validate
from ledgerspec.contract import fields as F
from ledgerspec.contract.document import Document
from ledgerspec.errors import EXIT_FINDINGS, LedgerspecError

#: rules about the inputs themselves: a command cannot build the configuration while they fail
INPUT_RULES = frozenset({"LS008", "LS017", "LS023", "LS030", "LS032"})
#: rules whose warnings change what an estimate answers (LS013: a kernel it does not model or know runs as
#: transformers' own op): ``estimate`` and ``shard --estimate`` print them beside the answer
ANSWER_RULES = ("LS013",)
#: sections a command reads its configuration from (a schema error there is a bad input)
INPUT_SECTIONS = frozenset({*F.INPUT_SECTION_NAMES, "training"})
#: outside the configuration, what the device verdict reads as declared: the target device (its name and memory)
#: and the bytes outside the allocator. Unreadable, each was passed over without a word (no verdict at all, or the
#: catalogue's figure instead of the user's), so a schema error there is a bad input too
VERDICT_INPUTS = ("/result/target_device", "/outside_allocator")


def blocking(finding: Finding) -> bool:
    """An error in the inputs: a schema error inside an input section or a verdict input (:data:`VERDICT_INPUTS`),
    an unknown top-level key (a section the command would not read, perhaps an input section misspelt), or one of
    :data:`INPUT_RULES`."""
    if finding.severity != ERROR:
        return False
    if finding.rule in INPUT_RULES:
        return True
    if finding.rule != "schema":
        return False
    pointer = finding.pointer
    section = pointer.split("/")[1] if pointer.count("/") >= 1 else ""
    if pointer.count("/") == 1 and finding.message.startswith("unknown key"):
        return True  # an unknown section: a misspelt input section (optimiser:) would be read as absent
    return section in INPUT_SECTIONS or any(pointer == p or pointer.startswith(p + "/") for p in VERDICT_INPUTS)


def preflight(doc: Document, command: str, echo: tuple[str, ...] = ()) -> None:
    """Raise the first input error of ``doc`` as ``FILE:LINE:COL: COMMAND: message [RULE]`` (the others counted in
    the hint), before ``command`` imports anything heavy; nothing when the inputs are readable. ``echo``: rules
    whose findings change what the command answers (LS013: a kernel the estimate replaces by transformers' own op),
    printed on stderr as validate prints them, so that the answer does not come without them."""
    findings = validate(doc).findings
    problems = [f for f in findings if blocking(f)]
    if not problems:
        import sys

        from ledgerspec.errors import printable

        for f in findings:
            if f.rule in echo:
                print(printable(f.located(str(doc.path))), file=sys.stderr)
        return
    first = problems[0]
    more = len(problems) - 1
    hint = f"`ledgerspec validate {doc.path}` lists every finding"
    if more:
        hint = f"{more} more input error(s): " + hint
    raise LedgerspecError(
        f"{first.message} [{first.rule}]",
        doc.path,
        first.line,
        first.column,
        rule=command,
        hint=hint,
        exit_code=EXIT_FINDINGS,
    )


def import_stack_quietly() -> None:
    """This command traces: its first import of torch, transformers and peft runs with the cyclic garbage collector
    paused (:mod:`ledgerspec.derivations.stack.imports`; about 0.6 s of a cold ``estimate``)."""
    from ledgerspec.derivations.stack import imports

    imports.PAUSE_GC = True


__all__ = ["ANSWER_RULES", "INPUT_RULES", "blocking", "import_stack_quietly", "preflight"]
