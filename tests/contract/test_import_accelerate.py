"""An accelerate config YAML -> intake (issue 16: "read from an accelerate/Trainer FSDP config by the import"), and
FSDP1 from TrainingArguments and axolotl.

The expected values come from accelerate 1.15 itself: its ``launch`` argument parser reads the config file
(``_validate_launch_command``), ``prepare_multi_gpu_env`` turns it into the ``FSDP_*`` variables ``accelerate launch``
gives the training processes, and ``FullyShardedDataParallelPlugin()`` reads them as a Trainer's Accelerator does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.imports import IMPORTS, imported, keys_of, plain

FIXTURES = ["fsdp1-qlora", "fsdp1-bf16", "fsdp2"]


def _plugin(config: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, int]:
    """accelerate's own reading of ``config``: the FSDP plugin a training process builds, and the process count."""
    pytest.importorskip("torch")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config), "train.py"])
    args = _validate_launch_command(args)[0]
    env = prepare_multi_gpu_env(args)
    for key in [k for k in os.environ if k.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # FSDP1 + sync_module_states (forced on by cpu_ram_efficient_loading) asks for a CUDA device to build
    # param_init_fn: nothing this test compares
    sync = "true" in (env.get("FSDP_SYNC_MODULE_STATES"), env.get("FSDP_CPU_RAM_EFFICIENT_LOADING"))  # forced on
    monkeypatch.setenv("FSDP_SYNC_MODULE_STATES", "false")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    plugin = FullyShardedDataParallelPlugin()
    mp = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if mp != "no":
        plugin.set_mixed_precision(mp)  # what AcceleratorState does with an FSDP plugin
    if plugin.fsdp_version == 1:  # what the plugin would say with a device (utils/dataclasses.py 1858-1863)
        plugin.sync_module_states = sync
    return plugin, int(args.num_processes)


@pytest.mark.parametrize("name", FIXTURES)
def test_fsdp_settings_as_accelerate_reads_them(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = IMPORTS / "accelerate" / f"{name}.yaml"
    plugin, processes = _plugin(config, monkeypatch)
    doc, result = imported(f"accelerate/{name}.yaml")
    par = ("parallelism",)

    def value(*path: str) -> Any:
        got = plain(doc, *par, *path)
        return got[1] if isinstance(got, tuple) else got  # (ASSUMPTION, value) for a default

    assert value("gpu_count") == processes and plain(doc, "workload", "dp_world_size") == processes
    assert value("strategy") == f"fsdp{plugin.fsdp_version}"
    assert plain(doc, "memory_options", "sharding") == f"fsdp{plugin.fsdp_version}"
    offload = plugin.cpu_offload
    offloaded = bool(getattr(offload, "offload_params", False)) or type(offload).__name__ == "CPUOffloadPolicy"
    assert value("cpu_offload") is offloaded
    if plugin.fsdp_version == 1:
        from ledgerspec.derivations.shard.options import fsdp1_options

        assert value("reshard_after_forward") is (plugin.sharding_strategy.name == "FULL_SHARD")
        # the intake as the simulation reads it (absent settings at their documented defaults)
        opts = fsdp1_options(doc)
        assert opts.backward_prefetch == (plugin.backward_prefetch.name if plugin.backward_prefetch else None)
        assert opts.use_orig_params is plugin.use_orig_params
        assert opts.forward_prefetch is plugin.forward_prefetch
        assert opts.limit_all_gathers is plugin.limit_all_gathers
        assert opts.sync_module_states is plugin.sync_module_states
        # accelerate applies the checkpoint inside each unit (Accelerator.prepare_model, after the wrapping)
        assert opts.activation_checkpointing is plugin.activation_checkpointing
    else:
        assert value("reshard_after_forward") is plugin.reshard_after_forward
    policy = plugin.mixed_precision_policy
    if policy is None:
        assert value("mixed_precision_policy") == "absent"
    else:
        keys = ("param_dtype", "reduce_dtype") + (("buffer_dtype",) if plugin.fsdp_version == 1 else ())
        for key in keys:
            assert value("mixed_precision_policy", key) == str(getattr(policy, key)).removeprefix("torch.")
    assert keys_of(result, "unknown-key") == []


def test_hybrid_shard_shards_within_a_node() -> None:
    """16 processes on 2 machines, HYBRID_SHARD: shard groups of the 8 processes of one node (FSDP1's default
    intra-node group)."""
    doc, result = imported("accelerate/fsdp-hybrid.yaml")
    assert result.findings == []
    assert plain(doc, "memory_options", "sharding") == "fsdp1"
    assert plain(doc, "parallelism", "gpu_count") == 16
    assert plain(doc, "parallelism", "shard_group_size") == 8
    assert plain(doc, "parallelism", "reshard_after_forward") is True


def test_no_shard_replicates_and_with_cpu_offload_is_a_finding(tmp_path: Path) -> None:
    """NO_SHARD: FSDP1 with every placement replicated (``shard.options.no_shard``), no shard group, no reshard; with
    CPU offload a finding, not a guess."""
    src = tmp_path / "accelerate.yaml"
    text = (IMPORTS / "accelerate" / "fsdp-hybrid.yaml").read_text().replace("HYBRID_SHARD", "NO_SHARD")
    src.write_text(text, encoding="utf-8")
    doc, result = imported(src)
    assert result.findings == []
    assert plain(doc, "parallelism", "strategy") == "fsdp1" and plain(doc, "memory_options", "sharding") == "fsdp1"
    for key in ("parameter_placement", "gradient_placement", "optimizer_placement"):
        assert plain(doc, "parallelism", key) == "replicated", key
    assert not {"shard_group_size", "reshard_after_forward"} & set(doc.plain["parallelism"])
    assert plain(doc, "parallelism", "use_orig_params") is True
    src.write_text(text.replace("fsdp_config:\n", "fsdp_config:\n  fsdp_offload_params: true\n"), encoding="utf-8")
    doc, result = imported(src)
    assert keys_of(result, "not-modelled") == ["fsdp_config"]
    assert plain(doc, "memory_options", "sharding") == "UNKNOWN"


def test_deepspeed_plugin_and_a_typo() -> None:
    doc, result = imported("accelerate/deepspeed-z3.yaml")
    assert plain(doc, "memory_options", "sharding") == "zero3"
    assert plain(doc, "parallelism", "optimizer_placement") == "cpu"
    assert plain(doc, "parallelism", "parameter_placement") == "sharded"
    assert keys_of(result, "unknown-key") == ["mixed_precison"]
    assert any("did you mean 'mixed_precision'" in f.message for f in result.findings)


def test_training_arguments_fsdp1(tmp_path: Path) -> None:
    """transformers 5.24 ``TrainingArguments`` with ``fsdp_config.version 1``: the strategy word of ``fsdp`` and the
    FSDP1 settings (``_fsdp_plugin_args``), accelerate's MixedPrecision for bf16."""
    src = tmp_path / "training_args.json"
    src.write_text(
        '{"output_dir": "out", "per_device_train_batch_size": 2, "bf16": true, "fsdp": "shard_grad_op auto_wrap",'
        ' "fsdp_config": {"version": 1, "backward_prefetch": "backward_post", "forward_prefetch": true}}'
    )
    doc, result = imported(src)
    assert plain(doc, "parallelism", "strategy") == "fsdp1"
    assert plain(doc, "parallelism", "reshard_after_forward") is False
    assert plain(doc, "parallelism", "backward_prefetch") == "backward_post"
    assert plain(doc, "parallelism", "forward_prefetch") is True
    assert plain(doc, "parallelism", "use_orig_params") == ("ASSUMPTION", True)  # fsdp_config default "true"
    # fsdp_config.sync_module_states default "true" (training_args.py 2879-2881)
    assert plain(doc, "parallelism", "sync_module_states") == ("ASSUMPTION", True)
    assert plain(doc, "parallelism", "mixed_precision_policy", "param_dtype") == "bfloat16"
    assert result.findings == [] or keys_of(result, "not-modelled") == []
    # set off, it is off; cpu_ram_efficient_loading forces it on (accelerate utils/dataclasses.py 1858-1863)
    # fsdp_config.activation_checkpointing: accelerate's checkpoint inside each unit (read with the checkpointing)
    assert plain(doc, "parallelism", "activation_checkpointing") == "absent"
    src.write_text(src.read_text().replace('"version": 1,', '"version": 1, "activation_checkpointing": true,'))
    doc, _ = imported(src)
    assert plain(doc, "parallelism", "activation_checkpointing") is True
    assert plain(doc, "memory_options", "gradient_checkpointing") is True
    src.write_text(src.read_text().replace('"activation_checkpointing": true, ', ""))
    for extra, expected in (("false", False), ('false, "cpu_ram_efficient_loading": true', True)):
        src.write_text(src.read_text().replace('"version": 1,', f'"version": 1, "sync_module_states": {extra},'))
        doc, _ = imported(src)
        assert plain(doc, "parallelism", "sync_module_states") is expected, extra
        src.write_text(src.read_text().replace(f'"sync_module_states": {extra}, ', ""))


def test_axolotl_fsdp1_is_read(tmp_path: Path) -> None:
    """axolotl without ``fsdp_version`` runs FSDP1: the strategy from the ``fsdp`` list, the prefixed settings."""
    text = (IMPORTS / "axolotl" / "qlora-fsdp2.yml").read_text(encoding="utf-8")
    head = text.split("fsdp_version: 2")[0]
    src = tmp_path / "fsdp1.yml"
    src.write_text(
        head + "fsdp:\n  - full_shard\n  - auto_wrap\nfsdp_config:\n  fsdp_offload_params: false\n"
        "  fsdp_use_orig_params: false\n  fsdp_backward_prefetch: BACKWARD_PRE\n"
        "  fsdp_transformer_layer_cls_to_wrap: MistralDecoderLayer\n",
        encoding="utf-8",
    )
    doc, result = imported(src)
    assert plain(doc, "parallelism", "strategy") == "fsdp1"
    assert plain(doc, "memory_options", "sharding") == "fsdp1"
    assert plain(doc, "parallelism", "reshard_after_forward") is True
    assert plain(doc, "parallelism", "use_orig_params") is False
    assert plain(doc, "parallelism", "backward_prefetch") == "backward_pre"
    assert plain(doc, "parallelism", "mixed_precision_policy", "param_dtype") == "bfloat16"  # bf16: true
    assert "fsdp_config" not in keys_of(result, "not-modelled")
