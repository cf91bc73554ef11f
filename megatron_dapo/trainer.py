"""The DAPO training loop (`megatron-dapo train`), run on every trainer rank (torchrun or srun).

One step, as in the paper: the engine samples a group of G responses per prompt; math-verify judges each;
rewards (+1 / -1 and the soft overlong penalty) are normalised inside the group into advantages; groups that
are all right or all wrong are dropped and sampling goes on until the batch is full (dynamic sampling). Those
happen in the rollout service (service/rollout_service.py), which global rank 0 (the driver) asks for each batch
(loop/batch_feed.py hands each rank its data-parallel share). Here: the policy recomputes the old log-probs; the
batch is cut into mini-batches, each one optimizer step of the fused clipped token-level loss; the new weights go
to the inference engine (loop/weight_publisher.py). When the rollout runs beside training (rollout.mode
one_step_off, async) and what colocated servers lend the trainer meanwhile is the schedule's
(loop/rollout_schedule.py), which the loop calls at fixed points. The parts are built by their subsystems
(loop/build.py).
"""

from __future__ import annotations

import logging
import math
import time

import torch.distributed as dist

from megatron_dapo.algorithm.empty_step_watch import EmptyStepWatch
from megatron_dapo.checkpoint.trainer_checkpoint import save_trainer_checkpoint
from megatron_dapo.loop.build import build_parts
from megatron_dapo.loop.step_metrics import StepTimer, train_metrics
from megatron_dapo.loop.step_watch import BadStepWatch, UpdateCutter
from megatron_dapo.parallel.runtime import driver_value
from megatron_dapo.policy.rollout_samples import training_samples
from megatron_dapo.run_config import DapoConfig

log = logging.getLogger(__name__)


class DapoTrainer:
    def __init__(self, cfg: DapoConfig):
        self.cfg = cfg
        self.parts = parts = build_parts(cfg)  # raises with every part built before the error stopped
        self.runtime, self.heartbeat, self.policy = parts.runtime, parts.heartbeat, parts.policy
        self.feed, self.publisher, self.schedule = parts.feed, parts.publisher, parts.schedule
        self.metrics, self.progress, self.checkpoint_root = parts.metrics, parts.progress, parts.checkpoint_root
        self.driver = dist.get_rank() == 0
        self.updates = UpdateCutter(cfg.train.updates_per_step)
        self.bad_steps = BadStepWatch(cfg.train.max_bad_steps, self.driver)
        self.empty_steps = EmptyStepWatch(cfg.algorithm.max_sampling_rounds, cfg.algorithm.batch_size)  # driver's

    @property
    def step_index(self) -> int:
        """Rollout steps done; also the version of the weights the engine samples from."""
        return self.progress.steps_done

    # -- the step ------------------------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        """One DAPO step; returns its metrics (complete on the driver)."""
        timer = StepTimer(lambda name: self._doing(f"step {self.step_index + 1}: {name}"))
        start = time.perf_counter()
        with timer("rollout"):
            share, metrics = self.feed.next_share(self.step_index)
        self.schedule.batch_taken(self.step_index, timer)
        update_metrics = self._train(share, timer) if len(share) else {}
        applied = not update_metrics or update_metrics["updates_skipped"] < update_metrics["updates"]
        self.progress.steps_done += 1  # the new weights are this step's: the servers get them under its number
        self.policy.reference_after(self.step_index)  # the KL term's reference, where it follows the policy
        self.schedule.trained(self.step_index, timer)
        if self.schedule.publishes(applied):
            with timer("sync"):
                self.publisher.publish(live=self.schedule.live)
        self.schedule.published(timer)
        step_s = time.perf_counter() - start
        metrics.update(update_metrics, tokens_per_s=metrics.get("batch_tokens", 0.0) / step_s,
                       **{"time/step": step_s}, **{f"time/{k}": v for k, v in timer.seconds.items()})
        return metrics

    def _train(self, share, timer: StepTimer) -> dict[str, float]:
        """Every rank: the old log-probs of its share (loss.old_logprobs "rollout": the engine's, nothing
        recomputed), then the step's updates; their metrics."""
        loss, policy = self.cfg.loss, self.policy
        with timer("old_logprob"):
            samples, sums, maxima, agreement = training_samples(
                policy.module.eval(), policy.reference, share, spec=policy.spec,
                max_tokens_per_micro_batch=self.cfg.model.max_tokens_per_micro_batch, device=self.runtime.device,
                correction=loss.correction.rule() if loss.correction.enabled else None,
                temperature=self.cfg.rollout.temperature,
                old_logprobs=loss.old_logprobs, packed=self.cfg.model.packing)
            policy.module.train()
        with timer("train"):
            policy.trainer.begin_rollout_step(self.step_index)  # the LR warmup counts rollout steps
            # the routing agreement from the first update where no old-log-prob pass counted it
            results = [policy.trainer.step(update, measure_routing=i == 0 and agreement is None)
                       for i, update in enumerate(self.updates.cut(samples, share, self.step_index + 1))]
        self.bad_steps.observe(self.step_index + 1, results, self.feed.batch_prompts)
        return train_metrics(results, sums, maxima, loss, agreement)

    def _doing(self, what: str, within_s: float | None = None, key: str | None = None) -> None:
        """What this rank's main thread does now, for its heartbeat (named if it gets stuck there); `within_s`:
        the deadline it must be done in (config `key`)."""
        self.heartbeat.set_doing(what, within_s, key)

    # -- evaluation, checkpoints, the run ------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Every rank: avg@k and pass@k on the held-out prompts at the eval section's sampling settings, computed
        by the driver's rollout service while the other ranks wait for it outside collectives; {} on those."""
        self._doing(f"evaluation after step {self.step_index}")
        return self.feed.evaluate()

    def save_checkpoint(self) -> None:
        # The data position is the service's between jobs: the batches sampled ahead are taken first, and kept
        # in the checkpoint, so that the resumed run trains on them and draws no prompt twice.
        self._doing(f"waiting for the batches ahead before the checkpoint of step {self.step_index}")
        self.feed.drain("drained")
        sampler, ready = self.feed.state_dict() if self.driver else (None, [])
        extra = driver_value({"step": self.step_index, "sampler": sampler, "config": self.cfg.to_dict()})
        self._doing(f"writing the checkpoint of step {self.step_index} in {self.checkpoint_root}",
                    self.cfg.train.checkpoint_timeout_s, "train.checkpoint_timeout_s")
        save_trainer_checkpoint(self.checkpoint_root, self.step_index, self.policy.trainer, extra,
                                keep_last=self.cfg.train.keep_last,
                                driver_state={"rollout_buffer": ready} if ready else None)
        self._doing(f"done with the checkpoint of step {self.step_index}")

    def train(self) -> dict[str, float]:
        """Run until train.steps; returns the last step's metrics (on the driver)."""
        from tqdm import tqdm

        cfg = self.cfg.train
        metrics: dict[str, float] = {}
        # closed on an error too: its last line ends, and the error is said on a line of its own
        with tqdm(total=cfg.steps, initial=self.step_index, desc="dapo", disable=not self.driver) as bar:
            while self.step_index < cfg.steps:
                metrics = self.step()
                if self.cfg.eval.every and self.step_index % self.cfg.eval.every == 0:
                    metrics.update(self.evaluate())
                if self.driver:
                    self.empty_steps.observe(self.step_index, metrics)
                    self.metrics.log(self.step_index, metrics)
                    bar.set_postfix(acc=f"{metrics.get('accuracy', math.nan):.2f}",
                                    kept=f"{metrics.get('groups_kept', 0):.0f}")
                    bar.update(1)
                done = self.step_index == cfg.steps
                if done or (cfg.checkpoint_every and self.step_index % cfg.checkpoint_every == 0):
                    self.save_checkpoint()
        return metrics

    def close(self, error: BaseException | None = None) -> None:
        """Stop the run's parts; `error`: what ended it (the other ranks are told, and end too)."""
        self.parts.close(error)


def run_training(cfg: DapoConfig) -> int:
    trainer = DapoTrainer(cfg)
    try:
        trainer.train()
    except BaseException as error:
        trainer.close(error)
        raise
    trainer.close()
    return 0
