"""The trainer's parts, each built by its own subsystem from the run's config, in the order a run needs them:
the process groups, the policy, the rollout service and its servers, a resume, the weights' route to the servers,
the schedule of the rollout mode, the metrics. Every rank builds them, in the same order (several are
collective); the driver (global rank 0) alone holds the rollout service and the metrics.

Each part that holds a process, a thread or a file is put on the parts' exit stack as it is built: an error at any
point unwinds what was built so far (servers and helpers stopped, the heartbeat saying the rank failed and why, so
that the other ranks end at once instead of waiting in a collective), and the process exits within seconds; the
trainer's close unwinds the same stack at the end of a run."""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from megatron_dapo.checkpoint.mcore_checkpoint import start_writer_helper
from megatron_dapo.checkpoint.policy_from_hf import Policy, build_policy, open_hf_checkpoint
from megatron_dapo.checkpoint.trainer_checkpoint import latest_checkpoint, load_trainer_checkpoint, read_driver_state
from megatron_dapo.loop.batch_feed import BatchFeed
from megatron_dapo.loop.progress import RunProgress
from megatron_dapo.loop.rollout_schedule import RolloutSchedule
from megatron_dapo.loop.weight_publisher import WeightPublisher
from megatron_dapo.observability.metrics_log import MetricsLogger
from megatron_dapo.parallel.rank_heartbeat import RankHeartbeat
from megatron_dapo.parallel.runtime import Runtime, driver_value, init_runtime, shutdown_runtime
from megatron_dapo.rollout.logprob_check import check_servers
from megatron_dapo.rollout.server_check import check_servers_answer
from megatron_dapo.rollout.server_key import share_server_key
from megatron_dapo.run_config import DapoConfig
from megatron_dapo.service.rollout_service import RolloutService

log = logging.getLogger(__name__)


@dataclass
class TrainerParts:
    runtime: Runtime
    heartbeat: RankHeartbeat
    policy: Policy
    feed: BatchFeed
    publisher: WeightPublisher
    schedule: RolloutSchedule
    metrics: MetricsLogger | None  # the driver's
    progress: RunProgress
    checkpoint_root: Path
    teardown: ExitStack  # what stops the parts that hold processes, threads and files, last built first

    def close(self, error: BaseException | None = None) -> None:
        """Stop every part; `error`: what ended the run, which this rank's heartbeat tells the other ranks first."""
        if error is not None:
            self.heartbeat.failing(error)
        self.teardown.__exit__(type(error) if error else None, error, error.__traceback__ if error else None)


def build_parts(cfg: DapoConfig) -> TrainerParts:
    with ExitStack() as teardown:  # an error below unwinds what was built before it
        writer_helper = start_writer_helper()  # it starts beside the setup below, not inside the first checkpoint
        # A process exits only once the helper is up: the interpreter's exit waits for the helper process it is
        # starting, which nothing would then stop.
        teardown.callback(writer_helper.join)
        runtime = init_runtime(cfg.parallel)
        teardown.callback(shutdown_runtime)
        heartbeat = teardown.enter_context(RankHeartbeat.of_rank(runtime.env, cfg.parallel.heartbeat_timeout_s))
        try:
            parts = _build(cfg, runtime, heartbeat, teardown)
        except BaseException as error:
            heartbeat.failing(error)  # the others are told at once, while this rank stops what it started
            raise
        writer_helper.join()
        parts.teardown = teardown.pop_all()
        return parts


def _build(cfg: DapoConfig, runtime: Runtime, heartbeat: RankHeartbeat, teardown: ExitStack) -> TrainerParts:
    from megatron.core import parallel_state

    driver, dp_size = dist.get_rank() == 0, runtime.data_parallel
    cfg.algorithm.check_data_parallel(dp_size)
    hf, spec = open_hf_checkpoint(cfg.model)
    sglang = cfg.rollout.engine == "sglang"
    if sglang:
        share_server_key()
    if driver and sglang and cfg.rollout.server_urls:  # seconds, before the policy's minutes of building
        check_servers_answer(cfg.rollout.server_urls, cfg.rollout.server_health_timeout_s)
    # The rollout service's process and its servers start first: they take minutes on GPUs, beside the policy's
    # build and load. Colocated servers start after it: they share its GPUs, and their memory was sized
    # (rollout.server_extra_args) with the policy's allocated first.
    starting = _start_service(cfg, dp_size, teardown) if driver and sglang and not cfg.rollout.colocate else None
    policy = build_policy(cfg, runtime, hf, spec)
    service = None
    if driver and sglang:
        service = starting or _start_service(cfg, dp_size, teardown)
        service.wait_up()
    elif driver:
        service = RolloutService.in_process(cfg, policy, runtime.device, dp_size)
        teardown.callback(service.close)
    checkpoint_root = Path(cfg.train.output_dir) / "checkpoints"
    resume = latest_checkpoint(checkpoint_root) if cfg.train.resume else None
    if resume is not None and driver:
        log.info("resuming from %s (train.resume; the newest complete checkpoint in %s)", resume, checkpoint_root)
    extra = load_trainer_checkpoint(resume, policy.trainer) if resume is not None else None
    progress = RunProgress(extra["step"] if extra else 0)
    if extra:
        policy.resumed_at(progress.steps_done)
    metrics = MetricsLogger.for_run(cfg, progress.steps_done if extra else None) if driver else None
    if metrics is not None:
        teardown.callback(metrics.close)
    server_urls = driver_value(service.server_urls if driver else None) if sglang else []
    publisher = WeightPublisher.from_config(cfg, runtime, policy, server_urls, progress,
                                            local_engine=service.engine if driver and not sglang else None)
    teardown.callback(publisher.close)
    feed = BatchFeed(service, publisher, dp_rank=parallel_state.get_data_parallel_rank(), dp_size=dp_size,
                     updates_per_step=cfg.train.updates_per_step,
                     timeout=timedelta(minutes=cfg.parallel.distributed_timeout_minutes))
    if extra and driver:
        feed.load_state_dict(extra["sampler"], read_driver_state(resume, "rollout_buffer") or [])
        log.info("resumed from %s (step %d)", resume, progress.steps_done)
    schedule = RolloutSchedule.from_config(cfg, feed, server_urls, runtime.device)
    if extra:
        publisher.publish()  # the servers start from the initial weights
    if sglang and cfg.rollout.server_urls:
        check_servers(cfg.rollout.server_urls, policy.module, spec, temperature=cfg.rollout.temperature,
                      max_tokens_per_micro_batch=cfg.model.max_tokens_per_micro_batch, device=runtime.device,
                      packed=cfg.model.packing)
    return TrainerParts(runtime, heartbeat, policy, feed, publisher, schedule, metrics, progress, checkpoint_root,
                        teardown)


def _start_service(cfg: DapoConfig, dp_size: int, teardown: ExitStack):
    """Driver: the rollout service's process over SGLang servers (which it starts, unless given their URLs),
    started, not yet up; stopped by `teardown`."""
    from megatron_dapo.service.rollout_service_process import RolloutServiceProcess

    service = RolloutServiceProcess(cfg, dp_size)
    teardown.callback(service.close)
    return service
