"""How much the device-level rows of ``device_vs_published_fsdp.py`` rest on one assumption of the
``sync_module_states`` model (:mod:`ledgerspec.derivations.shard.fsdp.sync`): each unit's flat broadcast buckets are
freed pending on the NCCL stream and taken back into the pool when the next unit's wrapping starts. Here they are
freed at once instead (as if the host waited for every broadcast), and the rows named are estimated again; nothing is
written.

    python benchmarks/sync_frees_at_once.py fms-llama-2-70b-qlora-2gpu-bs4 fms-mistral-7b-qlora-2gpu-bs4 \\
        fms-llama-2-70b-qlora-2gpu-bs2 fms-mistral-7b-lora-2gpu-bs2

Printed on the machine of ``benchmarks/results/device-fsdp.md`` (device-level GiB; the committed table's pending
frees in brackets, the rows without the broadcasts after them): Llama-2-70B QLoRA 4 x 4096 79.25 (79.25; 79.03)
completing with 0.00 to spare (at the edge); Mistral-7B QLoRA 4 x 4096 19.01 (19.36; 19.01); Llama-2-70B QLoRA
2 x 4096 50.47 (50.22; 49.77); Mistral-7B LoRA 2 x 4096 17.34 (17.33; 17.36).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(keys: list[str]) -> None:
    from ledgerspec.derivations.shard.fsdp import sync
    from tests.support import load_script

    original = sync.broadcasting

    @contextlib.contextmanager
    def at_once(tracker: Any, _stream: int) -> Iterator[Any]:
        with original(tracker, 0) as seen:  # used on the stream it was made on: its free is not pending
            yield seen

    sync.broadcasting = at_once
    bench = load_script(ROOT / "benchmarks" / "device_vs_published_fsdp.py", "device_vs_published_fsdp")
    for key in keys:
        run = next(r for r in bench.RUNS if r.key == key)
        print(key, bench.estimate_run(run).cells(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
