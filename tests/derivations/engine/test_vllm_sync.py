"""The weight sync of GRPO/RLOO with vLLM, allocation by allocation: TRL 1.16's own ``VLLMGeneration.sync_weights``
(generation/vllm_generation.py:481-513) on a real PEFT model against the step's ``GRPOLoop._sync_weights`` on real and
on fake tensors, all under ledgerspec's tensor tracker.

The truth side is TRL's code with only vLLM replaced: server mode with ``tests/truths/grpo_run.py``'s stub client
(the packed chunks of vLLM's trainer side, vllm-project/vllm@00a9ccfb ``packed_nccl_broadcast_producer``); colocate
mode with an engine whose ``load_weights`` receives each parameter (vLLM copies it into its own weights, which live in
its share of the card, not in the training step's tensors). Two syncs each (server: the first walks the parameters
twice, their metadata then the transfer; every other sync once). In the GRPO truths the sync is below the generation
phase's peak; here its every allocation and free is compared, so PEFT's merge temporaries (the LoRA delta ``B @ A``
and its scaled copy, in fp32 for fp32 adapters; the cast back on unmerge) and the packed chunk are pinned to the
byte.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("trl")

from tests.support import TESTS

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm-sync")]


def _model() -> Any:
    """The tiny Llama of the GRPO truths in bfloat16 with LoRA on q_proj and v_proj (fp32 adapters, PEFT's
    default)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TESTS / "data" / "measure" / "tiny-llama")
    base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def _fake(model: Any) -> tuple[Any, Any]:
    """The same model with every parameter a fake tensor (the estimate's view), and its fake mode."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(mode.from_tensor(p), requires_grad=p.requires_grad)
    return model, mode


def _events(sync: Any, model: Any) -> tuple[list[tuple[Any, ...]], int, int]:
    """Two syncs under the tracker (the model's parameters known beforehand): the allocation and free events in
    order, the peak and the bytes left."""
    from ledgerspec.derivations.engine.tracker import MemoryTracker

    with MemoryTracker(events=True) as tracker:
        tracker.track_existing(list(model.parameters()), "frozen_base")
        start = tracker.current
        sync()
        sync()
    assert tracker.events is not None
    events = [(e[0], e[2]) if e[0] == "alloc" else (e[0],) for e in tracker.events]
    return events, tracker.peak - start, tracker.current - start


def _trl(mode: str) -> tuple[list[tuple[Any, ...]], int, int]:
    from accelerate import Accelerator
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    from tests.truths.grpo_run import _StubServer

    model = _model()
    accelerator = Accelerator(cpu=True)
    generation = object.__new__(VLLMGeneration)  # its __init__ starts vLLM; the sync reads only these
    generation.model, generation.accelerator, generation.mode = model, accelerator, mode
    generation.enable_sleep_mode = False
    generation._dist, generation._weight_metadata = DistributedBackend(accelerator), None
    if mode == "server":
        generation.vllm_client = _StubServer()
    else:
        runner = types.SimpleNamespace(model=types.SimpleNamespace(load_weights=lambda weights: None))
        executor = types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner))
        generation.llm = types.SimpleNamespace(
            llm_engine=types.SimpleNamespace(model_executor=executor), reset_prefix_cache=lambda: None
        )
    return _events(generation.sync_weights, model)


def _step(mode: str, fake: bool) -> tuple[list[tuple[Any, ...]], int, int]:
    import contextlib

    from ledgerspec.derivations.engine.grpo import GRPOLoop
    from ledgerspec.derivations.engine.workload import Workload

    model, fake_mode = _fake(_model()) if fake else (_model(), None)
    loop = object.__new__(GRPOLoop)  # the sync reads the model, the mode and one device's sync hooks only
    loop.w = types.SimpleNamespace(model=model, spec=types.SimpleNamespace(generation=types.SimpleNamespace(vllm=mode)))
    loop.w.syncing, loop.w.synced = (lambda: Workload.syncing(loop.w)), (lambda p: Workload.synced(loop.w, p))
    loop.weight_metadata = False
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        return _events(loop._sync_weights, model)


@pytest.mark.parametrize("mode", ["server", "colocate"])
def test_the_sync_is_trls_allocation_by_allocation(mode: str) -> None:
    truth = _trl(mode)
    assert _step(mode, fake=False) == truth, "the step's sync on real tensors vs TRL's"
    assert _step(mode, fake=True) == truth, "the step's sync on fake tensors (the estimate) vs TRL's"
    events, peak, left = truth
    assert left == 0  # nothing of the sync stays
    parameters = 213_632  # the tiny model's parameters in bfloat16 (test_grpo_vllm_truth._parameter_bytes)
    merges = 2 * 2 * 2 * 2  # two layers x q_proj, v_proj x merge and unmerge, each walk; the first sync walks twice
    assert sum(1 for e in events if e == ("alloc", 64 * 64 * 4)) >= merges  # the fp32 delta of a 64 x 64 projection
    # server: the packed chunk of every parameter is the peak; colocate: only merge temporaries
    assert (peak == parameters) if mode == "server" else (0 < peak < parameters)
