"""contract/edit: long-form figures with provenance precedence, written without disturbing the file's layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from ledgerspec.contract.document import from_text
from ledgerspec.contract.edit import set_figure, set_plain
from ledgerspec.contract.writer import render

TEXT = """ledgerspec: ledger/v1
identity:
  model_id: x   # the model
  config_path: c.json

# the method
method:
  kind: LoRA
  bias: none

ledger:
  adapter: 5  # my own note
  gradients: {value: 1, source: CALCULATED, method: m}  # 1 B

# trailing comment
"""


def _write(changes: list[tuple[tuple[str, ...], int, str]]) -> str:
    doc = from_text(TEXT, "t.ledger.yaml")
    set_plain(doc, ("identity", "architecture"), "LlamaForCausalLM")
    for path, value, source in changes:
        set_figure(doc, path, value, source, "how")
    return render(doc.data, TEXT)


def test_appended_keys_go_before_the_blank_line_and_the_next_sections_comment() -> None:
    out = _write(
        [(("identity", "total_parameters"), 123, "VERIFIED"), (("method", "trainable_parameters"), 7, "VERIFIED")]
    )
    assert (
        "  architecture: LlamaForCausalLM\n  total_parameters: {value: 123, source: VERIFIED, method: how}\n"
        "\n# the method\nmethod:\n"
    ) in out
    assert "  bias: none\n  trainable_parameters: {value: 7, source: VERIFIED, method: how}\n\nledger:\n" in out


def test_size_comments_sit_beside_their_value_and_keep_the_lines_after_them() -> None:
    out = _write([(("ledger", "gradients"), 2048, "CALCULATED"), (("ledger", "optimizer"), 4096, "CALCULATED")])
    assert "  gradients: {value: 2048, source: CALCULATED, method: how}  # 2.00 KiB\n" in out
    assert "  optimizer: {value: 4096, source: CALCULATED, method: how}  # 4.00 KiB\n\n# trailing comment\n" in out


def test_a_users_comment_is_never_replaced_by_a_size_comment() -> None:
    out = _write([(("ledger", "adapter"), 33554432, "CALCULATED")])
    assert "adapter: {value: 33554432, source: CALCULATED, method: how}  # my own note\n" in out


def test_writing_again_is_a_no_op_and_the_result_round_trips() -> None:
    changes: list[tuple[tuple[str, ...], int, str]] = [
        (("identity", "total_parameters"), 123, "VERIFIED"),
        (("ledger", "gradients"), 2048, "CALCULATED"),
    ]
    once = _write(changes)
    doc = from_text(once, "t.ledger.yaml")
    assert all(set_figure(doc, p, v, s, "how") is None for p, v, s in changes)
    assert render(doc.data, once) == once


@pytest.mark.parametrize(
    ("old", "new", "kept"),
    [
        ("MEASURED", "CALCULATED", True),
        ("MEASURED", "VERIFIED", True),
        ("VERIFIED", "CALCULATED", True),
        ("CALCULATED", "VERIFIED", False),
        ("ASSUMPTION", "CALCULATED", False),
        ("CALCULATED", "MEASURED", False),
    ],
)
def test_a_value_is_never_replaced_by_a_weaker_one(old: str, new: str, kept: bool) -> None:
    text = f"ledgerspec: ledger/v1\nledger:\n  adapter: {{value: 10, source: {old}, note: n, method: m}}\n"
    doc = from_text(text, "t.ledger.yaml")
    change = set_figure(doc, ("ledger", "adapter"), 20, new, "how")
    assert change is not None
    assert (change.skipped is not None) == kept
    assert doc.get("ledger", "adapter").value == (10 if kept else 20)


# -- the one save path ----------------------------------------------------------------------------------------------


def test_save_keeps_a_byte_order_mark_and_the_layout(tmp_path: Path) -> None:
    from ledgerspec.contract.document import load
    from ledgerspec.contract.writer import save

    path = tmp_path / "x.ledger.yaml"
    path.write_bytes(b"\xef\xbb\xbfledgerspec: ledger/v1\n# a comment\n\nmethod:\n  rank: 8  # r\n")
    doc = load(path)
    set_figure(doc, ("ledger", "adapter"), 1024, "CALCULATED", "x")
    save(doc, str(path))
    raw = path.read_bytes()
    assert raw.startswith(b"\xef\xbb\xbfledgerspec: ledger/v1\n# a comment\n\nmethod:\n  rank: 8  # r\n")
    assert load(path).get("ledger", "adapter").size() == 1024


def test_a_status_only_edit_keeps_every_other_byte(tmp_path: Path) -> None:
    from ledgerspec.contract.document import load
    from ledgerspec.contract.edit import set_status
    from ledgerspec.contract.writer import save

    path = tmp_path / "x.ledger.yaml"
    text = "ledgerspec:   ledger/v1\r\nstatus: 'CANDIDATE'   # mine\r\nmethod: {rank:   8}\r\n\r\n\r\n"
    path.write_bytes(text.encode())
    doc = load(path)
    set_status(doc, "CALCULATED", "ledgerspec: lowered from CANDIDATE: why")
    save(doc, str(path))
    want = text.replace("'CANDIDATE'   # mine", "'CALCULATED'  # ledgerspec: lowered from CANDIDATE: why | was: mine")
    assert path.read_bytes() == want.encode()


def test_remove_keeps_the_lines_that_followed_and_prunes_an_empty_section() -> None:
    from ledgerspec.contract.edit import remove
    from ledgerspec.contract.writer import document_text

    doc = from_text("ledgerspec: ledger/v1\nmetrics:\n  peak_allocated: 1  # x\n\n# next\nresult:\n  oom: false\n")
    remove(doc, ("metrics", "peak_allocated"))
    assert "metrics" not in doc.plain and doc.get("metrics", "peak_allocated").present is False
    assert document_text(doc) == "ledgerspec: ledger/v1\n\n# next\nresult:\n  oom: false\n"


SPACED = """ledgerspec: ledger/v1
status: CALCULATED

identity:
  model_id: x
  config_path: c.json

method:
  kind: LoRA
  bias: none   # no bias

workload:
  microbatch: 1

memory_options:
  gradient_checkpointing: true
"""


def test_new_sections_get_the_blank_lines_the_document_puts_between_its_sections() -> None:
    """Issue 13: a resolved YAML kept no blank line before the sections resolve added (gradients, ledger,
    x-resolve) nor after a block it appended at the end of a section (method.x-breakdown)."""
    from ledgerspec.contract.edit import blank_lines_between_sections, set_extension

    doc = from_text(SPACED, "t.ledger.yaml")
    assert blank_lines_between_sections(doc)
    set_figure(doc, ("gradients", "parameters"), 8, "VERIFIED", "count")  # between workload and memory_options
    set_extension(doc, ("method", "x-breakdown"), [{"module": "q", "count": 2}])  # a block at the end of method
    set_figure(doc, ("ledger", "adapter"), 32, "CALCULATED", "8 x 4")  # appended at the end of the document
    set_extension(doc, ("x-resolve",), {"inputs": {"method": "abc"}})
    out = render(doc.data, SPACED)
    lines = out.splitlines()
    tops = [i for i, line in enumerate(lines) if line and not line[0].isspace() and i > 1]
    assert [lines[i].split(":")[0] for i in tops] == [
        "identity",
        "method",
        "workload",
        "gradients",
        "memory_options",
        "ledger",
        "x-resolve",
    ]
    assert all(lines[i - 1] == "" for i in tops), out
    assert "  bias: none   # no bias\n  x-breakdown:\n" in out and out.count("\n\n") == len(tops)
    assert not out.endswith("\n\n")


def test_a_document_without_blank_lines_gets_none() -> None:
    from ledgerspec.contract.edit import blank_lines_between_sections

    text = SPACED.replace("\n\n", "\n")
    doc = from_text(text, "t.ledger.yaml")
    assert not blank_lines_between_sections(doc)
    set_figure(doc, ("ledger", "adapter"), 32, "CALCULATED", "8 x 4")
    assert "\n\n" not in render(doc.data, text)
