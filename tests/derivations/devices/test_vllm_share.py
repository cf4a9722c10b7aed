"""Colocated vLLM at the device level: its share of the card is outside what the training step's allocator can get.

TRL 1.16 starts vLLM inside the training process (``vllm_mode: colocate``, its default) and vLLM sizes its instance to
``gpu_memory_utilization`` x the device's total before training starts; with ``vllm_enable_sleep_mode`` TRL puts it to
sleep at level 2 after every generation (its weights and KV cache released). The defaults are read here from TRL's own
``GRPOConfig``/``RLOOConfig``, not from ledgerspec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ledgerspec.contract.document import Document, from_text

HEAD = "ledgerspec: ledger/v1\nsoftware: {gpu_name: NVIDIA H100 80GB HBM3}\ntraining:\n"
CUDA_TOTAL = 79_110_000_000  # any total: the share is a fraction of it


def _doc(training: str) -> Document:
    return from_text(HEAD + training, "x.ledger.yaml")


def _trl_default(config: str, name: str) -> Any:
    trl = pytest.importorskip("trl")
    return {f.name: f.default for f in dataclasses.fields(getattr(trl, config))}[name]


def _target() -> Any:
    from ledgerspec.derivations.devices.target import Target

    return Target(80 * 2**30, "NVIDIA H100 80GB HBM3", "software.gpu_name", cuda_total=CUDA_TOTAL)


def _share(training: str) -> int:
    from ledgerspec.derivations.devices.target import vllm_share_of

    return vllm_share_of(_doc(training), _target())


@pytest.mark.parametrize("trainer", ["GRPO", "RLOO"])
def test_colocate_is_trls_default_mode_and_its_share_is_taken(trainer: str) -> None:
    assert _trl_default(f"{trainer}Config", "vllm_mode") == "colocate"
    share = _trl_default(f"{trainer}Config", "vllm_gpu_memory_utilization")
    objective = f"  objective: {trainer.lower()}\n"
    assert _share(objective + "  objective_settings: {use_vllm: true}\n") == int(share * CUDA_TOTAL)
    declared = "  objective_settings: {use_vllm: true, vllm_mode: colocate, vllm_gpu_memory_utilization: 0.5}\n"
    assert _share(objective + declared) == int(0.5 * CUDA_TOTAL)


@pytest.mark.parametrize(
    "training",
    [
        "  objective: grpo\n  objective_settings: {use_vllm: true, vllm_mode: server}\n",
        "  objective: grpo\n  objective_settings: {use_vllm: true, vllm_enable_sleep_mode: true}\n",
        "  objective: grpo\n  objective_settings: {use_vllm: false}\n",
        "  objective: grpo\n",
        "  objective: sft\n  objective_settings: {use_vllm: true}\n",
    ],
)
def test_no_share_without_a_colocated_awake_engine(training: str) -> None:
    """Server mode (another process or card), sleep mode (released while training), no vLLM, no generation."""
    assert _share(training) == 0


def test_the_share_is_added_to_what_lies_outside_the_allocator() -> None:
    from ledgerspec.derivations.devices.target import high_of, outside_of

    server = outside_of(
        _doc("  objective: grpo\n  objective_settings: {use_vllm: true, vllm_mode: server}\n"), _target()
    )
    colocate = outside_of(_doc("  objective: grpo\n  objective_settings: {use_vllm: true}\n"), _target())
    share = int(0.3 * CUDA_TOTAL)
    assert (colocate.vllm, colocate.bytes - server.bytes) == (share, share)
    high = high_of(server)
    assert high is not None and high_of(colocate) == high + share
    assert "colocated vLLM's share" in colocate.method
    declared = "outside_allocator:\n  total: {value: 1 GiB, source: ASSUMPTION, note: ours}\n"
    text = "  objective: grpo\n  objective_settings: {use_vllm: true}\n" + declared
    held = outside_of(_doc(text), _target())
    assert held.bytes == 2**30 + share  # a figure the ledger holds: the share on top


@pytest.mark.parametrize("share", ["0", "1.5"])
def test_a_share_outside_0_to_1_is_refused_in_one_line(share: str) -> None:
    pytest.importorskip("torch")
    from ledgerspec.derivations.engine.workload import WorkloadSpec
    from ledgerspec.errors import LedgerspecError
    from tests.support import REPO_ROOT

    path = REPO_ROOT / "examples" / "objectives" / "llama-3.1-8b-lora-grpo.ledger.yaml"
    settings = "objective_settings: {num_generations: 8, max_completion_length: 512}"
    text = path.read_text(encoding="utf-8")
    assert settings in text
    vllm = settings[:-1] + f", use_vllm: true, vllm_gpu_memory_utilization: {share}}}"
    doc = from_text(text.replace(settings, vllm), str(path))
    with pytest.raises(LedgerspecError, match="vllm_gpu_memory_utilization must be above 0 and at most 1") as err:
        WorkloadSpec.from_document(doc)
    assert "\n" not in str(err.value) and err.value.line is not None
