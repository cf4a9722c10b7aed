"""Reading a foreign configuration file: the safe loader, pickles refused, the format recognised, keys taken.

A source is read with the same safe round-trip loader as a ledger (:func:`ledgerspec.contract.loader.parse`: no
tags, anchors or code; JSON is read as the YAML 1.2 subset it is), so a finding can point at the key's line. Bad
input is one :class:`~ledgerspec.errors.LedgerspecError`, exit 2: not UTF-8, not YAML/JSON, not a mapping, a pickle
(``training_args.bin`` is a ``torch.save`` zip archive holding a pickle: never unpickled), or a format none of the
importers knows.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ledgerspec.contract.loader import decode, parse, to_plain
from ledgerspec.errors import EXIT_USAGE, LedgerspecError

#: the formats, with the words ``--format`` takes
FORMATS = {
    "axolotl": "axolotl YAML",
    "llamafactory": "LLaMA-Factory YAML",
    "training-args": "transformers TrainingArguments / TRL SFTConfig (JSON or YAML)",
    "adapter-config": "PEFT adapter_config.json",
    "model-config": "model config.json (with a quantization_config for a quantized base)",
    "deepspeed": "DeepSpeed config JSON",
    "accelerate": "accelerate config YAML (`accelerate config`, `accelerate launch --config_file`)",
}
#: a pickle's first byte is PROTO (0x80) followed by the protocol number (2 to 5)
_PICKLE_MAGIC = tuple(bytes([0x80, n]) for n in range(2, 6))
_DUMP_HINT = (
    "it is never unpickled (a pickle can run code); dump the arguments as JSON where they are built: "
    "`open('training_args.json', 'w').write(trainer.args.to_json_string())` (or `args.to_json_string()` for the "
    "TrainingArguments / SFTConfig you pass in), then import that file"
)
#: larger than any configuration file (the loader's own limit is 1 MiB)
MAX_BYTES = 1 << 20


@dataclass
class Source:
    """One configuration file, its format, and which of its top-level keys an importer has read."""

    path: str
    format: str
    data: Any  # the round-trip tree (positions)
    plain: dict[str, Any]
    taken: set[str] = field(default_factory=set)

    def has(self, key: str) -> bool:
        return key in self.plain and self.plain[key] is not None

    def take(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` (``default`` when absent or null), marked as read."""
        self.taken.add(key)
        value = self.plain.get(key)
        return default if value is None else value

    def integer(self, key: str) -> int:
        """The whole number at ``key`` (marked as read); anything else is one line, exit 2, at the key."""
        return as_int(self, key, self.take(key))

    def number(self, key: str) -> float:
        value = self.take(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.bad(key, value, "a number")
        return float(value)

    def bad(self, key: str, value: Any, expected: str) -> LedgerspecError:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        return LedgerspecError(
            f"{key}: {shown} is not {expected}",
            self.path,
            *self.position(key.split(".")[0]),
            rule="import",
            hint="fix the value in the tool's configuration",
        )

    def peek(self, key: str, default: Any = None) -> Any:
        value = self.plain.get(key)
        return default if value is None else value

    def position(self, key: str | None = None) -> tuple[int | None, int | None]:
        """1-based line and column of a top-level key (of the file when None or absent)."""
        if key is None:
            return 1, 1
        try:
            line, col = self.data.lc.key(key)
            return line + 1, col + 1
        except (AttributeError, KeyError, TypeError):
            return None, None

    def left(self) -> list[str]:
        """The top-level keys no importer read, in file order."""
        return [k for k in self.plain if k not in self.taken]


def read(path: str | Path, fmt: str | None = None) -> Source:
    """Read and recognise one configuration file (``fmt`` forces a format from :data:`FORMATS`)."""
    shown = str(path)
    p = Path(path)
    try:
        if not p.is_file():
            raise LedgerspecError(
                "no such file" if not p.exists() else "not a regular file", shown, rule="import", hint="check the path"
            )
        size = p.stat().st_size
        if size > MAX_BYTES:
            raise LedgerspecError(
                f"file is {size} bytes, over the {MAX_BYTES}-byte limit for a configuration file",
                shown,
                1,
                1,
                rule="import",
                hint="is this a configuration file?",
            )
        raw = p.read_bytes()
    except OSError as exc:
        raise LedgerspecError(f"cannot read: {exc.strerror}", shown, rule="import") from None
    if raw.startswith(_PICKLE_MAGIC) or (raw.startswith(b"PK\x03\x04") and _zip_holds_pickle(p)):
        raise LedgerspecError(
            "a pickle (the `training_args.bin` a Trainer saves with torch.save)",
            shown,
            1,
            1,
            rule="import",
            hint=_DUMP_HINT,
        )
    if raw.startswith(b"PK\x03\x04"):
        raise LedgerspecError("a zip archive, not a configuration file", shown, 1, 1, rule="import")
    try:
        text = decode(raw, shown)
        data = parse(text, shown)
    except LedgerspecError as exc:
        exc.rule, exc.exit_code = "import", EXIT_USAGE
        if exc.hint is None:
            exc.hint = "expected a YAML or JSON configuration file"
        raise
    if data is None:
        raise LedgerspecError("empty file", shown, 1, 1, rule="import", hint="expected a YAML or JSON mapping")
    if not isinstance(data, dict):
        what = "a list" if isinstance(data, list) else f"a single {type(data).__name__} value"
        raise LedgerspecError(
            f"the file holds {what}, not a mapping of settings",
            shown,
            1,
            1,
            rule="import",
            hint="expected a YAML or JSON mapping (key: value)",
        )
    plain = to_plain(data, shown)
    if isinstance(plain.get("ledgerspec"), str):
        raise LedgerspecError(
            "already a ledgerspec document",
            shown,
            *_pos(data, "ledgerspec"),
            rule="import",
            hint="`ledgerspec init --from` takes an intake as it is; import reads tool configurations",
        )
    found = fmt or detect(plain)
    if found is None:
        raise LedgerspecError(
            "not a configuration format ledgerspec can import",
            shown,
            1,
            1,
            rule="import",
            hint="known: " + "; ".join(FORMATS.values()) + " (or name one with --format)",
        )
    if found not in FORMATS:
        raise LedgerspecError(
            f"unknown format {found!r}", shown, rule="import", hint="one of " + ", ".join(FORMATS)
        )  # pragma: no cover - argparse restricts --format
    return Source(shown, found, data, plain)


def as_int(src: Source, key: str, value: Any) -> int:
    """``value`` (read at ``key``) as a whole number: an int, or a string of digits; else one line, exit 2."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    raise src.bad(key, value, "a whole number")


def detect(plain: dict[str, Any]) -> str | None:
    """The format of a configuration, from keys only its format has (None: not recognised)."""
    keys = set(plain)
    if "peft_type" in keys or {"r", "lora_alpha", "target_modules"} <= keys:
        return "adapter-config"
    if "distributed_type" in keys and keys & {"compute_environment", "num_processes", "fsdp_config", "mixed_precision"}:
        return "accelerate"
    if "zero_optimization" in keys or {"train_micro_batch_size_per_gpu", "bf16"} <= keys:
        return "deepspeed"
    if "model_name_or_path" in keys and keys & _LLAMAFACTORY_MARKS:
        return "llamafactory"
    if "base_model" in keys or len(keys & _AXOLOTL_MARKS) >= 2:
        return "axolotl"
    if keys & _TRAINING_ARGS_MARKS:
        return "training-args"
    if ("architectures" in keys or "model_type" in keys) and not keys & {"output_dir", "learning_rate"}:
        return "model-config"
    return None


_LLAMAFACTORY_MARKS = frozenset(
    {"finetuning_type", "stage", "lora_rank", "lora_target", "cutoff_len", "template", "quantization_bit", "dataset"}
)
_AXOLOTL_MARKS = frozenset(
    {"adapter", "lora_r", "micro_batch_size", "sequence_len", "lora_target_linear", "sample_packing", "datasets"}
)
_TRAINING_ARGS_MARKS = frozenset(
    {"per_device_train_batch_size", "gradient_accumulation_steps", "optim", "output_dir", "max_grad_norm"}
)


def _zip_holds_pickle(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith((".pkl", "/data.pkl")) for n in z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _pos(data: Any, key: str) -> tuple[int, int]:
    try:
        line, col = data.lc.key(key)
        return line + 1, col + 1
    except (AttributeError, KeyError, TypeError):
        return 1, 1


def position_in(node: Any, *path: str | int) -> tuple[int | None, int | None]:
    """1-based position of a nested key (the deepest one found)."""
    line: int | None = None
    col: int | None = None
    for part in path:
        try:
            lc: Any = node.lc
            ln, cl = lc.key(part) if isinstance(node, dict) else lc.item(part)
            line, col = ln + 1, cl + 1
            node = node[part]
        except (AttributeError, KeyError, IndexError, TypeError):
            break
    return line, col
