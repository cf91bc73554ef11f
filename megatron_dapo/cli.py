"""The `megatron-dapo` command: train, demo, convert."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-dapo", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run DAPO from a YAML config (under torchrun or srun for several ranks)")
    train.add_argument("config", help="the run's YAML config (see launch/configs/)")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. optim.lr=2e-6")
    demo = commands.add_parser("demo", help="a tiny model learns arithmetic with DAPO on this CPU, in minutes")
    demo.add_argument("--output", default="runs/demo", help="folder for the data, models, metrics and plot")
    demo.add_argument("--seed", type=int, default=0)
    convert = commands.add_parser("convert", help="convert checkpoints between Hugging Face and megatron-core")
    from megatron_dapo.checkpoint import convert as convert_module

    convert_module.add_arguments(convert)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "convert":
        return convert_module.run(args)
    if args.command == "train":
        from megatron_dapo.config import ConfigError
        from megatron_dapo.run_config import load_config
        from megatron_dapo.trainer import run_training

        try:
            cfg = load_config(args.config, args.overrides)
        except ConfigError as e:
            print(f"megatron-dapo train: bad config: {e}", file=sys.stderr)
            return 2
        return run_training(cfg)
    if args.command == "demo":
        from megatron_dapo.demo import run_demo

        return run_demo(args.output, seed=args.seed)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
