"""The `megatron-dapo` command: train, preflight, mismatch, config, demo, convert."""

from __future__ import annotations

import argparse
import logging
import sys

from megatron_dapo.errors import DapoError
from megatron_dapo.observability.run_logging import FILE_ONLY, setup_run_logging

log = logging.getLogger("megatron_dapo.cli")  # not __name__: "__main__" under python -m would not count as ours
# What the commands print as one line: the package's own errors, which name what is wrong and the fix, and the
# operating system's (a path, a permission, a full disk), which name the file. Anything else is a bug: traceback.
EXPLAINED = (DapoError, OSError)
VERBOSE_HELP = ("print every library's log records and warnings too (by default they go only to {log}; "
                "the console shows this program's progress, warnings and errors)")


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (the docs' commands are checked against it)."""
    parser = argparse.ArgumentParser(prog="megatron-dapo", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run DAPO from a YAML config (under torchrun or srun for several ranks)")
    train.add_argument("config", help="the run's YAML config (see launch/configs/)")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. optim.lr=2e-6")
    train.add_argument("--verbose", action="store_true", help=VERBOSE_HELP.format(log="train.output_dir/train.log"))
    from megatron_dapo.preflight import Hardware

    preflight = commands.add_parser("preflight", help="check a config against its model's config.json and the "
                                    "hardware, and print memory and time estimates, before any GPU hour is spent")
    preflight.add_argument("config", help="the run's YAML config (see launch/configs/)")
    preflight.add_argument("overrides", nargs="*", help="section.key=value overrides, as for train")
    preflight.add_argument("--gpu-memory-gb", type=float, default=Hardware.gpu_memory_gb, help="memory of one GPU")
    preflight.add_argument("--gpu-bandwidth-tbs", type=float, default=Hardware.gpu_bandwidth_tbs,
                           help="memory bandwidth of one GPU (default: H100 SXM's)")
    preflight.add_argument("--gpus", type=int, default=None,
                           help="trainer GPUs (processes); default: what the config implies, printed")
    mismatch = commands.add_parser("mismatch", help="sample a few groups from the config's servers, recompute them "
                                   "with its trainer's layout, print the engine-vs-trainer mismatch by response "
                                   "position, and exit 1 past a threshold (under torchrun for TP / PP > 1)")
    mismatch.add_argument("config", help="the run's YAML config, with rollout.server_urls")
    mismatch.add_argument("overrides", nargs="*", help="section.key=value overrides, as for train")
    mismatch.add_argument("--prompts", type=int, default=8, help="prompts of data.train_path to sample (the first)")
    mismatch.add_argument("--samples", type=int, default=4, help="responses per prompt")
    mismatch.add_argument("--max-new-tokens", type=int, default=256, help="tokens per response at most")
    mismatch.add_argument("--threshold", type=float, default=None, help="the mean |log-ratio| over all tokens past "
                          "which it exits 1 (default: the start-up check's, 0.05; bf16 kernels give about 0.01, "
                          "other weights or another temperature far more)")
    mismatch.add_argument("--json", default=None, help="also write the table and verdict to this file")
    # Imported here, not at the top: multiprocessing's spawned children (reward workers, the rollout service, the
    # checkpoint writer's helper) run this module again as their __main__, and the demo package loads torch and
    # transformers, 2.5 s of CPU per child spent for nothing.
    from megatron_dapo.demo.tasks import TASKS

    demo = commands.add_parser("demo", help="a tiny model learns arithmetic with DAPO on this CPU, in minutes")
    demo.add_argument("--output", default="runs/demo", help="folder for the data, models, metrics and plot")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--moe", action="store_true", help="the policy a tiny Qwen3-MoE (8 experts, top 2), its "
                      "routers replaying the engine's routes")
    demo.add_argument("--task", choices=list(TASKS), default="sums", help="sums: two-digit sums answered in one "
                      "line; chain: sums of 2 to 10 numbers worked line by line (11 to 77 tokens)")
    demo.add_argument("--verbose", action="store_true", help=VERBOSE_HELP.format(log="OUTPUT/demo.log"))
    config = commands.add_parser("config", help="print a run's config as resolved (defaults and overrides "
                                 "applied), or with --reference every key with its type, default and meaning")
    config.add_argument("config", nargs="?", help="the run's YAML config (see launch/configs/)")
    config.add_argument("overrides", nargs="*", help="section.key=value overrides, as for train")
    config.add_argument("--reference", action="store_true",
                        help="print the reference of every key (docs/configuration.md) instead")
    convert = commands.add_parser("convert", help="convert checkpoints between Hugging Face and megatron-core")
    from megatron_dapo.checkpoint import convert as convert_module

    convert_module.add_arguments(convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "convert":
        from megatron_dapo.checkpoint import convert as convert_module

        return convert_module.run(args)
    if args.command == "train":
        from megatron_dapo.config import ConfigError
        from megatron_dapo.parallel.runtime import launch_env
        from megatron_dapo.preflight import Hardware
        from megatron_dapo.run_config import load_config
        from megatron_dapo.trainer import run_training

        try:
            cfg = load_config(args.config, args.overrides)
            env = launch_env()  # the trainer's world size and this rank, as run_training will see them
            _preflight(cfg, Hardware(gpus=env.world_size), show=env.rank == 0, files=True)
        except ConfigError as e:
            print(f"megatron-dapo train: bad config: {e}", file=sys.stderr)
            return 2
        log_file = setup_run_logging(cfg.train.output_dir, "train", verbose=args.verbose, rank=env.rank)
        log.info("full log (libraries and warnings included): %s", log_file)
        try:
            return run_training(cfg)
        except EXPLAINED as e:
            return _explain("train", e, log_file, env.rank)
    if args.command == "preflight":
        from megatron_dapo.config import ConfigError
        from megatron_dapo.preflight import Hardware
        from megatron_dapo.run_config import load_config

        try:
            cfg = load_config(args.config, args.overrides)
            _preflight(cfg, Hardware(args.gpu_memory_gb, args.gpu_bandwidth_tbs, args.gpus), show=True)
        except ConfigError as e:
            print(f"megatron-dapo preflight: bad config: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "mismatch":
        return _mismatch(args)
    if args.command == "config":
        return _config(args, parser)
    if args.command == "demo":
        from megatron_dapo.demo import run_demo

        log_file = setup_run_logging(args.output, "demo", verbose=args.verbose, append=False)
        log.info("full log (libraries and warnings included): %s", log_file)
        try:
            return run_demo(args.output, seed=args.seed, log_file=log_file, moe=args.moe, task=args.task)
        except EXPLAINED as e:
            return _explain("demo", e, log_file, 0)
    parser.error(f"unknown command {args.command!r}")
    return 2


def _mismatch(args) -> int:
    from megatron_dapo.config import ConfigError
    from megatron_dapo.mismatch_check import format_table, run_mismatch_check, write_json
    from megatron_dapo.parallel.runtime import launch_env
    from megatron_dapo.run_config import load_config

    from megatron_dapo.rollout.logprob_check import DEFAULT_ATOL

    rank = launch_env().rank
    threshold = DEFAULT_ATOL if args.threshold is None else args.threshold
    try:
        cfg = load_config(args.config, args.overrides)
        rows, ok = run_mismatch_check(cfg, prompts=args.prompts, samples=args.samples,
                                      max_new_tokens=args.max_new_tokens, threshold=threshold)
    except ConfigError as e:
        print(f"megatron-dapo mismatch: bad config: {e}", file=sys.stderr)
        return 2
    except EXPLAINED as e:
        print(f"megatron-dapo mismatch: {e}", file=sys.stderr)
        return 1
    if rank == 0:
        print(format_table(rows))
        verdict = "within" if ok else "PAST"
        print(f"mean |log pi_trainer - log pi_engine| {rows[-1].abs_mean:.3g} over {rows[-1].tokens} tokens: "
              f"{verdict} the threshold {threshold:g}")
        if args.json:
            write_json(args.json, rows, threshold, ok)
    return 0 if ok else 1


def _config(args, parser) -> int:
    from megatron_dapo.config import ConfigError
    from megatron_dapo.run_config import load_config

    if args.reference:
        from megatron_dapo.config_reference import reference

        print(reference(), end="")
        return 0
    if not args.config:
        parser.error("config: give a run's YAML config, or --reference")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"megatron-dapo config: bad config: {e}", file=sys.stderr)
        return 2
    import yaml

    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


def _explain(command: str, error: BaseException, log_file, rank: int) -> int:
    """An error whose message says it all, as one line on the console; its traceback in the run's log (and on the
    console with --verbose). Returns the exit code."""
    log.error("%s failed", command, exc_info=error, extra=FILE_ONLY)
    where = f"[rank {rank}] " if rank else ""
    print(f"{where}megatron-dapo {command}: {type(error).__name__}: {error} (traceback: {log_file})", file=sys.stderr,
          flush=True)
    return 1


def _preflight(cfg, hardware, show: bool, files: bool = False) -> None:
    """Print the estimates and checks (when `show`); raise the first failed check as a ConfigError. `files`: check
    the run's files too (where it runs)."""
    from megatron_dapo.preflight import preflight

    report = preflight(cfg, hardware, files=files)
    if show:
        print(report.render(), flush=True)
    report.raise_first_failure()


if __name__ == "__main__":
    sys.exit(main())
