"""``ledgerspec init``: a ledger skeleton with every field UNKNOWN and the article's guidance as comments."""

from __future__ import annotations

import textwrap
from typing import Any

from ledgerspec.contract import config
from ledgerspec.contract import fields as F
from ledgerspec.contract.document import Document, from_text, rebase
from ledgerspec.contract.writer import render

_WIDTH = 100
# the catalogue fields that are free-form: left out of the skeleton rather than written UNKNOWN
_SKIP = {("notes",), ("title",), ("status",)}


def _comment(text: str, indent: str) -> list[str]:
    return [f"{indent}# {line}" for line in textwrap.wrap(text, _WIDTH - len(indent) - 2)]


def _lines(
    fields: tuple[F.Field, ...], depth: int, prefix: tuple[str, ...], skip: frozenset[tuple[str, ...]] = frozenset()
) -> list[str]:
    out: list[str] = []
    indent = "  " * depth
    for f in fields:
        path = (*prefix, f.name)
        if path in _SKIP or path in skip:
            continue
        if f.kind == F.OBJECT:
            if depth == 0:
                out.append("")
            out += _comment(f.description, indent)
            out.append(f"{indent}{f.name}:")
            out += _lines(f.children, depth + 1, path, skip)
        else:
            out += _comment(f.description, indent)
            out.append(f"{indent}{f.name}: UNKNOWN")
    return out


def skeleton_text(kind: str = "ledger", skip: frozenset[tuple[str, ...]] = frozenset()) -> str:
    head = [
        "# Training Memory Ledger skeleton (ledgerspec init). Every field is UNKNOWN: replace each with a",
        "# plain value, or the long form",
        "# {value: ..., source: MEASURED|VERIFIED|CALCULATED|ASSUMPTION, note: ..., method: ...}.",
        "# `ledgerspec resolve` fills the derivable figures; `ledgerspec validate` says what holds the status down.",
        f"ledgerspec: {kind}/v1",
        "status: INSUFFICIENT DATA",
        "title: UNKNOWN",
    ]
    return "\n".join([*head, *_lines(F.top_fields(kind), 0, (), skip)]) + "\n"


def skeleton(from_intake: Document | None = None, output: str | None = None) -> str:
    """A ledger skeleton; with ``from_intake``, the values of its intake sections are copied in.

    The skeleton's guidance comments stay, and the intake's comments travel with their keys: an
    end-of-line comment stays on its key's line, comment lines above a key end up just above it, after
    the skeleton's guidance (:func:`_copy_comments`).

    ``output`` is where the ledger will be written (standard output: the current folder), so that a
    relative ``identity.config_path`` still points at the same file.
    """
    if from_intake is None:
        return skeleton_text("ledger")
    text = skeleton_text("ledger", _not_applicable(from_intake))
    doc = from_text(text, "<skeleton>")
    data: Any = doc.data
    src: Any = from_intake.data
    _merge(data, {k: v for k, v in src.items() if k not in ("ledgerspec", "status", "pilot")})
    _copy_comments(src, data, "", top=True)
    config_path = from_intake.get("identity", "config_path").text()
    if config_path and from_intake.get("identity", "config_path").form == "plain":
        data["identity"]["config_path"] = rebase(config_path, from_intake.path, output)
    if "pilot" in src:  # the ledger has no pilot section: kept as written in x-pilot, as `resolve -o` keeps it
        data["x-pilot"] = src["pilot"]
    return render(data, text)


def _not_applicable(intake: Document) -> frozenset[tuple[str, ...]]:
    """Skeleton fields the intake shows cannot apply, left out: UNKNOWN, they would hold the ledger below
    VALIDATED until deleted by hand (a LoRA run has no quantization; a CUDA stack has no ROCm version)."""
    skip: set[tuple[str, ...]] = set()
    cfg = config.read(intake)
    if cfg.kind == "LoRA" and not cfg.quantized:
        skip |= {
            ("base_model", k)
            for k in ("quantization", "prepare_for_kbit_training")
            if not intake.get("base_model", k).present
        }
    for given, other in (("cuda", "rocm"), ("rocm", "cuda")):
        if intake.get("software", given).known and not intake.get("software", other).present:
            skip.add(("software", other))
    return frozenset(skip)


def _merge(dst: Any, src: Any) -> None:
    """The intake's values into the skeleton, key by key (nested mappings too), so that the skeleton's own
    mappings, with their guidance comments, stay and only the leaves change."""
    for key, value in src.items():
        if key in dst and isinstance(value, dict) and isinstance(dst[key], dict):
            _merge(dst[key], value)
        else:
            dst[key] = value


def _split(token: Any) -> tuple[str | None, list[str]]:
    """A ruamel comment token after a value: its end-of-line comment and the comment lines that follow it."""
    if token is None:
        return None, []
    eol, _, rest = str(token.value).partition("\n")
    lines = [line.strip() for line in rest.splitlines() if line.strip().startswith("#")]
    return (eol.strip() if eol.strip().startswith("#") else None), lines


def _copy_comments(src: Any, dst: Any, indent: str, top: bool = False) -> None:
    """Carry the comments of mapping ``src`` (the intake) onto the same keys of ``dst`` (the skeleton)."""
    from ruamel.yaml.error import CommentMark
    from ruamel.yaml.tokens import CommentToken

    keys = list(src)
    targets = list(dst)
    for i, key in enumerate(keys):
        if key not in dst or (top and key in ("ledgerspec", "status")):
            continue
        if i > 0:
            above = _split((src.ca.items.get(keys[i - 1]) or [None] * 4)[2])[1]
        elif not top:  # the first key's lines sit on the mapping itself; the document's first are its header
            above = [
                line.strip()
                for t in ((src.ca.comment or [None, None])[1] or [])
                for line in str(t.value).splitlines()
                if line.strip().startswith("#")
            ]
        else:
            above = []
        if above:
            block = "".join(f"{indent}{line}\n" for line in above)
            j = targets.index(key)
            if j == 0:
                if dst.ca.comment is None:
                    dst.ca.comment = [None, []]
                if dst.ca.comment[1] is None:
                    dst.ca.comment[1] = []
                dst.ca.comment[1].append(CommentToken(block, CommentMark(len(indent)), None))
            else:
                slot = dst.ca.items.setdefault(targets[j - 1], [None] * 4)
                if slot[2] is None:
                    slot[2] = CommentToken("\n" + block, CommentMark(0), None)
                else:
                    slot[2].value = str(slot[2].value).rstrip(" ") + block
        child = src[key]
        if hasattr(child, "ca") and hasattr(dst[key], "ca"):
            if dst[key] is not child:
                _copy_comments(child, dst[key], indent + "  ")
            else:  # the intake's mapping itself was copied in (without the skeleton's guidance inside it): the
                # lines above its first key sit on the parent too, where the skeleton's guidance for its own
                # first key would otherwise be printed above the intake's first key
                slot = dst.ca.items.setdefault(key, [None] * 4)
                slot[3] = list((src.ca.items.get(key) or [None] * 4)[3] or []) or None
        eol = _split((src.ca.items.get(key) or [None] * 4)[2])[0]
        if eol:
            slot = dst.ca.items.get(key)
            if slot is not None and slot[2] is not None and not str(slot[2].value).startswith("#"):
                slot[2].value = " " + eol + str(slot[2].value)
            elif slot is not None and slot[2] is None and slot[3]:
                # the skeleton had a mapping here (its guidance in slot[3]) and the intake a scalar with a comment
                # (`adapter: float32  # c`): ruamel's yaml_add_eol_comment cannot extend such a slot
                slot[2] = CommentToken(f" {eol}\n", CommentMark(0), None)
            elif slot is None or slot[2] is None:
                dst.yaml_add_eol_comment(eol, key)
