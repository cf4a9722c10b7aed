"""Reading foreign files: formats recognised, bad input refused in one line (exit 2), pickles never unpickled."""

from __future__ import annotations

from pathlib import Path

import pytest

from ledgerspec.contract.imports.source import detect, read
from ledgerspec.errors import LedgerspecError
from tests.support import EXAMPLES
from tests.support.imports import IMPORTS


@pytest.mark.parametrize(
    ("path", "fmt"),
    [
        ("axolotl/lora.yml", "axolotl"),
        ("axolotl/deepspeed_configs/zero3_bf16.json", "deepspeed"),
        ("llamafactory/qlora.yaml", "llamafactory"),
        ("hf/lora/training_args.json", "training-args"),
        ("hf/qlora/sft_config.json", "training-args"),
        ("hf/fsdp2/training_args.yaml", "training-args"),
        ("hf/lora/adapter_config.json", "adapter-config"),
        ("hf/qlora/config.json", "model-config"),
    ],
)
def test_formats_are_recognised(path: str, fmt: str) -> None:
    assert read(IMPORTS / path).format == fmt


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("list.yaml", "holds a list, not a mapping"),
        ("not-yaml.yml", "mapping values are not allowed here"),
        ("unknown-format.json", "not a configuration format ledgerspec can import"),
        ("training_args.bin", "a pickle"),
    ],
)
def test_bad_input_is_one_line_exit_2(name: str, message: str) -> None:
    with pytest.raises(LedgerspecError) as exc:
        read(IMPORTS / "bad" / name)
    err = exc.value
    assert err.exit_code == 2 and err.rule == "import" and message in err.message
    assert "\n" not in err.format()


def test_a_pickle_is_never_unpickled(tmp_path: Path) -> None:
    """A raw pickle whose loading would create a file: refused before anything reads it as a pickle."""
    import pickle

    class Marker:
        def __reduce__(self) -> tuple[object, tuple[str, str]]:
            return (open, (str(tmp_path / "unpickled"), "w"))

    (tmp_path / "args.json").write_bytes(pickle.dumps(Marker(), protocol=4))
    with pytest.raises(LedgerspecError, match="a pickle") as exc:
        read(tmp_path / "args.json")
    assert "to_json_string" in (exc.value.hint or "")
    assert not (tmp_path / "unpickled").exists()


def test_ledgerspec_documents_empty_files_and_forced_formats(tmp_path: Path) -> None:
    with pytest.raises(LedgerspecError, match="already a ledgerspec document"):
        read(EXAMPLES / "llama-2-7b-qlora.intake.yaml")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(LedgerspecError, match="empty file"):
        read(tmp_path / "empty.yaml")
    assert read(IMPORTS / "hf/lora/config.json", "model-config").format == "model-config"
    assert detect({"zero_optimization": {"stage": 2}}) == "deepspeed"
    assert detect({"foo": 1}) is None
