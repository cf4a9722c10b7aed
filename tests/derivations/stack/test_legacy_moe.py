"""transformers 4's MoE layout, built when a ledger declares it (``ledgerspec.derivations.stack.legacy_moe``).

The truth is a real ``transformers.Trainer`` QLoRA step of a tiny Mixtral and a tiny Qwen2-MoE run with transformers
4.48.1 and PEFT 0.14.0, and of a tiny Qwen3-MoE with transformers 4.57.6 and PEFT 0.17.1 (per-expert ``nn.Linear``
experts quantized by bitsandbytes, the routing loop, PEFT wrapping the experts' ``w1``/``w2``/``w3`` and
``gate_proj``/``up_proj``/``down_proj``), read from the outside by ``tests/truths/trainer_run.py`` and committed with
the routing its router chose (``tests/data/legacy_moe/*-qlora.truth.json``; the script and command that made them are in
the files and in ``benchmarks/legacy_moe_truth.py``: it needs a venv of that stack, these tests do not). DeepSeek-V2,
DeepSeek-V3 and gpt-oss ran the same way with transformers 4.57.6 (``DeepseekV2MoE``/``DeepseekV3MoE`` with per-expert
``DeepseekV*MLP`` modules; gpt-oss's 3-D experts with 4.57.6's loop), and DeepSeek-V3 under PEFT's k-bit preparation
failed (its error is the truth).

Every byte of difference is set apart by a dense twin: a tiny Mistral (Qwen2, Qwen3) with the same attention, widths
and depth and no experts (``tests/data/legacy_moe/tiny-*-dense-twin``), run by the same script on the same stack,
differs from its simulation by exactly the same bytes in every phase as the MoE model does, so none of them is the
MoE layout. With 4.48.1 they are: at the forward peak the real run holds 65,536 B more (by their size, two float32
batch x length x hidden tensors, 2 x 2 x 64 x 64 x 4 B, halved at the steady step's 32 tokens; held by 4.48.1's model
forward at the loss, not traced further here), and the simulation holds 32 B more in every phase (transformers 5.24's
rotary embedding keeps ``original_inv_freq`` as a buffer of its own, ``nn.Buffer(inv_freq.clone())``,
``models/mistral/modeling_mistral.py`` line 278, where 4.48.1 kept a second name for ``inv_freq``, line 288: the frozen
base's +32 B) plus 8 B at backward and 4 B at the optimizer step (the Trainer loop's running loss: a local ``tr_loss``
in 4.48.1, ``self._tr_loss`` in 5.24). Qwen2-MoE in 4.48.1 holds 32 B per layer more (``Family.extra``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from ledgerspec.contract.document import Document, from_text
from tests.support import TESTS

DATA = TESTS / "data" / "legacy_moe"
PHASES = ("forward_peak", "backward_peak", "optimizer_step_peak", "steady_state_peak")
COMPONENTS = ("frozen_base", "adapter", "gradients", "optimizer")


#: where the test ledgers say they live (their config paths are relative to it)
LEDGER_PATH = str(DATA / "test.ledger.yaml")


def _ledger(*args: Any, **kwargs: Any) -> Document:
    """:func:`_ledger_text` (same arguments) as a document."""
    return from_text(_ledger_text(*args, **kwargs), LEDGER_PATH)


def _ledger_text(
    config: str,
    targets: str,
    transformers: str | None,
    trl: bool = False,
    prepare: bool = True,
    attention: str = "sdpa",
) -> str:
    """The truth case as a ledger; ``trl``: the published single-GPU recipe (TRL's casts after PEFT's k-bit
    preparation, gradient checkpointing, packed rows)."""
    software = f'  transformers: "{transformers}"\n' if transformers else ""
    casts = "  module_dtypes: {norm: float32, lm_head: bfloat16, embed_tokens: bfloat16}\n" if trl else ""
    text = f"""ledgerspec: ledger/v1
title: tiny MoE QLoRA as transformers {transformers or "installed"} runs it
identity:
  model_id: tests/tiny
  config_path: {config}
software:
  attention_implementation: {attention}
{software}method:
  kind: QLoRA
  rank: 4
  alpha: 8
  dropout: 0.0
  target_modules: [{targets}]
  bias: none
base_model:
  loaded_dtype: bfloat16
  quantized: true
  prepare_for_kbit_training: {str(prepare).lower()}
{casts}  quantization: {{type: nf4, bits: 4, double_quant: true, compute_dtype: bfloat16, storage_dtype: uint8}}
adapter:
  dtype: float32
workload:
  max_length: 64
  sequence_p50: 32
  packing: {str(trl).lower()}
  microbatch: 2
  gradient_accumulation: 1
training:
  loop: trainer
  mixed_precision: bf16
  max_grad_norm: 1.0
optimizer:
  name: adamw_torch
memory_options:
  gradient_checkpointing: {str(trl).lower()}
  checkpointing_kind: non-reentrant
"""
    return text


@dataclass(frozen=True)
class Family:
    """A tiny MoE model, its dense twin (the same attention, widths and depth without experts) and their truths."""

    name: str
    config: str
    targets: str
    twin_config: str
    twin_targets: str
    #: bytes the 4.x model holds besides its twin's, outside the MoE layout, in every phase and in the frozen base
    extra: int = 0
    #: the transformers (and PEFT) of the truth runs, declared by the ledgers
    version: str = "4.48.1"
    peft: str = "0.14.0"
    #: the twin's simulation minus its truth (less the batch held ahead), phase by phase: see the module docstring
    twin_residual: tuple[int, int, int, int] = (-65496, 40, 36, -32732)
    #: the published single-GPU recipe (:func:`_ledger`'s ``trl``); its truths are ``NAME-trl-qlora``
    trl: bool = False
    #: PEFT's ``prepare_model_for_kbit_training`` (DeepSeek-V3's 4.57.6 step cannot run with it: see below)
    prepare: bool = True
    #: at least this many bytes more frozen base in the installed fused layout than in the real v4 run
    layout_gap: int = 100_000
    #: also simulate with the even split (what users get); off where the loop's form is tested elsewhere (time)
    even: bool = True
    #: the MoE model's attention implementation (its twin's truth ran with sdpa)
    attention: str = "sdpa"

    @property
    def truth(self) -> str:
        return f"{self.name}-trl-qlora" if self.trl else f"{self.name}-qlora"

    @property
    def twin_truth(self) -> str:
        return f"{self.twin_config.split('/')[0]}{'-trl' if self.trl else ''}-qlora"

    @property
    def ahead(self) -> int:
        """The batch the real run's CPU DataLoader holds ahead (int64 ids, labels and, unpacked, the mask; 2 rows of
        the next step's length, packed rows are all 64 long), not in the modelled step."""
        return (2 * 8 * 2 * 64) if self.trl else (3 * 8 * 2 * 32)


FAMILIES = [
    Family(
        "tiny-mixtral",
        "../estimate/tiny-mixtral/config.json",
        "q_proj, v_proj, w1, w2, w3",
        "tiny-mistral-dense-twin/config.json",
        "q_proj, v_proj, gate_proj, up_proj, down_proj",
    ),
    # 4.48.1's Qwen2MoeAttention builds a rotary embedding of its own in every layer (modeling_qwen2_moe.py line 331,
    # `self.rotary_emb = Qwen2MoeRotaryEmbedding(config=self.config)`, unused by its forward): one more inv_freq
    # buffer per layer, head_dim / 2 float32 = 32 B, 2 layers; transformers 5 and the dense Qwen2 have none
    Family(
        "tiny-qwen2-moe",
        "tiny-qwen2-moe/config.json",
        "q_proj, v_proj, gate_proj, up_proj, down_proj",
        "tiny-qwen2-dense-twin/config.json",
        "q_proj, v_proj, gate_proj, up_proj, down_proj",
        extra=2 * 32,
    ),
    # transformers 4.57.6 (Qwen3-MoE exists from 4.51), PEFT 0.17.1, accelerate 1.10.1: its mask leaves 65,504 B at
    # the forward peak and none at the steady step's, and its loop's `expert_hit` index tensors are not at a peak
    Family(
        "tiny-qwen3-moe",
        "tiny-qwen3-moe/config.json",
        "q_proj, v_proj, gate_proj, up_proj, down_proj",
        "tiny-qwen3-dense-twin/config.json",
        "q_proj, v_proj, gate_proj, up_proj, down_proj",
        version="4.57.6",
        peft="0.17.1",
        twin_residual=(-65504, 32, 28, 28),
    ),
    # the single-GPU recipe of the published Mixtral runs (benchmarks/published-moe/): PEFT's k-bit preparation, TRL's
    # casts, bf16 autocast, checkpointing, packed rows: only the rotary buffer and the running loss differ there
    Family(
        "tiny-mixtral",
        "../estimate/tiny-mixtral/config.json",
        "q_proj, v_proj, w1, w2, w3",
        "tiny-mistral-dense-twin/config.json",
        "q_proj, v_proj, gate_proj, up_proj, down_proj",
        twin_residual=(40, 40, 36, 36),
        trl=True,
    ),
    # DeepSeek-V2 and -V3 (transformers 4.57.6's DeepseekV2MoE/DeepseekV3MoE, stack/legacy_moe/deepseek.py): each
    # twin is the same config with every layer dense (first_k_dense_replace = num_hidden_layers). At the forward peak
    # 4.57.6 holds more: its mask (65,504 B, as Qwen3-MoE's) and its MLA attention's tensors at that peak (32,768 B
    # for V3, 131,072 B for V2; 4.57.6's attention differs from 5.24's, e.g. 5.24's `expand_kv`): the twin's figures,
    # measured, not the MoE layout. The MoE model differs from its simulation by exactly the twin's residual.
    Family(
        "tiny-deepseek-v2",
        "tiny-deepseek-v2/config.json",
        "q_proj, o_proj, gate_proj, up_proj, down_proj",
        "tiny-deepseek-v2-dense-twin/config.json",
        "q_proj, o_proj, gate_proj, up_proj, down_proj",
        version="4.57.6",
        peft="0.17.1",
        twin_residual=(-196576, 32, 28, 28),
        layout_gap=40_000,  # the fused bf16 experts less their 4-bit size: about 48 kB on these tiny models
    ),
    # without PEFT's k-bit preparation: with it, 4.57.6's DeepSeek-V3 step fails (test below)
    Family(
        "tiny-deepseek-v3",
        "tiny-deepseek-v3/config.json",
        "q_b_proj, o_proj, gate_proj, up_proj, down_proj",
        "tiny-deepseek-v3-dense-twin/config.json",
        "q_b_proj, o_proj, gate_proj, up_proj, down_proj",
        version="4.57.6",
        peft="0.17.1",
        twin_residual=(-98272, 32, 28, 28),
        prepare=False,
        layout_gap=40_000,
        even=False,  # its loop is Mixtral's and Qwen's form (torch.where, index_add_), whose split is tested there
    ),
    # gpt-oss (4.55-4.57.6; eager attention: 4.57.6 has no sdpa for it): the same 3-D expert parameters as 5.x, 4.57.6's
    # dense router scores and Python loop over the experts (stack/legacy_moe/gpt_oss.py). No dense gpt-oss exists: the
    # twin is Qwen3-MoE's (the same 4.57.6 stack, batch and lengths), whose residual (the mask, the rotary buffer, the
    # running loss) is the gpt-oss run's to the byte
    Family(
        "tiny-gpt-oss",
        "tiny-gpt-oss/config.json",
        "q_proj, v_proj",
        "tiny-qwen3-dense-twin/config.json",
        "q_proj, v_proj, gate_proj, up_proj, down_proj",
        version="4.57.6",
        peft="0.17.1",
        twin_residual=(-65504, 32, 28, 28),
        attention="eager",
    ),
]


def _truth(name: str, f: Family) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((DATA / f"{name}.truth.json").read_text(encoding="utf-8"))
    assert out["stack"]["transformers"] == f.version and out["stack"]["peft"] == f.peft
    return out


def _routing(truth: dict[str, Any], layers: int = 2) -> list[tuple[int, int, list[int]]]:
    """The real run's routing: its MoE calls in order, layer by layer."""
    return [(i % layers, int(r["tokens"]), list(r["counts"])) for i, r in enumerate(truth["routing"])]


@pytest.fixture(scope="module", params=[pytest.param(f, id=f.truth) for f in FAMILIES])
def runs(request: pytest.FixtureRequest) -> dict[str, Any]:
    from ledgerspec.derivations.estimate.estimator import estimate
    from ledgerspec.derivations.stack.legacy_moe import routing

    f: Family = request.param
    truth, twin = _truth(f.truth, f), _truth(f.twin_truth, f)
    with routing.given(_routing(truth)):
        moe = estimate(
            _ledger(f.config, f.targets, f.version, f.trl, f.prepare, f.attention), target="cpu", layers="full"
        )
    even = (
        estimate(_ledger(f.config, f.targets, f.version, f.trl, f.prepare, f.attention), target="cpu", layers="full")
        if f.even
        else None
    )
    text = _ledger_text(f.twin_config, f.twin_targets, f.version, f.trl, f.prepare)
    if text not in _TWINS:  # Qwen3-MoE and gpt-oss share one twin ledger (the same 4.57.6 stack): traced once
        _TWINS[text] = estimate(from_text(text, LEDGER_PATH), target="cpu", layers="full")
    return {"family": f, "moe": moe, "even": even, "dense": _TWINS[text], "truth": truth, "twin": twin}


#: the dense twins' estimates by ledger text (the module's tests share one worker: its xdist_group below)
_TWINS: dict[str, Any] = {}


pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("legacy-moe")]


def test_the_dense_twin_differs_from_its_truth_only_outside_the_moe(runs: dict[str, Any]) -> None:
    """The residual the twin shows (no MoE in it): the 4.48.1 mask, rotary buffer and running loss."""
    dense, twin = runs["dense"], runs["twin"]
    got = tuple(dense.phases[p] - (twin["phases"][p] - runs["family"].ahead) for p in PHASES)
    assert got == runs["family"].twin_residual


def test_the_declared_v4_moe_step_is_the_real_v4_step_to_the_byte(runs: dict[str, Any]) -> None:
    f, moe, dense, truth, twin = runs["family"], runs["moe"], runs["dense"], runs["truth"], runs["twin"]
    for p in PHASES:
        residual = dense.phases[p] - (twin["phases"][p] - f.ahead)
        assert moe.phases[p] == truth["phases"][p] - f.ahead + residual - f.extra, p
    for c in COMPONENTS:
        residual = dense.components[c] - twin["components"][c]
        assert moe.components[c] == truth["components"][c] + residual - (f.extra if c == "frozen_base" else 0), c
    # the rotary buffer only (transformers 5's original_inv_freq, 4.48.1's per-layer rotary of Qwen2-MoE)
    assert moe.components["frozen_base"] - truth["components"]["frozen_base"] == 32 - f.extra


def test_the_even_split_gives_the_same_step_here(runs: dict[str, Any]) -> None:
    """Without the real routing (what users get): the saved tensors do not depend on the split, and the peaks of
    this step lie outside the expert loop."""
    if runs["even"] is None:
        pytest.skip("not simulated with the even split (Family.even)")
    assert {p: runs["even"].phases[p] for p in PHASES} == {p: runs["moe"].phases[p] for p in PHASES}


def test_the_layout_is_recorded_as_modelled(runs: dict[str, Any]) -> None:
    moe = runs["moe"]
    assert moe.differences["transformers-moe-fused-experts"] == {"computed_as": "older"}
    assert f"of the declared transformers {runs['family'].version}: " in moe.method
    assert not any("not modelled" in n for n in moe.notes)


@pytest.mark.parametrize("f", [pytest.param(f, id=f.truth) for f in FAMILIES if not f.trl and "gpt-oss" not in f.name])
def test_the_installed_layout_is_far_from_the_v4_run(f: Family) -> None:
    """The same ledger without software.transformers (the installed 5.x fused experts, bf16): what users got before.
    A difference the test above would catch: over 100 kB (DeepSeek: 40 kB) of unquantized experts on these tiny
    models."""
    from ledgerspec.derivations.estimate.estimator import estimate

    installed = estimate(_ledger(f.config, f.targets, None, prepare=f.prepare), target="cpu", layers="full")
    assert installed.components["frozen_base"] - _truth(f.truth, f)["components"]["frozen_base"] > f.layout_gap
    assert installed.differences["transformers-moe-fused-experts"]["computed_as"] == "newer"


def test_resolve_builds_the_v4_modules_and_peft_wraps_them_as_0_14_did() -> None:
    from ledgerspec.derivations.resolve.resolver import resolve

    f = FAMILIES[0]
    result = resolve(_ledger(f.config, f.targets, "4.48.1"), offline=True)
    names = [r.name for r in result.census.tensors if "lora_A" in r.name]
    assert any(".block_sparse_moe.experts.0.w1.lora_A" in n for n in names), names[:8]
    assert not any("experts.gate_up_proj" in n for n in names)
    truth = _truth("tiny-mixtral-qlora", f)["components"]
    # the census counts what the Trainer truth counts (frozen params, buffers, quant state): + the 32 B rotary buffer
    assert result.figures.frozen_base_bytes == truth["frozen_base"] + 32
    assert result.figures.adapter_bytes == truth["adapter"]
    diff = result.doc.get("x-resolve", "differences").raw["transformers-moe-fused-experts"]
    assert diff == {"computed_as": "older"}


@pytest.mark.parametrize("f", [pytest.param(f, id=f.truth) for f in FAMILIES if f.name.startswith("tiny-deepseek")])
def test_resolve_builds_deepseeks_v4_experts_and_peft_wraps_every_mlp(f: Family) -> None:
    """4.57.6's DeepseekV2MoE/DeepseekV3MoE: per-expert ``gate_proj``/``up_proj``/``down_proj`` wrapped as
    ``nn.Linear`` layers (PEFT 0.21's conversion of these names for deepseek_v2/v3, ``_MODEL_TO_CONVERSION_PATTERN``
    -> ``qwen2_moe``, is off), to the real run's adapter bytes and frozen base (+ the 32 B rotary buffer)."""
    from ledgerspec.derivations.resolve.resolver import resolve

    result = resolve(_ledger(f.config, f.targets, f.version, prepare=f.prepare), offline=True)
    names = [r.name for r in result.census.tensors if "lora_A" in r.name]
    assert any(".mlp.experts.3.down_proj.lora_A" in n for n in names), names[:8]
    assert any(".mlp.shared_experts.gate_proj.lora_A" in n for n in names), names[:8]
    assert not any("experts.gate_up_proj" in r.name for r in result.census.tensors)
    truth = _truth(f.truth, f)["components"]
    assert result.figures.frozen_base_bytes == truth["frozen_base"] + 32
    assert result.figures.adapter_bytes == truth["adapter"]


def test_deepseek_v3s_4_57_step_with_kbit_preparation_fails_as_the_real_one_does() -> None:
    """transformers 4.57.6's ``DeepseekV3MoE.moe`` accumulates into ``torch.zeros_like(hidden_states,
    dtype=topk_weights.dtype)`` (bfloat16: autocast runs the router's ``F.linear`` in bf16) and adds the experts'
    outputs without a cast; PEFT's k-bit preparation makes the norms float32, so the 4-bit experts return float32
    and ``index_add_`` refuses them. The real run (committed: tiny-deepseek-v3-kbit-qlora.truth.json) failed so; the
    estimate says the declared step cannot run, at one line (the meta kernel of ``index_add_`` checks no dtypes: the
    tracker does, as for matrix products)."""
    from ledgerspec.derivations.estimate.estimator import estimate
    from ledgerspec.errors import LedgerspecError

    f = next(f for f in FAMILIES if f.name == "tiny-deepseek-v3")
    truth = json.loads((DATA / "tiny-deepseek-v3-kbit-qlora.truth.json").read_text(encoding="utf-8"))
    assert truth["stack"]["transformers"] == "4.57.6"
    assert truth["error"] == (
        "RuntimeError: index_add_(): self (BFloat16) and source (Float) must have the same scalar type"
    )
    with pytest.raises(LedgerspecError) as err:
        estimate(_ledger(f.config, f.targets, f.version, prepare=True), target="cpu", layers="full")
    text = str(err.value)
    assert "the declared step cannot run" in text and "index_add_" in text and "bfloat16 and float32" in text
    assert "\n" not in text


def test_gpt_oss_keeps_its_parameters_and_the_installed_forward_holds_less_than_4_57s() -> None:
    """gpt-oss's experts were 3-D parameters in 4.57.6 too: the installed stack (5.x: grouped_mm experts, top-k
    router weights) gives the real 4.57.6 run's frozen base, adapters and optimizer state (+ the 32 B rotary buffer),
    but its step holds less than 4.57.6's loop with dense router scores (measured here: 225,216 B at the backward peak
    on this tiny model, of 3,879,988): what declaring transformers 4.57.6 now models (the fixture's tests)."""
    from ledgerspec.derivations.estimate.estimator import estimate

    f = next(f for f in FAMILIES if "gpt-oss" in f.name)
    truth = _truth(f.truth, f)
    installed = estimate(_ledger(f.config, f.targets, None, attention="eager"), target="cpu", layers="full")
    assert {c: installed.components[c] - truth["components"][c] for c in COMPONENTS} == {
        "frozen_base": 32,
        "adapter": 0,
        "gradients": 0,
        "optimizer": 0,
    }
    got = tuple(installed.phases[p] - (truth["phases"][p] - f.ahead) for p in PHASES)
    assert got == (-290752, -225216, 28, -161732)
    # no layout difference (no bytes), but the side computed is recorded: declaring transformers 4 later changes
    # the step (its loop over the experts), and the ledger's stack check says so against this estimate
    assert installed.differences["transformers-moe-fused-experts"] == {"computed_as": "newer"}


@pytest.mark.slow  # one trace of the tiny Mixtral
def test_a_lora_moe_estimate_records_the_layout_it_ran_so_a_later_declaration_shows() -> None:
    """A bf16 LoRA Mixtral (no 4-bit base: no bytes change with the layout) estimated on the installed 5.x layout
    records that side; declaring transformers 4.48.1 afterwards (the step then runs 4.x's per-expert loop) is a
    stack difference against the recorded figures, not silence."""
    from ledgerspec.contract.differences import stack_differences
    from ledgerspec.derivations.estimate.estimator import estimate

    f = FAMILIES[0]
    assert "mixtral" in f.config.lower()
    text = (
        _ledger_text(f.config, f.targets, None)
        .replace("kind: QLoRA", "kind: LoRA")
        .replace("  quantized: true\n", "  quantized: false\n")
        .replace("  prepare_for_kbit_training: true\n", "")
    )
    text = "\n".join(line for line in text.splitlines() if "quantization:" not in line) + "\n"
    result = estimate(from_text(text, LEDGER_PATH), target="cpu")
    assert result.differences["transformers-moe-fused-experts"] == {"computed_as": "newer"}
    stamped = from_text(
        text.replace("software:\n", 'software:\n  transformers: "4.48.1"\n', 1)
        + "x-estimate:\n  differences: {transformers-moe-fused-experts: {computed_as: newer}}\n",
        LEDGER_PATH,
    )
    assert [d.difference.id for d in stack_differences(stamped, ())] == ["transformers-moe-fused-experts"]
