"""How the JSON fixtures of this folder were made: by the libraries themselves (transformers 5.24.0, PEFT 0.21.2,
TRL 1.9.0; the DPO, reward, KTO and ORPO folders TRL 1.16.0), so that their keys and values are exactly what those
versions write. Run once by hand (TRL 1.9.0 on PYTHONPATH for the first ones); the tests only read the files.

    PYTHONPATH=/path/to/trl-1.9.0:. .venv/bin/python tests/data/imports/hf/make_fixtures.py
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent.parent.parent.parent / "examples" / "configs"


def main() -> None:
    import torch
    from peft import LoraConfig
    from transformers import AutoConfig, BitsAndBytesConfig, TrainingArguments
    from trl import SFTConfig

    warnings.filterwarnings("ignore")
    # 1. LoRA: a plain Trainer's TrainingArguments (use_cpu: this machine has no GPU; the flag is then set back to
    #    what a GPU run writes), PEFT's adapter_config.json, the model's config.json
    args = TrainingArguments(
        output_dir="out/llama-3.2-3b-lora",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        gradient_checkpointing=True,
        optim="adamw_torch_fused",
        learning_rate=2e-4,
        use_cpu=True,
    )
    data = json.loads(args.to_json_string())
    data.update(use_cpu=False, bf16=True)
    (HERE / "lora" / "training_args.json").write_text(json.dumps(data, indent=2) + "\n")
    LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.05,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
        base_model_name_or_path="meta-llama/Llama-3.2-3B",
    ).save_pretrained(str(HERE / "lora"))
    shutil.copy(CONFIGS / "llama-3.2-3b" / "config.json", HERE / "lora" / "config.json")

    # 2. QLoRA: TRL's SFTConfig, a LoRA adapter_config.json, and a config.json carrying the BitsAndBytesConfig the
    #    model is loaded with (what save_pretrained writes for a 4-bit model)
    sft = SFTConfig(
        output_dir="out/mistral-7b-qlora",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=8,
        max_length=2048,
        packing=False,
        optim="paged_adamw_8bit",
        gradient_checkpointing_kwargs={"use_reentrant": False},
        model_init_kwargs={"dtype": "bfloat16", "attn_implementation": "sdpa"},
        bf16=False,
        use_cpu=True,
    )
    data = json.loads(sft.to_json_string())
    data.update(use_cpu=False, bf16=True)
    (HERE / "qlora" / "sft_config.json").write_text(json.dumps(data, indent=2) + "\n")
    LoraConfig(
        r=64,
        lora_alpha=16,
        lora_dropout=0.1,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
        base_model_name_or_path="mistralai/Mistral-7B-v0.1",
    ).save_pretrained(str(HERE / "qlora"))
    config = AutoConfig.from_pretrained(CONFIGS / "mistral-7b-v0.1")
    config.quantization_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    ).to_dict()
    config._name_or_path = "mistralai/Mistral-7B-v0.1"
    (HERE / "qlora" / "config.json").write_text(config.to_json_string())


def dpo() -> None:
    """3. DPO on a QLoRA base: TRL 1.16's DPOConfig (TRL is a dev dependency since), the QLoRA folder's adapter and
    model config. ``make_fixtures.py dpo`` writes this folder only (the others stay TRL 1.9.0's)."""
    from trl import DPOConfig

    warnings.filterwarnings("ignore")
    folder = HERE / "dpo"
    folder.mkdir(exist_ok=True)
    config = DPOConfig(
        output_dir="out/mistral-7b-qlora-dpo",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=8,
        max_length=1024,
        optim="paged_adamw_8bit",
        gradient_checkpointing_kwargs={"use_reentrant": False},
        model_init_kwargs={"dtype": "bfloat16", "attn_implementation": "sdpa"},
        bf16=False,
        use_cpu=True,
    )
    data = json.loads(config.to_json_string())
    data.update(use_cpu=False, bf16=True)
    (folder / "dpo_config.json").write_text(json.dumps(data, indent=2) + "\n")
    for name in ("adapter_config.json", "config.json"):
        shutil.copy(HERE / "qlora" / name, folder / name)


def reward() -> None:
    """4. A reward model on a QLoRA base: TRL 1.16's RewardConfig, the QLoRA folder's model config and its adapter as a
    ``SEQ_CLS`` LoRA saves it (PEFT adds the classifier heads to ``modules_to_save``: peft_model.py,
    ``PeftModelForSequenceClassification.__init__``). ``make_fixtures.py reward`` writes this folder only."""
    from trl import RewardConfig

    warnings.filterwarnings("ignore")
    folder = HERE / "reward"
    folder.mkdir(exist_ok=True)
    config = RewardConfig(
        output_dir="out/mistral-7b-qlora-reward",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        max_length=1024,
        center_rewards_coefficient=0.01,
        optim="paged_adamw_8bit",
        gradient_checkpointing_kwargs={"use_reentrant": False},
        model_init_kwargs={"dtype": "bfloat16", "attn_implementation": "sdpa"},
        bf16=False,
        use_cpu=True,
    )
    data = json.loads(config.to_json_string())
    data.update(use_cpu=False, bf16=True)
    (folder / "reward_config.json").write_text(json.dumps(data, indent=2) + "\n")
    adapter = json.loads((HERE / "qlora" / "adapter_config.json").read_text())
    adapter.update(task_type="SEQ_CLS", modules_to_save=["classifier", "score"])
    (folder / "adapter_config.json").write_text(json.dumps(adapter, indent=2, sort_keys=True) + "\n")
    shutil.copy(HERE / "qlora" / "config.json", folder / "config.json")


def kto() -> None:
    """5. KTO on a QLoRA base: TRL 1.16's KTOConfig, the QLoRA folder's adapter and model config. ``make_fixtures.py
    kto`` writes this folder only."""
    from trl import KTOConfig

    warnings.filterwarnings("ignore")
    folder = HERE / "kto"
    folder.mkdir(exist_ok=True)
    config = KTOConfig(
        output_dir="out/mistral-7b-qlora-kto",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        max_length=1024,
        optim="paged_adamw_8bit",
        gradient_checkpointing_kwargs={"use_reentrant": False},
        model_init_kwargs={"dtype": "bfloat16", "attn_implementation": "sdpa"},
        bf16=False,
        use_cpu=True,
    )
    data = json.loads(config.to_json_string())
    data.update(use_cpu=False, bf16=True)
    (folder / "kto_config.json").write_text(json.dumps(data, indent=2) + "\n")
    for name in ("adapter_config.json", "config.json"):
        shutil.copy(HERE / "qlora" / name, folder / name)


def orpo() -> None:
    """6. ORPO on a bf16 base: TRL 1.16's ``trl.experimental`` ORPOConfig, the LoRA folder's adapter and model config.
    ``make_fixtures.py orpo`` writes this folder only."""
    from trl.experimental.orpo import ORPOConfig

    warnings.filterwarnings("ignore")
    folder = HERE / "orpo"
    folder.mkdir(exist_ok=True)
    config = ORPOConfig(
        output_dir="out/llama-lora-orpo",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=8,
        max_length=1024,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        model_init_kwargs={"dtype": "bfloat16", "attn_implementation": "sdpa"},
        bf16=False,
        use_cpu=True,
    )
    data = json.loads(config.to_json_string())
    data.update(use_cpu=False, bf16=True)
    (folder / "orpo_config.json").write_text(json.dumps(data, indent=2) + "\n")
    for name in ("adapter_config.json", "config.json"):
        shutil.copy(HERE / "lora" / name, folder / name)


if __name__ == "__main__":
    import sys

    {"dpo": dpo, "reward": reward, "kto": kto, "orpo": orpo}.get(sys.argv[1] if sys.argv[1:] else "", main)()
