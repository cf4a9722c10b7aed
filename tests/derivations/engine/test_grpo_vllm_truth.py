"""GRPO and RLOO with vLLM in server mode (``use_vllm: true, vllm_mode: server``): the step ledgerspec simulates and
measures is the step TRL 1.16's ``GRPOTrainer`` and ``RLOOTrainer`` run, to the byte but for one 0-dim scalar.

The configurations of ``test_grpo_truth``'s ``lora-2-generations`` and ``rloo-lora-2-generations`` cases, each run
three ways on the CPU:

- the truth: TRL's real ``GRPOTrainer`` (``RLOOTrainer``) with ``use_vllm=True, vllm_mode="server"``
  (``tests/truths/grpo_run.py``): only the network client is a stub (TRL's ``VLLMClient``: fixed completions of
  ``max_completion_length`` tokens, each with the log-prob -1.0, and the weight updates packed as vLLM's trainer side
  packs them); TRL's ``VLLMGeneration.sync_weights`` (PEFT's ``merge_adapter``, the parameter walk,
  ``unmerge_adapter``), the lists it returns, the importance-sampling correction (GRPO only: the old policy's
  log-probs, always computed with vLLM; the ``sequence_mask`` ratio; its metrics), the buffered batch and the loss are
  TRL's own;
- ``ledgerspec measure --device cpu`` and ``ledgerspec estimate --target cpu --full`` of the ledger that declares it.

The one difference: 4 bytes in every training phase, the same 0-dim scalar the real trainers keep beyond the simulated
step without vLLM (``test_grpo_truth.SCALARS``: the backward's seed gradient among them); the generation phase has no
difference (without vLLM GRPO's 8 bytes there were scalars of transformers' ``generate``, which does not run here).
What the phases do not pin: the weight sync (merge temporaries and the packed chunk, here the model's parameters,
213,632 bytes) is below the generation phase's peak in these configurations (the old policy's forward through the
fused LM head); ``test_vllm_sync`` pins it by itself, allocation by allocation. Its packing follows vLLM's
``packed_nccl_broadcast_producer`` as read in vLLM's source (vllm-project/vllm@00a9ccfb,
vllm/distributed/weight_transfer/packed_tensor.py), not a run of vLLM (which needs CUDA).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("trl")

from ledgerspec.contract.document import load
from tests.derivations.engine.test_grpo_truth import CASES, PHASES, TRUTH, Case, ledger_text, truth_case
from tests.support import TESTS, one_worker_each
from tests.support.step_truth import measured_phase, run_three_ways

pytestmark = pytest.mark.slow

VLLM_CASES = [c for c in CASES if c.name in ("lora-2-generations", "rloo-lora-2-generations")]
CASE = VLLM_CASES[0]
#: the 0-dim scalar the real trainer holds beyond the simulated step, per phase (see the module docstring)
SCALARS = {
    "generation_peak": 0,
    "forward_peak": 4,
    "backward_peak": 4,
    "optimizer_step_peak": 4,
    "steady_state_peak": 4,
}


def vllm_ledger(case: Case = CASE) -> str:
    text = ledger_text(case)
    old = "num_generations: 2}"
    assert old in text
    return text.replace(old, "num_generations: 2, use_vllm: true, vllm_mode: server}", 1)


@pytest.fixture(scope="module", params=one_worker_each("vllm-server", VLLM_CASES, [c.name for c in VLLM_CASES]))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    c: Case = request.param
    folder = tmp_path_factory.mktemp(f"vllm-server-{c.name}")
    written = folder / "callback.ledger.yaml"  # LedgerCallback rides on the truth's run (no measurement of its own)
    case = {**truth_case(c, folder), "vllm": "server", "ledger": str(written)}
    out = run_three_ways(folder, c.base.arch, vllm_ledger(c), case, TRUTH, False)
    out["updates"] = json.loads((folder / "truth.json").read_text(encoding="utf-8"))["vllm_updates"]
    return {"case": c, "callback": load(written), **out}


def _parameter_bytes() -> int:
    """The bytes of the tiny model's parameters in its loaded dtype, built by transformers on the meta device (no
    buffers: vLLM receives parameters only)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(TESTS / "data" / "measure" / CASE.base.arch)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, CASE.base.loaded))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_the_real_trainer_synced_the_weights_through_the_stub(runs: dict[str, Any]) -> None:
    """The truth ran TRL's vLLM path: one weight update per optimizer step before its generation (the global step
    moved: grpo_trainer.py:1767-1773), each one packed chunk of every base parameter (the tiny model is far below
    vLLM's 1 GiB chunk; tied weights once)."""
    assert runs["updates"] == [[_parameter_bytes()]] * 3


def test_measure_is_the_real_grpo_trainer_step_with_vllm(runs: dict[str, Any]) -> None:
    got = {p: measured_phase(runs["measured"], p) for p in PHASES}
    want = {p: runs["truth"][p] - SCALARS[p] for p in PHASES}
    assert got == want, f"{runs['case'].name}: measure {got} vs the real trainer with vLLM {want}"


def test_the_cpu_estimate_is_the_measurement_to_the_byte(runs: dict[str, Any]) -> None:
    got = {p: runs["estimated"].get("x-estimate", "phases", p).value for p in PHASES}
    assert got == {p: measured_phase(runs["measured"], p) for p in PHASES}


def test_the_method_says_vllm_server(runs: dict[str, Any]) -> None:
    method = runs["estimated"].get("ledger", "activations").method or ""
    trainer = runs["case"].trainer.upper()
    assert f"{trainer}Trainer step with vLLM (server mode)" in method and "merge_adapter" in method
    assert ("importance-sampling" in method) == (trainer == "GRPO")


def test_the_callback_on_the_vllm_trainer_declares_vllm_and_records_the_run(runs: dict[str, Any]) -> None:
    """``LedgerCallback`` on the same real run: the vLLM settings read from the live config (TRL's defaults for those
    not given: colocate's share 0.3, no sleep mode), and every phase it recorded is the truth's reader's."""
    doc = runs["callback"]
    settings = ("training", "objective_settings")
    got = [doc.get(*settings, k).value for k in ("use_vllm", "vllm_mode", "vllm_gpu_memory_utilization")]
    assert got == [True, "server", 0.3]
    assert doc.get(*settings, "vllm_enable_sleep_mode").value is False
    assert {p: measured_phase(doc, p) for p in PHASES} == {p: runs["truth"][p] for p in PHASES}


def test_the_truth_case_is_the_plain_grpo_case_plus_vllm(tmp_path: Path) -> None:
    """The ledger differs from the transformers-generate case's only in the vLLM settings."""
    plain, vllm = ledger_text(CASE).splitlines(), vllm_ledger().splitlines()
    assert [(a, b) for a, b in zip(plain, vllm, strict=True) if a != b] == [
        (
            "  objective_settings: {max_completion_length: 8, num_generations: 2}",
            "  objective_settings: {max_completion_length: 8, num_generations: 2, use_vllm: true, vllm_mode: server}",
        )
    ]
