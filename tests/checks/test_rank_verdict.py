"""The verdict of a document of several GPUs reads what ONE rank holds (issue 23): the worst rank's device-level
peak that ``shard --estimate`` wrote (``parallelism.x-per-rank.estimate.ranks[].device_peak``), not one GPU's
estimate of the whole model; it holds only for the declared ranks, device memory, allocator settings and inputs.

The per-rank blocks below are written by hand in the shape ``shard --estimate`` writes (checked against a real
simulation in ``tests/derivations/devices/test_per_rank.py``); the figures compared are theirs."""

from __future__ import annotations

from typing import Any

from ledgerspec.checks.ladder import RANK_DEVICE_PEAK, supported_status
from ledgerspec.checks.validate import validate
from ledgerspec.checks.verdict import DOES_NOT_FIT, FITS, UNKNOWN, verdict
from ledgerspec.contract.document import from_text
from ledgerspec.contract.fields import AT_THE_EDGE
from ledgerspec.contract.fingerprint import SHARD_INPUTS, digests, section_digest

GiB = 2**30
HEAD = """ledgerspec: ledger/v1
workload: {max_length: 4096, microbatch: 2}
result:
  target_device: {name: NVIDIA A100-SXM4-80GB, memory: 80GiB}
parallelism:
  gpu_count: 2
  strategy: fsdp1
"""


def _rank(rank: int, device_peak: int, uncertain: bool = False, oom: str | None = None) -> str:
    verdict = (
        f"{{device_memory: {80 * GiB}, cuda_total: {int(79.25 * GiB)}, alloc_conf: '', outside_from: catalogue, "
        f"uncertain: {str(uncertain).lower()}}}"
    )
    row = (
        f"      - {{rank: {rank}, peak_allocated: {{value: {device_peak - 8 * GiB}, source: CALCULATED}}, "
        f"peak_reserved: {{value: {device_peak - GiB}, source: CALCULATED}}, "
        f"outside_allocator: {{value: {GiB}, source: ASSUMPTION}}, "
        f"device_peak: {{value: {device_peak}, source: ASSUMPTION}}, verdict: {verdict}"
    )
    return row + (f", oom_phase: {oom}}}\n" if oom else "}\n")


def _text(
    *rows: str,
    text: str = HEAD,
    device: int | str = 80 * GiB,
    stamp: bool = True,
    world: int | None = None,
    group: int | None = None,
) -> str:
    """The document with a per-rank block of ``rows`` (``stamp``: with the inputs it read, as shard --estimate
    stores them; ``world``: the ranks shard launched, as it writes them in the block; ``group``: the plan's world
    beside it, a hybrid shard group's)."""
    block = (
        "  x-per-rank:\n"
        + (f"    world_size: {group}\n" if group is not None else "")
        + "    estimate:\n      source: CALCULATED\n      target: cuda\n"
        + (f"      world: {world}\n" if world is not None else "")
        + ""
        f"      device_memory: {device}\n      ranks:\n" + "".join(r.replace("      - ", "        - ") for r in rows)
    )
    if stamp:
        inputs = digests(from_text(text + block), SHARD_INPUTS)
        block += "      inputs: {" + ", ".join(f"{k}: '{v}'" for k, v in inputs.items()) + "}\n"
    return text + block


def _doc(*rows: str, **kw: Any) -> Any:
    return from_text(_text(*rows, **kw))


def _verdict(doc: Any) -> Any:
    return verdict(doc, supported_status(doc))


def test_the_worst_ranks_device_peak_is_compared() -> None:
    doc = _doc(_rank(0, 70 * GiB), _rank(1, 72 * GiB))
    v = _verdict(doc)
    assert v.answer == FITS and v.peak == 72 * GiB and v.peak_field == "parallelism.x-per-rank.estimate"
    assert v.provenance == "predicted"
    assert v.headroom == int(79.25 * GiB) - 72 * GiB  # against the CUDA total the rank was decided against
    assert "rank 1, the worst of 2" in v.sentence() and "reserved 71.00 GiB (allocator model)" in v.sentence()


def test_one_gpus_estimate_of_the_whole_model_is_not_what_a_rank_holds() -> None:
    """Without a per-rank estimate, x-estimate (one GPU holding the whole model) is compared and the verdict says
    that it is not a rank's figure and which command predicts one."""
    doc = from_text(HEAD + "x-estimate:\n  peak_allocated: {value: 120GiB, source: CALCULATED, method: m}\n")
    v = _verdict(doc)
    assert v.answer == DOES_NOT_FIT
    assert "x-estimate is one GPU holding the whole model, not one of the 2 sharded ranks" in v.sentence()
    assert "`ledgerspec shard FILE --nproc 2 --estimate` predicts each rank" in v.sentence()
    # data parallel: every GPU holds the whole model, and the estimate is the rank's: no such note
    ddp = from_text(
        HEAD.replace("fsdp1", "ddp") + "x-estimate:\n  peak_allocated: {value: 20GiB, source: CALCULATED}\n"
    )
    assert "one GPU holding the whole model" not in _verdict(ddp).sentence()


def test_a_rank_at_the_edge_does_not_fit_and_one_that_runs_out_names_its_phase() -> None:
    edge = _verdict(_doc(_rank(0, 60 * GiB), _rank(1, 61 * GiB, uncertain=True)))
    assert edge.answer == DOES_NOT_FIT and edge.headroom > 0 and AT_THE_EDGE in edge.sentence()
    assert "`ledgerspec measure --device cuda --nproc 2`" in edge.sentence()
    over = _verdict(_doc(_rank(0, 90 * GiB, oom="backward_peak"), _rank(1, 85 * GiB)))
    assert over.answer == DOES_NOT_FIT and over.oom_phase == "backward" and over.peak == 90 * GiB


def test_the_per_rank_estimate_holds_only_for_what_it_was_decided_with() -> None:
    rows = (_rank(0, 70 * GiB), _rank(1, 72 * GiB))
    other_count = _doc(*rows, text=HEAD.replace("gpu_count: 2", "gpu_count: 4"))
    assert supported_status(other_count).best_peak_from != RANK_DEVICE_PEAK
    v = _verdict(other_count)
    assert v.answer == UNKNOWN and "simulated on 2 ranks, not parallelism.gpu_count 4" in v.sentence()
    other_device = _doc(*rows, device=40 * GiB)
    assert supported_status(other_device).best_peak_from != RANK_DEVICE_PEAK
    settings = _doc(
        *rows,
        text=HEAD.replace(
            "parallelism:", "software: {pytorch_cuda_alloc_conf: 'expandable_segments:True'}\nparallelism:"
        ),
    )
    assert supported_status(settings).best_peak_from != RANK_DEVICE_PEAK


def test_an_edit_since_makes_it_answer_nothing_and_ls006_says_so() -> None:
    text = _text(_rank(0, 70 * GiB), _rank(1, 72 * GiB))
    assert _verdict(from_text(text)).answer == FITS
    edited = from_text(text.replace("microbatch: 2", "microbatch: 4"))
    v = _verdict(edited)
    assert v.answer == UNKNOWN and "is of inputs edited since" in v.sentence()
    assert "`ledgerspec shard FILE --nproc 2 --estimate` again" in v.sentence()
    found = [f for f in validate(edited).findings if f.rule == "LS006"]
    assert any("parallelism.x-per-rank.estimate" in f.message for f in found)
    # an edit of how the ranks share the model is one too
    sharded = from_text(text.replace("strategy: fsdp1", "strategy: fsdp2"))
    assert _verdict(sharded).answer == UNKNOWN
    # and a per-rank block written before the stamp is compared as it is (old documents unchanged)
    assert _verdict(_doc(_rank(0, 70 * GiB), _rank(1, 72 * GiB), stamp=False)).answer == FITS


def test_a_hybrid_shard_group_is_read_for_the_world_it_was_launched_on() -> None:
    """HSDP (a shard group of 2 on 4 GPUs) lists the group's ranks and plans the group (``x-per-rank.world_size``
    2): the ranks launched are in the block (``world``), and that is what gpu_count is compared with."""
    hybrid = HEAD.replace("gpu_count: 2", "gpu_count: 4").replace("strategy: fsdp1", "strategy: fsdp2")
    v = _verdict(_doc(_rank(0, 70 * GiB), _rank(1, 72 * GiB), text=hybrid, world=4, group=2))
    assert v.answer == FITS and v.peak == 72 * GiB
    assert (
        "`ledgerspec measure --device cuda --nproc 4`"
        in _verdict(
            _doc(_rank(0, 70 * GiB), _rank(1, 72 * GiB, uncertain=True), text=hybrid, world=4, group=2)
        ).sentence()
    )
    # a block written before it recorded the ranks launched: the plan's world, here the group's
    old = _verdict(_doc(_rank(0, 70 * GiB), _rank(1, 72 * GiB), text=hybrid, group=2))
    assert old.answer == UNKNOWN and "simulated on 2 ranks, not parallelism.gpu_count 4" in old.sentence()


def test_data_parallel_ranks_hold_the_whole_model_and_read_no_per_rank_block() -> None:
    ddp = HEAD.replace("strategy: fsdp1", "strategy: ddp")
    assert supported_status(_doc(_rank(0, 30 * GiB), _rank(1, 31 * GiB), text=ddp)).best_peak_from is None


def _with(head: str, software: str) -> str:
    return head.replace("parallelism:", f"software: {software}\nparallelism:", 1)


def test_a_declared_version_edited_across_a_known_difference_is_an_edit() -> None:
    """shard models the declared side of each known stack difference (bitsandbytes < 0.43.2 keeps the 4-bit layers'
    inputs) and records none of its own: its stamp holds the side each declared version falls on. Another version on
    the same side is no edit; one across the difference is, and so is declaring one where none was."""
    text = _text(_rank(0, 70 * GiB), _rank(1, 72 * GiB), text=_with(HEAD, "{bitsandbytes: 0.43.0}"))
    assert _verdict(from_text(text)).answer == FITS
    assert _verdict(from_text(text.replace("bitsandbytes: 0.43.0", "bitsandbytes: 0.43.1"))).answer == FITS
    across = from_text(text.replace("bitsandbytes: 0.43.0", "bitsandbytes: 0.50.0"))
    assert _verdict(across).answer == UNKNOWN
    assert any("software" in f.message for f in validate(across).findings if f.rule == "LS006")
    undeclared = _text(_rank(0, 70 * GiB), _rank(1, 72 * GiB), text=_with(HEAD, "{peft: 0.10.0}"))
    assert _verdict(from_text(undeclared.replace("{peft: 0.10.0}", "{peft: 0.10.0, transformers: 4.39.1}"))).answer == (
        UNKNOWN
    )
    none = _text(_rank(0, 70 * GiB), _rank(1, 72 * GiB))  # no version declared: the installed side was modelled
    assert _verdict(from_text(none)).answer == FITS
    assert _verdict(from_text(_with(none, "{bitsandbytes: 0.42.0}"))).answer == UNKNOWN
    # a stamp written before the versions were read is checked on the rest (documents stamped then unchanged)
    earlier = {k: section_digest(from_text(text), k, v, earlier=True) for k, v in SHARD_INPUTS.items()}
    now = digests(from_text(text), SHARD_INPUTS)
    assert earlier["software"] != now["software"]
    old = text.replace(f"software: '{now['software']}'", f"software: '{earlier['software']}'")
    assert old != text and _verdict(from_text(old)).answer == FITS


def test_sizes_with_units_a_renamed_card_and_edited_outside_parts() -> None:
    row = _rank(1, 72 * GiB).replace(f"device_peak: {{value: {72 * GiB}", "device_peak: {value: 72GiB")
    assert _verdict(_doc(_rank(0, 70 * GiB), row, device="80GiB")).peak == 72 * GiB
    named = _rank(0, 70 * GiB).replace(
        "alloc_conf: ''", "alloc_conf: '', named_by: result.target_device.name, device: A"
    )
    assert supported_status(_doc(named, _rank(1, 72 * GiB))).best_peak_from != RANK_DEVICE_PEAK
    parts = _rank(0, 70 * GiB).replace("alloc_conf: ''", "alloc_conf: '', outside_held: {nccl: 100}")
    assert supported_status(_doc(parts, _rank(1, 72 * GiB))).best_peak_from != RANK_DEVICE_PEAK


def test_an_earlier_one_gpu_result_fits_does_not_hold_the_ranks_back() -> None:
    """The bundled estimated ledger, declared on 2 FSDP1 ranks, with ``result.fits: false`` from an earlier one-GPU
    estimate of the whole model: the per-rank verdict (it fits, its stamp current) reaches CANDIDATE; without it,
    result.fits still holds the status down."""
    from tests.support import EXAMPLES

    text = (EXAMPLES / "llama-2-7b-lora.estimated.ledger.yaml").read_text(encoding="utf-8")
    assert "\nresult:\n  target_device:\n    memory: 25769803776\n  fits: true\n" in text
    assert "\nparallelism:\n  gpu_count: 1\n" in text
    text = text.replace("  fits: true\n", "  fits: false\n", 1)
    sharded = text.replace("\nparallelism:\n  gpu_count: 1\n", "\nparallelism:\n  gpu_count: 2\n  strategy: fsdp1\n")
    card = {str(80 * GiB): str(24 * GiB), str(int(79.25 * GiB)): "25447681229"}

    def on_the_card(row: str) -> str:
        for old, new in card.items():
            row = row.replace(old, new)
        return row

    rows = (on_the_card(_rank(0, 20 * GiB)), on_the_card(_rank(1, 20 * GiB)))
    per_rank = _text(*rows, text="", device=24 * GiB, world=2, group=2, stamp=False)
    with_block = sharded.replace("  strategy: fsdp1\n", "  strategy: fsdp1\n" + per_rank, 1)
    inputs = digests(from_text(with_block), SHARD_INPUTS)
    stamp = "      inputs: {" + ", ".join(f"{k}: '{v}'" for k, v in inputs.items()) + "}\n"
    assert "\n\nledger:" in with_block
    stamped = with_block.replace("\n\nledger:", "\n" + stamp + "\nledger:", 1)
    assert not [f for f in validate(from_text(stamped)).findings if f.rule == "LS006"]
    res = supported_status(from_text(stamped))
    assert res.best_peak_from == RANK_DEVICE_PEAK and res.status == "CANDIDATE", res.reasons
    held = supported_status(from_text(sharded))
    assert held.status == "CALCULATED" and "result.fits is false" in held.reasons
