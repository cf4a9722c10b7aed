"""An FSDP1 rank's device-level stream: the load unit by unit with ``use_orig_params=False``, and where the checkpoint
sits when FSDP applies it (``parallelism.activation_checkpointing``).

Independent truths:

- FSDP1 flattens each unit's parameters into a new flat tensor and, with ``use_orig_params=False``, drops the
  originals (``FlatParamHandle``: the module's attributes become views of the flat parameter); with
  ``use_orig_params=True`` the originals become those views. Either way a unit's unsharded originals are gone once
  it is wrapped, so the load never holds more in one mode than in the other (the flat parameter has no alignment
  padding without ``use_orig_params``). A leak of the originals shows as the earlier units' bytes on top.
- Where transformers < 4.52 checkpoints (around the unit) is read in its source
  (:mod:`ledgerspec.derivations.shard.fsdp.legacy_checkpoint`); torch's ``apply_activation_checkpointing`` wraps the
  decoder layer inside its unit whatever the transformers version.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import load
from tests.support import DATA

LEDGER = DATA / "sharding" / "tiny-lora-fsdp1-sync.ledger.yaml"


def _ledger(tmp_path: Path, name: str, *extra: str) -> Path:
    text = LEDGER.read_text(encoding="utf-8").replace("config_path: tiny/config.json", "config_path: config.json")
    path = tmp_path / name
    path.write_text(text.rstrip("\n") + "\n" + "".join(f"  {line}\n" for line in extra), encoding="utf-8")
    (tmp_path / "config.json").write_text((LEDGER.parent / "tiny" / "config.json").read_text(encoding="utf-8"))
    return path


def _load_peak(path: Path) -> tuple[int, int]:
    """Rank 0's stream: the tracker's peak in the load window, and the bytes held when the load ends."""
    pytest.importorskip("peft")
    from ledgerspec.derivations.shard.fsdp import simulate
    from ledgerspec.derivations.shard.model import document_descriptors

    doc = load(path)
    est = simulate.estimate_per_rank(doc, 2, document_descriptors(doc), target="cuda", streams=True)
    step = est.ranks[0].step
    assert step is not None
    return step.tracker_windows[step.windows[0]]


@pytest.mark.slow
def test_the_load_without_orig_params_keeps_no_unit_whole(tmp_path: Path) -> None:
    """Unit by unit, ``use_orig_params: false`` holds no more at the load's peak than ``true`` (it held every
    earlier unit's unsharded originals until the wrapping ended: the memo of tied weights kept them alive)."""
    flat_peak, flat_end = _load_peak(_ledger(tmp_path, "flat.ledger.yaml", "use_orig_params: false"))
    orig_peak, orig_end = _load_peak(_ledger(tmp_path, "orig.ledger.yaml", "use_orig_params: true"))
    assert flat_end <= orig_end
    assert flat_peak <= orig_peak


def test_activation_checkpointing_keeps_the_checkpoint_inside_the_unit(tmp_path: Path) -> None:
    """A declared transformers 4.48 checkpoints around the FSDP1 unit; FSDP's own checkpointing does not, whatever
    the version; a value that is not a switch is a usage error at its line."""
    from ledgerspec.derivations.shard.fsdp.legacy_checkpoint import models_outside_checkpoint
    from ledgerspec.errors import EXIT_USAGE, LedgerspecError

    old = "software: {transformers: 4.48.1}"
    text = LEDGER.read_text(encoding="utf-8") + old + "\n"
    (tmp_path / "legacy.ledger.yaml").write_text(text, encoding="utf-8")
    assert models_outside_checkpoint(load(tmp_path / "legacy.ledger.yaml"))
    sync = "  sync_module_states: true\n"
    fsdp = text.replace(sync, sync + "  activation_checkpointing: true\n")
    (tmp_path / "fsdp.ledger.yaml").write_text(fsdp, encoding="utf-8")
    assert not models_outside_checkpoint(load(tmp_path / "fsdp.ledger.yaml"))
    bad = fsdp.replace("activation_checkpointing: true", "activation_checkpointing: sometimes")
    (tmp_path / "bad.ledger.yaml").write_text(bad, encoding="utf-8")
    with pytest.raises(LedgerspecError) as caught:
        models_outside_checkpoint(load(tmp_path / "bad.ledger.yaml"))
    assert caught.value.exit_code == EXIT_USAGE and "activation_checkpointing" in str(caught.value)


@pytest.mark.slow
def test_a_custom_loop_waits_for_the_device_only_when_it_reads_its_loss(tmp_path: Path) -> None:
    """The host waits for the device when it reads the loss (``loss.item()``): with
    ``training.loss_item_each_step`` the custom loop's stream completes backward's pending frees at the end of each
    micro-step (one more ``sync`` per micro-step), without it only FSDP1's own waits do; the allocated figures are
    the same either way (a wait frees no tensor)."""
    pytest.importorskip("peft")
    from ledgerspec.derivations.shard.fsdp import simulate
    from ledgerspec.derivations.shard.model import document_descriptors

    def run(*training: str) -> Any:
        path = _ledger(tmp_path, f"custom{len(training)}.ledger.yaml")
        path.write_text(
            path.read_text(encoding="utf-8") + "training:\n" + "".join(f"  {t}\n" for t in training), encoding="utf-8"
        )
        doc = load(path)
        return simulate.estimate_per_rank(doc, 2, document_descriptors(doc), target="cuda", streams=True)

    quiet, reading = run("loop: custom"), run("loop: custom", "loss_item_each_step: true")
    assert quiet.ranks[0].phases == reading.ranks[0].phases
    assert "(training.loss_item_each_step)" in reading.method and "loss_item_each_step" not in quiet.method

    def syncs(est: Any) -> int:
        step = est.ranks[0].step
        assert step is not None
        return sum(1 for e in step.events if e == ("sync", 0))

    micro_steps = 2  # the protocol's two steps of one micro-step each
    assert syncs(reading) == syncs(quiet) + micro_steps
