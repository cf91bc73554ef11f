"""The DAPO training loop (`megatron-dapo train`), run on every trainer rank (torchrun or srun).

One step, as in the paper: the engine samples a group of G responses per prompt; math-verify judges each;
rewards (+1 / -1 and the soft overlong penalty) are normalised inside the group into advantages; groups that
are all right or all wrong are dropped and sampling goes on until the batch is full (dynamic sampling); the
policy recomputes the old log-probs; the batch is cut into mini-batches, each one optimizer step of the fused
clipped token-level loss; the new weights go to the inference engine. Global rank 0 (the driver) asks the
rollout service (rollout_service.py, in a process of its own over SGLang) for each batch and hands each rank
its data-parallel share of it; the other ranks wait for it outside any collective (a paper-scale rollout
outlasts any collective's watchdog); everything after that is collective. With rollout.mode one_step_off the
service samples the next step's batch while this one trains, and the weights reach the servers once both are
done; with async it samples the next rollout.max_staleness steps' batches back to back, and the weights are
pushed into the servers while they sample. Colocated servers (rollout.colocate) release their memory once the
rollout is done and take it back around the weight sync.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.algorithm.empty_step_watch import EmptyStepWatch
from megatron_dapo.checkpoint.hf_weights import load_hf_weights, load_policy_weights
from megatron_dapo.checkpoint.mcore_checkpoint import start_writer_helper
from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
from megatron_dapo.checkpoint.trainer_checkpoint import (
    latest_checkpoint,
    load_trainer_checkpoint,
    read_driver_state,
    save_trainer_checkpoint,
)
from megatron_dapo.metrics_log import MetricsLogger
from megatron_dapo.ops import STAT_NAMES
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.mismatch import reduce_mismatch
from megatron_dapo.policy.model import build_model
from megatron_dapo.policy.rollout_samples import training_samples
from megatron_dapo.policy.train_step import PolicyTrainer
from megatron_dapo.rank_heartbeat import RankHeartbeat
from megatron_dapo.rank_shares import PackedShare, deal_by_tokens
from megatron_dapo.rollout.server_key import SERVER_KEY_ENV, ensure_server_key
from megatron_dapo.rollout.server_memory import ServerMemory
from megatron_dapo.rollout_service import RESYNC, ReadyBatch, RolloutService
from megatron_dapo.run_config import DapoConfig
from megatron_dapo.runtime import DriverSignal, builds_for_gpu, init_runtime, shutdown_runtime
from megatron_dapo.share_scatter import ShareScatter

log = logging.getLogger(__name__)


class StepTimer:
    def __init__(self, on_enter=lambda name: None):
        self.seconds: dict[str, float] = {}
        self.on_enter = on_enter  # told each section's name as it starts

    @contextmanager
    def __call__(self, name: str):
        self.on_enter(name)
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


class DapoTrainer:
    def __init__(self, cfg: DapoConfig):
        from megatron.core import parallel_state

        self.cfg = cfg
        writer_helper = start_writer_helper()  # it starts beside the setup below, not inside the first checkpoint
        self.runtime = init_runtime(cfg.parallel)
        self.driver = dist.get_rank() == 0
        env = self.runtime.env
        self.heartbeat = RankHeartbeat(env.rank, env.world_size, env.node,
                                       env.master_addr if env.world_size > 1 else None, env.master_port,
                                       cfg.parallel.heartbeat_timeout_s)
        self.signal = DriverSignal()  # the driver's word to the ranks waiting on its rollout
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        # The driver hands each rank its share of the batch.
        self.scatter = ShareScatter(self.dp_rank, timedelta(minutes=cfg.parallel.distributed_timeout_minutes))
        cfg.algorithm.check_data_parallel(self.dp_size)
        hf = HFCheckpoint(cfg.model.path)
        self.hf_config = hf.config
        self.spec = model_spec_from_hf(hf.config)
        hf.validate(self.spec)
        if cfg.rollout.engine == "sglang":
            self._share_server_key()
        # The rollout service's process and its servers start first: they take minutes on GPUs, beside the
        # policy's build and load below. Colocated servers start after it, as before: they share its GPUs, and
        # their memory was sized (rollout.server_extra_args) with the policy's allocated first.
        early = self.driver and cfg.rollout.engine == "sglang" and not cfg.rollout.colocate
        starting = self._start_rollout_service() if early else None
        self.policy = PolicyTrainer(self.spec, cfg.parallel, self.runtime.device, cfg.optim, cfg.loss,
                                    cfg.model.max_tokens_per_micro_batch,
                                    activation_recompute=cfg.model.activation_recompute,
                                    updates_per_step=cfg.train.updates_per_step,
                                    temperature=cfg.rollout.temperature,
                                    params_dtype=getattr(torch, cfg.model.training_dtype(builds_for_gpu(cfg.parallel))))
        load_policy_weights(self.policy, hf.get)
        self.reference = self._frozen_reference(hf) if cfg.loss.kl_coef > 0 else None
        self.output_dir = Path(cfg.train.output_dir)
        self.step_index = 0  # rollout steps done; also the version of the weights the engine samples from
        self.warned_fewer_updates = False
        self.bad_steps = 0  # rollout steps in a row with a skipped update
        self.empty_steps = EmptyStepWatch(cfg.algorithm.max_sampling_rounds, cfg.algorithm.batch_size)  # driver's
        self.batch_prompts: list[int] = []  # the driver's: dataset rows of the batch being trained on
        # The driver's: batches sampled ahead of their step (the overlapping modes), taken from the service and
        # not yet trained on, oldest first.
        self.ready: list[ReadyBatch] = []
        self.service = self._rollout_service(starting) if self.driver else None
        resume = latest_checkpoint(self.checkpoint_root) if cfg.train.resume else None
        if resume is not None:
            extra = load_trainer_checkpoint(resume, self.policy)
            self.step_index = extra["step"]
            if self.driver:
                self.service.load_state_dict(extra["sampler"])
                self.ready = [ReadyBatch.from_state_dict(b) for b in read_driver_state(resume, "rollout_buffer") or []]
                log.info("resumed from %s (step %d)", resume, self.step_index)
        if self.driver:
            self.metrics = MetricsLogger(self.output_dir, tensorboard=cfg.train.tensorboard,
                                         resume_step=self.step_index if resume is not None else None,
                                         wandb=cfg.metrics.wandb, run_config=cfg.to_dict())
        self.server_urls = self._server_urls()
        self.syncer = self._weight_syncer()
        self.server_memory = (ServerMemory(self.server_urls, self.runtime.device, cfg.rollout.weight_sync_timeout_s)
                              if cfg.rollout.colocate else None)
        if resume is not None:
            self.sync_weights()  # the servers start from the initial weights
        if cfg.rollout.engine == "sglang" and cfg.rollout.server_urls:
            self._check_server_logprobs()
        writer_helper.join()

    # -- setup -------------------------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        return self.output_dir / "checkpoints"

    def _frozen_reference(self, hf):
        from megatron.core import parallel_state

        ref = build_model(self.spec, self.cfg.parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                          post_process=parallel_state.is_pipeline_last_stage(),
                          params_dtype=self.policy.module.config.params_dtype)
        load_hf_weights(ref, hf.get, self.spec, self.cfg.parallel)
        return ref.eval().requires_grad_(False)

    def _start_rollout_service(self):
        """Driver: the rollout service's process over SGLang servers (which it starts, unless given their URLs),
        started, not yet up."""
        from megatron_dapo.rollout_service_process import RolloutServiceProcess

        return RolloutServiceProcess(self.cfg, self.dp_size)

    def _rollout_service(self, starting):
        """The driver's rollout service: in a process of its own over SGLang servers (`starting`, or started now),
        once it is up; inline over the in-process engine, which samples with the live policy."""
        cfg = self.cfg
        if cfg.rollout.engine == "sglang":
            service = starting or self._start_rollout_service()
            service.wait_up()
            return service
        from megatron_dapo.rollout.local_engine import LocalEngine, hf_eos_token_ids

        engine = LocalEngine(self.policy.module, vocab_size=self.spec.vocab_size,
                             max_positions=self.spec.max_position_embeddings,
                             eos_token_ids=hf_eos_token_ids(self.hf_config), device=self.runtime.device,
                             seed=cfg.parallel.seed, weight_version=str(self.step_index))
        return RolloutService(cfg, engine, self.dp_size)

    def _share_server_key(self) -> None:
        """Every rank: the driver's key for the run's SGLang servers (server_key.py) in its environment, where
        the servers the service starts and every call to them take it from."""
        box = [ensure_server_key() if self.driver else None]
        dist.broadcast_object_list(box, src=0)
        os.environ[SERVER_KEY_ENV] = box[0]

    def _server_urls(self) -> list[str]:
        """Every SGLang server's own URL (not the router's), on every rank; none for the local engine."""
        if self.cfg.rollout.engine == "local":
            return []
        box = [self.service.server_urls if self.driver else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _weight_syncer(self):
        if self.cfg.rollout.engine == "local":
            return None  # the local engine samples from the live policy
        from megatron_dapo.weight_sync import make_weight_syncer

        r = self.cfg.rollout
        # The servers reach trainer rank 0 (the distributed route's broadcasts) where the trainers rendezvous;
        # colocated servers get the tensor route's weights from the first trainer rank on their node.
        return make_weight_syncer(r.weight_sync, self.server_urls, self.spec, self.cfg.parallel, self.hf_config,
                                  bucket_mb=r.weight_sync_bucket_mb, work_dir=self.output_dir / "weights",
                                  master_address=self.runtime.env.master_addr, timeout_s=r.weight_sync_timeout_s,
                                  server_nodes=r.server_nodes, node=self.runtime.env.node)

    def _check_server_logprobs(self) -> None:
        """Every rank: servers given by URL must return the log-probs the trainer computes, those of
        softmax(logits / rollout.temperature) (rollout/logprob_check.py); a ConfigError on every rank if not."""
        from megatron_dapo.policy.forward import logprob_recomputer
        from megatron_dapo.rollout.logprob_check import check_engine_logprobs
        from megatron_dapo.rollout.sglang_engine import SGLangEngine

        recompute = logprob_recomputer(self.policy.module, vocab_size=self.spec.vocab_size,
                                       max_positions=self.spec.max_position_embeddings,
                                       max_tokens_per_micro_batch=self.cfg.model.max_tokens_per_micro_batch,
                                       device=self.runtime.device)
        engine = SGLangEngine(list(self.cfg.rollout.server_urls), max_server_restarts=0) if self.driver else None
        try:
            a = check_engine_logprobs(engine, recompute, temperature=self.cfg.rollout.temperature)
        finally:
            if engine is not None:
                engine.close()
        if self.driver:
            log.info("rollout.server_urls: log-probs match the policy's at temperature %g (mean |diff| %.2g over %d "
                     "tokens; %.2g at temperature 1)", a.temperature, a.diff_tempered, a.tokens, a.diff_untempered)

    # -- the rollout ---------------------------------------------------------------------------------

    def _await_service(self, word: str, jobs: int = 1) -> list:
        """Every rank: until the driver's rollout service has done its `jobs` oldest jobs (then the driver says
        `word` and has their results; [] elsewhere); a server restarted meanwhile gets the weights: from every
        rank, or with the disk route from the folder the others serve."""
        if not self.driver:
            while self.signal.wait() == RESYNC:
                self.sync_weights(live=True)
            return []
        results = []
        for _ in range(jobs):
            while self.service.wait() == RESYNC:
                self._resync(self.service.restarted)
                self.service.resynced()
            results.append(self.service.take())
        self.signal.post(word)
        return results

    def _resync(self, url: str) -> None:
        """Driver: the weights onto the restarted server at `url`."""
        from megatron_dapo.weight_sync.disk import DiskSyncer
        from megatron_dapo.weight_sync.server_calls import call_all

        if not isinstance(self.syncer, DiskSyncer):
            self.signal.post(RESYNC)
            self.sync_weights(live=True)
        elif self.syncer.loaded is not None:
            call_all([url], "/update_weights_from_disk", {"model_path": str(self.syncer.loaded),
                                                         "weight_version": str(self.step_index)},
                     self.cfg.rollout.weight_sync_timeout_s)

    def _share(self) -> tuple[PackedShare, dict[str, float]]:
        """Every rank: its data-parallel share of this step's kept batch (share_scatter.py), and the driver
        the batch's sampling metrics ({} elsewhere). Sampled now, unless sampled ahead."""
        if self.driver and not self.ready and not self.service.pending:
            self.service.start_batch(self.step_index)
        self.ready += self._await_service("batch", jobs=0 if self.ready else 1)
        if not self.driver:
            return self.scatter.receive(), {}
        batch = self.ready.pop(0)
        if batch.step != self.step_index:
            raise RuntimeError(f"the rollout service handed the batch of step {batch.step + 1} to step "
                               f"{self.step_index + 1}")
        self.batch_prompts = batch.prompts
        shares = deal_by_tokens(batch.items, self.dp_size, self.cfg.train.updates_per_step)
        metrics = {**batch.metrics, "rollout_buffer": float(len(self.ready) + len(self.service.pending))}
        return self.scatter.send([PackedShare.pack(share) for share in shares]), metrics

    def _sample_ahead(self) -> None:
        """Driver, once this step's batch is taken: queue the batches of the steps ahead that the weights of
        this step may start (one_step_off: the next; async: rollout.max_staleness ahead)."""
        r = self.cfg.rollout
        ahead = {"sync": 0, "one_step_off": 1, "async": r.max_staleness}[r.mode]
        queued = self.step_index + 1 + len(self.ready) + len(self.service.pending)
        for step in range(queued, min(self.step_index + ahead, self.cfg.train.steps - 1) + 1):
            self.service.start_batch(step)

    def _drain(self, word: str) -> None:
        """Every rank: until the service has sampled every batch queued (the driver keeps them)."""
        self.ready += self._await_service(word, jobs=len(self.service.pending) if self.driver else 0)

    # -- the step ------------------------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        """One DAPO step; returns its metrics (complete on the driver)."""
        timer = StepTimer(lambda name: self._doing(f"step {self.step_index + 1}: {name}"))
        start = time.perf_counter()
        with timer("rollout"):
            share, metrics = self._share()
        if self.driver:
            self._sample_ahead()
        if self.server_memory is not None:  # colocated: the servers' memory is the trainer's until the sync
            with timer("release"):
                self.server_memory.release()
        train_metrics = {}
        if len(share):
            loss = self.cfg.loss
            with timer("old_logprob"):  # loss.old_logprobs "rollout": the engine's, nothing recomputed
                samples, sums, abs_max = training_samples(
                    self.policy.module.eval(), self.reference, share, spec=self.spec,
                    max_tokens_per_micro_batch=self.cfg.model.max_tokens_per_micro_batch, device=self.runtime.device,
                    tis_cap=loss.tis_cap, tis_mode=loss.tis_mode, temperature=self.cfg.rollout.temperature,
                    old_logprobs=loss.old_logprobs)
                self.policy.module.train()
            with timer("train"):
                self.policy.begin_rollout_step(self.step_index)  # the LR warmup counts rollout steps
                results = [self.policy.step(update) for update in self._updates(samples, share)]
            train_metrics = self._train_metrics(results, sums, abs_max)
            self._check_numerics(results)
        applied = not train_metrics or train_metrics["updates_skipped"] < train_metrics["updates"]
        if self.server_memory is not None:
            with timer("resume"):
                self.server_memory.resume_weights()
        self.step_index += 1  # the new weights are this step's: the servers get them under its number
        live = self.cfg.rollout.mode == "async"  # pushed while the servers sample
        if self.cfg.rollout.mode == "one_step_off" and self.step_index < self.cfg.train.steps:
            with timer("rollout_wait"):  # the servers finish the next batch before they take the new weights
                self._drain("sampled")
        # Colocated servers released their weights for the trainer: they get them back even when nothing changed.
        if applied or self.server_memory is not None:
            with timer("sync"):
                self.sync_weights(live=live)
        if self.server_memory is not None:
            with timer("resume"):
                self.server_memory.resume_caches()
        step_s = time.perf_counter() - start
        metrics.update(train_metrics, tokens_per_s=metrics.get("batch_tokens", 0.0) / step_s, **{"time/step": step_s},
                       **{f"time/{k}": v for k, v in timer.seconds.items()})
        return metrics

    def _doing(self, what: str, within_s: float | None = None, key: str | None = None) -> None:
        """What this rank's main thread does now, for its heartbeat (named if it gets stuck there); `within_s`:
        the deadline it must be done in (config `key`)."""
        self.heartbeat.set_doing(what, within_s, key)

    def _updates(self, samples: list, share: PackedShare) -> list[list]:
        """This rank's samples cut into the step's updates (rank_shares.deal_by_tokens); fewer than
        train.updates_per_step when the batch has fewer responses per rank, which is said once."""
        sizes = share.update_sizes.tolist()
        wanted = self.cfg.train.updates_per_step
        if len(sizes) < wanted and not self.warned_fewer_updates:
            self.warned_fewer_updates = True
            log.warning("step %d: %d responses per data-parallel rank, fewer than train.updates_per_step = %d: %d "
                        "updates this step (said once); a batch that small trains on little", self.step_index + 1,
                        len(sizes), wanted, len(sizes))
        bounds = [0, *itertools.accumulate(sizes)]
        return [samples[a:b] for a, b in zip(bounds, bounds[1:])]

    def _check_numerics(self, results) -> None:
        """Every rank (the results agree): an update whose loss or gradients were not finite was skipped; a
        step with one is logged with its batch, and train.max_bad_steps such steps in a row end the run."""
        skipped = [j for j, r in enumerate(results) if not r.applied]
        if not skipped:
            self.bad_steps = 0
            return
        self.bad_steps += 1
        if self.driver:
            log.warning("step %d: update(s) %s of %d skipped: the loss or a gradient was not finite (loss %s); "
                        "%s; the batch's prompts (dataset rows): %s", self.step_index + 1, skipped, len(results),
                        [results[j].loss for j in skipped],
                        "nothing was applied, the servers keep their weights" if len(skipped) == len(results)
                        else "the other updates were applied", self.batch_prompts)
        if self.bad_steps >= self.cfg.train.max_bad_steps:
            raise RuntimeError(f"{self.bad_steps} steps in a row had updates with a non-finite loss or gradient "
                               f"(train.max_bad_steps = {self.cfg.train.max_bad_steps}); the last good weights are "
                               f"the servers' and the latest checkpoint's. Look at the batches logged above, lower "
                               "optim.lr, or raise train.max_bad_steps")

    def _train_metrics(self, results, sums, abs_max) -> dict[str, float]:
        stats = {k: sum(r.stats[k] for r in results) for k in STAT_NAMES if k != "ratio_max"}
        loss_tokens = max(stats["num_tokens"], 1.0)
        out = {
            "loss": sum(r.loss * r.stats["num_tokens"] for r in results) / loss_tokens,
            "grad_norm": max((r.grad_norm for r in results if r.applied), default=math.nan),
            "lr": results[-1].lr,
            "clip_frac/low": stats["clipped_low"] / loss_tokens,
            "clip_frac/high": stats["clipped_high"] / loss_tokens,
            "clip_frac/dual": stats["dual_clipped"] / loss_tokens,
            "ratio_mean": stats["ratio_sum"] / loss_tokens,
            "ratio_max": max(r.stats["ratio_max"] for r in results),
            "approx_kl": stats["k3_kl_sum"] / loss_tokens,
            "loss_tokens": stats["num_tokens"],
            "updates": len(results),
            "updates_skipped": sum(not r.applied for r in results),
        }
        if self.cfg.loss.old_logprobs == "rollout":  # no old policy's pass: the entropy of the updates' forwards
            out["entropy"] = sum(r.entropy_mean * r.stats["num_tokens"] for r in results) / loss_tokens
            return out
        m = reduce_mismatch(sums, abs_max)
        tokens = max(m["tokens"], 1.0)
        out.update({"entropy": m["entropy_sum"] / tokens, "mismatch/kl": m["mismatch_k3_sum"] / tokens,
                    "mismatch/abs_mean": m["mismatch_abs_sum"] / tokens, "mismatch/abs_max": m["abs_max"]})
        if self.cfg.loss.tis_cap is not None:
            out.update({"tis/weight_mean": m["tis_weight_sum"] / tokens, "tis/capped_frac": m["tis_capped"] / tokens})
        return out

    def sync_weights(self, live: bool = False) -> None:
        """Every rank: the policy's weights onto the servers, under the version `step_index`; `live`: into
        servers that may be sampling (their generation paused meanwhile, server_calls.generation_paused)."""
        version = str(self.step_index)
        if self.syncer is None:
            if self.driver:
                self.service.engine.weight_version = version
            return
        from megatron_dapo.weight_sync.server_calls import generation_paused

        paused = (generation_paused(self.server_urls, self.cfg.rollout.weight_sync_timeout_s) if live and self.driver
                  else nullcontext(self.server_urls))
        with paused as up:
            # A server down now is left out: the service restarts it, and the driver then resyncs it (RESYNC).
            result = self.syncer.sync(self.policy.module, version, skip=[u for u in self.server_urls if u not in up])
        if result is not None:
            log.info("weight sync %s: %.3f GB in %.2f s (%.2f GB/s)", version, result.bytes / 1e9, result.seconds,
                     result.gbps)

    # -- evaluation, checkpoints, the run ------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Every rank: avg@k and pass@k on the held-out prompts at the eval section's sampling settings, computed
        by the driver's rollout service while the other ranks wait for it outside collectives; {} on those."""
        self._doing(f"evaluation after step {self.step_index}")
        if self.driver:  # queued behind the batches sampled ahead, which the driver keeps
            self.service.start_eval()
        results = self._await_service("evaluated", jobs=len(self.service.pending) if self.driver else 0)
        if not self.driver:
            return {}
        self.ready += results[:-1]
        return results[-1]

    def save_checkpoint(self) -> None:
        # The data position is the service's between jobs: the batches sampled ahead are taken first, and kept
        # in the checkpoint, so that the resumed run trains on them and draws no prompt twice.
        self._doing(f"waiting for the batches ahead before the checkpoint of step {self.step_index}")
        self._drain("drained")
        extra = {"step": self.step_index, "sampler": self.service.state_dict() if self.driver else None,
                 "config": self.cfg.to_dict()}
        box = [extra]
        dist.broadcast_object_list(box, src=0)  # the driver's data position goes in
        buffer = {"rollout_buffer": [b.state_dict() for b in self.ready]} if self.ready else None
        self._doing(f"writing the checkpoint of step {self.step_index} in {self.checkpoint_root}",
                    self.cfg.train.checkpoint_timeout_s, "train.checkpoint_timeout_s")
        save_trainer_checkpoint(self.checkpoint_root, self.step_index, self.policy, box[0],
                                keep_last=self.cfg.train.keep_last, driver_state=buffer)
        self._doing(f"done with the checkpoint of step {self.step_index}")

    def train(self) -> dict[str, float]:
        """Run until train.steps; returns the last step's metrics (on the driver)."""
        from tqdm import tqdm

        cfg = self.cfg.train
        metrics: dict[str, float] = {}
        bar = tqdm(total=cfg.steps, initial=self.step_index, desc="dapo", disable=not self.driver)
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
        bar.close()
        return metrics

    def close(self) -> None:
        self.heartbeat.close()
        if self.syncer is not None:
            self.syncer.close()
        if self.driver:
            self.service.close()
            self.metrics.close()
        shutdown_runtime()


def run_training(cfg: DapoConfig) -> int:
    trainer = DapoTrainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return 0
