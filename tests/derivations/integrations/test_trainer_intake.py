"""``intake_from_trainer``: the intake read from a live ``transformers.Trainer`` resolves to the figures of the
hand-written intake of the same setup.

Each case builds a real Trainer the way a user does (transformers builds the model, bitsandbytes quantizes a QLoRA
base in ``from_pretrained``, PEFT injects the adapters), reads it with :func:`ledgerspec.intake_from_trainer`, and
resolves it; the independent side is an intake written by hand for the same setup (the figures a user would
declare), resolved the same way. The read values are checked too (targets resolved to the real modules, DoRA,
modules_to_save, quantization, dtypes, the optimizer).
"""

from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

import ledgerspec  # noqa: E402
from ledgerspec.contract.document import from_text  # noqa: E402
from ledgerspec.derivations.resolve.resolver import resolve  # noqa: E402
from ledgerspec.errors import LedgerspecError  # noqa: E402
from tests.support import DATA  # noqa: E402
from tests.truths.trainer_run import trainer_for  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trainer-intake")]


@dataclasses.dataclass
class Case:
    id: str
    hand: str  # the hand-written intake's method/base/adapter/optimizer sections
    arch: str = "tiny-llama"
    lora: dict[str, Any] = dataclasses.field(default_factory=dict)
    quant: bool = False
    prepare: bool = False
    optim: str = "adamw_torch"


CASES = [
    Case(
        "lora",
        """method: {kind: LoRA, rank: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, v_proj], bias: none}
base_model: {loaded_dtype: bfloat16, quantized: false}
optimizer: {name: adamw_torch}
""",
        lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    ),
    Case(
        "qlora-nf4",
        """method: {kind: QLoRA, rank: 8, alpha: 16, dropout: 0.0, target_modules: all-linear, bias: none}
base_model:
  loaded_dtype: bfloat16
  quantized: true
  prepare_for_kbit_training: true
  quantization: {type: nf4, bits: 4, double_quant: true, compute_dtype: bfloat16, storage_dtype: uint8}
optimizer: {name: paged_adamw_8bit}
""",
        arch="tiny-qwen2",
        lora={"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
        quant=True,
        prepare=True,
        optim="paged_adamw_8bit",
    ),
    Case(
        "dora",
        """method: {kind: LoRA, rank: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, k_proj, v_proj, o_proj],
  bias: none, use_dora: true}
base_model: {loaded_dtype: bfloat16, quantized: false}
optimizer: {name: adamw_torch}
""",
        lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "use_dora": True},
    ),
    Case(
        "modules-to-save",
        """method: {kind: LoRA, rank: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, v_proj], bias: none,
  modules_to_save: [lm_head]}
base_model: {loaded_dtype: bfloat16, quantized: false}
optimizer: {name: adamw_torch}
""",
        lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]},
    ),
    Case(
        "all-linear-rank-pattern",
        """method: {kind: LoRA, rank: 8, alpha: 16, dropout: 0.0, target_modules: all-linear, bias: none,
  rank_pattern: {o_proj: 2}}
base_model: {loaded_dtype: bfloat16, quantized: false}
optimizer: {name: adamw_torch}
""",
        lora={"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "rank_pattern": {"o_proj": 2}},
    ),
]


def build_trainer(c: Case, folder: Path) -> Any:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if c.quant:
        saved = folder.parent / f"{folder.name}-checkpoint"
        model.save_pretrained(saved)
        shutil.copy(folder / "config.json", saved / "config.json")  # the config the hand intake names
        bnb = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        model = AutoModelForCausalLM.from_pretrained(
            saved, quantization_config=bnb, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    if c.prepare:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **c.lora))
    settings: dict[str, Any] = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "optim": c.optim}
    return trainer_for(model, str(folder.parent), max_grad_norm=1.0, **settings)


def hand_intake(c: Case, config_path: str) -> str:
    return f"""ledgerspec: intake/v1
identity: {{model_id: tests/{c.arch}, revision: main, config_path: {config_path}}}
software: {{attention_implementation: sdpa}}
{c.hand}adapter: {{dtype: float32}}
workload: {{max_length: 64, microbatch: 2, gradient_accumulation: 2}}
training: {{loop: trainer, mixed_precision: "no", max_grad_norm: 1.0}}
memory_options: {{gradient_checkpointing: false}}
"""


def _figures(doc: Any) -> dict[str, Any]:
    return dataclasses.asdict(resolve(doc).figures)


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_the_intake_of_a_live_trainer_resolves_like_the_hand_written_one(c: Case, tmp_path: Path) -> None:
    folder = tmp_path / c.arch
    shutil.copytree(DATA / "measure" / c.arch, folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = build_trainer(c, folder)
        live = ledgerspec.intake_from_trainer(trainer, str(tmp_path / "live.intake.yaml"))
    hand = from_text(hand_intake(c, c.arch), str(tmp_path / "hand.intake.yaml"))
    assert live.kind == "intake"
    assert live.get("method", "kind").value == hand.get("method", "kind").value
    for path in (("method", "rank"), ("method", "alpha"), ("base_model", "quantized"), ("optimizer", "name")):
        assert live.get(*path).value == hand.get(*path).value, path
    assert live.get("adapter", "dtype").value == "float32"
    assert live.get("base_model", "loaded_dtype").value == "bfloat16"
    assert live.get("workload", "microbatch").value == 2 and live.get("workload", "gradient_accumulation").value == 2
    if c.quant:
        q = live.get("base_model", "quantization").value
        assert (q["type"], q["double_quant"], q["compute_dtype"]) == ("nf4", True, "bfloat16")
        assert live.get("base_model", "prepare_for_kbit_training").value is c.prepare
    assert live.get("method", "use_dora").value is bool(c.lora.get("use_dora"))
    if "modules_to_save" in c.lora:
        assert live.get("method", "modules_to_save").value == ["lm_head"]
    if c.lora["target_modules"] == "all-linear":  # resolved to the real modules' names
        targets = live.get("method", "target_modules").value
        assert isinstance(targets, list) and {"q_proj", "o_proj", "down_proj"} <= set(targets)
    if c.quant:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert _figures(live) == _figures(hand)
    else:
        assert _figures(live) == _figures(hand)


def test_a_trainer_without_peft_is_a_full_fine_tune_or_a_clear_error(tmp_path: Path) -> None:
    """No PEFT adapters and trainable parameters: a full fine-tune (issue 26), in the dtype the trained parameters are
    in now (LLaMA-Factory casts them to float32 after loading); nothing trainable: a clear error."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(DATA / "measure" / "tiny-llama")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.float()  # what LLaMA-Factory's init_adapter does for finetuning_type full
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_for(model, str(tmp_path))
    live = ledgerspec.intake_from_trainer(trainer)
    assert live.get("method", "kind").value == "full"
    assert live.get("base_model", "loaded_dtype").value == "float32"
    assert not live.get("method", "rank").present and not live.get("adapter", "dtype").present
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(LedgerspecError, match="no PEFT adapters"):
        ledgerspec.intake_from_trainer(trainer)
    with pytest.raises(LedgerspecError, match="not a transformers Trainer"):
        ledgerspec.intake_from_trainer(object())


def test_a_hub_model_points_at_the_shipped_config(tmp_path: Path) -> None:
    """A model loaded from the Hub (``_name_or_path`` is its repository, not a folder) gets ledgerspec's shipped copy
    of that repository's published config (examples/configs/SOURCES.md), so ``resolve`` runs offline."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(DATA / "measure" / "tiny-qwen2")
    config._name_or_path = "Qwen/Qwen2.5-14B"  # as from_pretrained("Qwen/Qwen2.5-14B") sets it
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules=["q_proj"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_for(model, str(tmp_path))
    doc = ledgerspec.intake_from_trainer(trainer, str(tmp_path / "live.intake.yaml"))
    assert doc.get("identity", "model_id").value == "Qwen/Qwen2.5-14B"
    shipped = (tmp_path / str(doc.get("identity", "config_path").value)).resolve()
    assert shipped == (DATA.parent.parent / "examples" / "configs" / "qwen2.5-14b").resolve()


def test_the_revision_is_the_commit_the_config_was_loaded_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.19+ keeps no commit on a loaded config: the commit is the one snapshot of the repository in the
    Hugging Face cache whose config.json is the live config (the cache is laid out here as huggingface_hub lays it
    out, ``models--ORG--NAME/snapshots/COMMIT/config.json``); two snapshots holding that config tell nothing. Before
    5.19 ``from_pretrained`` kept the snapshot's commit as ``config._commit_hash`` (``extract_commit_hash`` of the
    cached file's path), which wins."""
    from huggingface_hub import constants
    from transformers import AutoConfig

    from ledgerspec.derivations.integrations.trainer_intake import hub_commit

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    snapshots = tmp_path / "models--tests--tiny-llama" / "snapshots"
    loaded, earlier, twin = "1" * 40, "2" * 40, "3" * 40
    config = AutoConfig.from_pretrained(DATA / "measure" / "tiny-llama")
    config.save_pretrained(snapshots / loaded)
    AutoConfig.from_pretrained(DATA / "measure" / "tiny-llama", num_hidden_layers=1).save_pretrained(
        snapshots / earlier
    )
    config._name_or_path = "tests/tiny-llama"  # as from_pretrained("tests/tiny-llama") sets it
    config.use_cache = False  # as the Trainer sets it (args.use_cache)
    found = hub_commit(config)
    assert found is not None and found[0] == loaded
    config.num_hidden_layers = 3  # edited after loading: no snapshot holds it
    assert hub_commit(config) is None
    config.num_hidden_layers = 2
    config.save_pretrained(snapshots / twin)  # the same config at another commit
    assert hub_commit(config) is None
    config._commit_hash = loaded  # transformers < 5.19
    assert hub_commit(config) == (loaded, "trainer.model.config._commit_hash (the Hub commit loaded)")


def _as_tool(fn: Any, module: str, qualname: str) -> Any:
    """``fn`` named as the tool's own function is (liger-kernel, TRL, axolotl are not installed here)."""
    fn.__module__, fn.__qualname__ = module, qualname
    return fn


def test_the_kernels_a_tool_put_on_the_live_model_are_declared(tmp_path: Path) -> None:
    """What Liger's instance patching (``_apply_liger_kernel_to_instance``: ``forward`` rebound to ``lce_forward``,
    each RMSNorm's to ``LigerRMSNorm.forward``) and axolotl's ``apply_lora_kernel_patches`` (``apply_qkv``/``apply_o``
    bound on the attention) leave on the model is read off it, beside what ``use_liger_kernel`` switches on."""
    import types

    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(DATA / "measure" / "tiny-llama")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules=targets))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_for(model, str(tmp_path), use_liger_kernel=True)
    plain = ledgerspec.intake_from_trainer(trainer)
    assert plain.get("software", "kernels", "cross_entropy").value == "liger_fused_linear_cross_entropy"  # the args
    base = model.get_base_model()
    lce = _as_tool(lambda self, *a, **k: None, "liger_kernel.transformers.model.llama", "lce_forward")
    base.forward = types.MethodType(lce, base)
    norm = _as_tool(lambda self, x: x, "liger_kernel.transformers.rms_norm", "LigerRMSNorm.forward")
    for m in base.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(norm, m)
        if hasattr(m, "q_proj"):
            qkv = _as_tool(lambda s, x: x, "axolotl.kernels.lora", "apply_lora_qkv")
            setattr(m, "apply_qkv", types.MethodType(qkv, m))  # noqa: B010 (as axolotl binds it; not a declared attr)
            setattr(m, "apply_o", types.MethodType(_as_tool(lambda s, x: x, "axolotl.kernels.lora", "apply_lora_o"), m))  # noqa: B010
    doc = ledgerspec.intake_from_trainer(trainer)
    kernels = doc.get("software", "kernels").value
    assert kernels["cross_entropy"] == "liger_fused_linear_cross_entropy"
    assert kernels["norm"] == "liger_rms_norm"
    assert kernels["lora_projections"] == ["axolotl_lora_qkv", "axolotl_lora_o"]
    assert "lce_forward" in doc.text and "LigerRMSNorm.forward" in doc.text  # the comments say what was seen
