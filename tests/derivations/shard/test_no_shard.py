"""FSDP1's NO_SHARD as the document declares it (``shard.options.no_shard``): every placement replicated under
``strategy: fsdp1``. What is and is not NO_SHARD, the one-line refusals of what it does not combine with, and what
``shard`` writes for it. The step itself is checked against a real 2-rank run in ``test_fsdp1.py``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ledgerspec.contract.document import from_text, load
from ledgerspec.derivations.shard import state as S
from ledgerspec.derivations.shard.options import no_shard, shard_group
from ledgerspec.errors import LedgerspecError
from tests.support import TESTS

DATA = TESTS / "data" / "sharding"
SHARDED = "  parameter_placement: sharded\n  gradient_placement: sharded\n  optimizer_placement: sharded\n"
REPLICATED = "  parameter_placement: replicated\n  gradient_placement: replicated\n  optimizer_placement: replicated\n"


def _text(*replaced: tuple[str, str]) -> str:
    text = (DATA / "tiny-lora-measure.ledger.yaml").read_text(encoding="utf-8")
    for old, new in replaced:
        assert old in text, old
        text = text.replace(old, new)
    return text


FSDP1 = ("  strategy: fsdp2\n", "  strategy: fsdp1\n")
NO_SHARD = (SHARDED + "  reshard_after_forward: true\n", REPLICATED)


@pytest.mark.parametrize(
    ("replaced", "expected"),
    [
        ((FSDP1,), False),  # FULL_SHARD
        ((NO_SHARD,), False),  # FSDP2 with replicated placements: not FSDP1's NO_SHARD
        ((FSDP1, NO_SHARD), True),
    ],
)
def test_what_is_no_shard(replaced: tuple[tuple[str, str], ...], expected: bool) -> None:
    doc = from_text(_text(*replaced))
    assert no_shard(doc, 2) is expected
    assert shard_group(doc, 2) == (1 if expected else 2)


@pytest.mark.parametrize(
    ("extra", "where", "message"),
    [
        (
            ("  gradient_placement: replicated\n", "  gradient_placement: sharded\n"),
            "gradient_placement",
            "parallelism.gradient_placement 'sharded' beside parameter_placement: replicated",
        ),
        (("  gpu_count: 2\n", "  gpu_count: 2\n  shard_group_size: 2\n"), "shard_group_size", "shards nothing"),
        # and the other way round: sharded parameters beside replicated optimizer state is no FSDP1 strategy
        (
            (REPLICATED, SHARDED.replace("optimizer_placement: sharded", "optimizer_placement: replicated")),
            "optimizer_placement",
            "parallelism.optimizer_placement 'replicated' beside parameters that are not",
        ),
        (("  gpu_count: 2\n", "  gpu_count: 2\n  cpu_offload: true\n"), "cpu_offload", "not modelled"),
        # CPU offload declared where memory_options declares it is refused alike
        (
            ("memory_options:\n", "memory_options:\n  cpu_offload: true\n"),
            "cpu_offload",
            "CPU offload under FSDP1's NO_SHARD is not modelled",
        ),
    ],
)
def test_what_no_shard_does_not_combine_with_is_one_line_at_its_place(
    extra: tuple[str, str], where: str, message: str
) -> None:
    text = _text(FSDP1, NO_SHARD, extra)
    doc = from_text(text, "x.ledger.yaml")
    with pytest.raises(LedgerspecError) as info:
        no_shard(doc, 2)
    err = info.value
    assert message in err.message and err.exit_code == 2 and err.line is not None
    line = text.splitlines()[err.line - 1]
    assert line.lstrip().startswith(f"{where}:"), line


def test_shard_lists_one_rank_and_compares_zero_over_every_rank(tmp_path: Path) -> None:
    """``shard`` (the calculated state) of a NO_SHARD ledger: one rank holding the whole model (FSDP1 on one rank, no
    gathered units), the run's ranks named, and the ZeRO rows it is compared with over the run's 2 ranks (the
    FULL_SHARD twin's rows), not over one."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.sharder import shard

    shutil.copytree(DATA / "tiny", tmp_path / "tiny")
    results = {}
    for name, replaced in (("no_shard", (FSDP1, NO_SHARD)), ("full_shard", (FSDP1,))):
        path = tmp_path / f"{name}.ledger.yaml"
        path.write_text(_text(*replaced), encoding="utf-8")
        results[name] = shard(load(path))
    ns, full = results["no_shard"], results["full_shard"]
    assert "NO_SHARD on 2 ranks" in ns.extension["no_shard"] and "NO_SHARD" in ns.extension["strategy"]
    whole = S.fsdp1(S.peft_fsdp1_units(document_descriptors(load(tmp_path / "no_shard.ledger.yaml"))), 1)
    assert [r.frozen_base for r in ns.plan.ranks] == [whole.ranks[0].frozen_base]
    assert ns.plan.ranks[0].gathered == 0
    # partitioned over the run's 2 ranks (the gradients: every parameter of the tiny model is below ZeRO-3's
    # persistence threshold, so its ZeRO-3 row keeps them whole on every rank, as DeepSpeed does)
    assert ns.zero == full.zero and 0 < ns.zero["zero2"].gradients < whole.ranks[0].gradients
