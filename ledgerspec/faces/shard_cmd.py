"""``ledgerspec shard FILE [--nproc N] [-o OUT] [--check] [--offline] [--trust-remote-code]``.

Calculates what each rank holds under FSDP2 (``fully_shard`` per decoder layer + root), with ZeRO-1/2/3 for
comparison, prints a per-rank table and writes ``parallelism.x-per-rank`` into the document.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ledgerspec.errors import EXIT_FINDINGS, EXIT_OK


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("shard", help="calculate per-rank state under FSDP2 (and ZeRO for comparison)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--nproc", type=int, metavar="N", help="ranks (default: parallelism.gpu_count)")
    p.add_argument("-o", "--output", metavar="OUT", help="write the result here instead of in place")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file would change")
    p.add_argument("--offline", action="store_true", help="never touch the network (HF_HUB_OFFLINE)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a model's own code (auto_map)")
    p.set_defaults(run=run_shard)


def run_shard(args: argparse.Namespace) -> int:
    from ledgerspec.contract.document import load
    from ledgerspec.contract.units import format_size
    from ledgerspec.contract.writer import atomic_write
    from ledgerspec.derivations.sharding_ledger import shard

    doc = load(args.file)
    result = shard(doc, nproc=args.nproc, offline=args.offline, trust_remote_code=args.trust_remote_code)
    plan = result.plan
    print(f"FSDP2 on {plan.world_size} ranks, reshard_after_forward={str(plan.reshard_after_forward).lower()}")
    print(f"{'rank':>4}  {'frozen':>11}  {'adapter':>11}  {'gradients':>11}  {'optimizer':>11}  {'gathered':>11}  "
          f"{'total':>11}")
    for rs in plan.ranks:
        cells = (rs.frozen_base, rs.adapter, rs.gradients, rs.optimizer, rs.gathered, rs.with_gathered)
        print(f"{rs.rank:>4}  " + "  ".join(f"{format_size(v):>11}" for v in cells))
    for key, z in result.zero.items():
        print(f"{key:>13}: device {format_size(z.device_total)} per rank, host {format_size(z.host)}")
    print("(model state only: activations and temporaries come from `ledgerspec estimate` / `measure`)")
    if args.check:
        if result.change is not None:
            print(f"{args.file}: would change parallelism.x-per-rank; run `ledgerspec shard`", file=sys.stderr)
            return EXIT_FINDINGS
        return EXIT_OK
    target = args.output or args.file
    if args.output:  # the ledger moves: keep a relative identity.config_path pointing at the same file
        from ledgerspec.contract.document import relocate
        from ledgerspec.contract.writer import render

        relocate(doc, args.output)
        result.text = render(doc.data, doc.text)
    if result.change is not None or args.output:
        atomic_write(target, result.text)
    return EXIT_OK
