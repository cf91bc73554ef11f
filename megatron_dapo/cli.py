"""The `megatron-dapo` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-dapo", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="show the fused DAPO loss updating a toy policy on the seed's group of four")
    demo.add_argument("--steps", type=int, default=8, help="optimizer steps on the fixed rollout (default 8)")
    demo.add_argument("--seed", type=int, default=0)
    convert = commands.add_parser("convert", help="convert checkpoints between Hugging Face and megatron-core")
    from megatron_dapo.checkpoint import convert as convert_module

    convert_module.add_arguments(convert)
    args = parser.parse_args(argv)
    if args.command == "convert":
        return convert_module.run(args)
    if args.command == "demo":
        from megatron_dapo.op_demo import run_demo

        return run_demo(steps=args.steps, seed=args.seed)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
