"""The ``dynamo-flexkv`` command."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from dynamo_flexkv import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynamo-flexkv", description="Multi-tier KV-cache offload for NVIDIA Dynamo")
    parser.add_argument("--version", action="version", version=f"dynamo-flexkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="report native extension, io_uring, O_DIRECT, CUDA, NIXL, Dynamo")
    doctor.add_argument("--cache-dir", action="append", dest="cache_dirs", metavar="DIR",
                        help="directory to probe for O_DIRECT (default: ssd_cache_dir from the config, else /tmp)")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")

    from dynamo_flexkv.bench import build_parser as bench_parser
    bench_parser(sub.add_parser("bench", help="run a benchmark against its same-run baseline"))
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from dynamo_flexkv.doctor import main as doctor_main
        return doctor_main(args.cache_dirs, args.json)
    if args.command == "bench":
        from dynamo_flexkv.bench import run
        run(args)
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
