"""The rollout service: training prompts -> engine -> math-verify -> advantages and dynamic sampling -> the
kept batch of a step, ready to deal out; and held-out evaluation.

One job at a time (a step's batch, an evaluation): `start_batch` / `start_eval`, then `wait` until it
returns READY and `take` the result. `wait` returns RESYNC when a server restarted mid-job needs the
trainer's weights (`restarted` names it): the driver's main thread, which keeps every collective to itself,
syncs them with every rank and calls `resynced`. With SGLang servers the service runs in a process of its
own (rollout_service_process.py), its jobs on a thread there (JobRunner), which is what lets
rollout.mode one_step_off sample the next step's batch while this one trains. The in-process engine
samples with the live policy, inline on the driver's main thread (no server to restart; the
device-faithful checks are per thread).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_dapo.algorithm import DynamicSampler
from megatron_dapo.data.prompt_file import drop_duplicate_rows, load_prompt_rows
from megatron_dapo.data.prompt_sampler import PromptSampler
from megatron_dapo.data.prompt_source import PromptSource
from megatron_dapo.evaluation import eval_params, evaluate
from megatron_dapo.rank_shares import PackedShare
from megatron_dapo.reward import RewardPool
from megatron_dapo.rollout.engine import SamplingParams, sample_seed
from megatron_dapo.run_config import DapoConfig
from megatron_dapo.samples import PromptItem, TrainItem

log = logging.getLogger(__name__)

READY, RESYNC = "ready", "resync"


@dataclass(frozen=True)
class ReadyBatch:
    """A step's kept responses (groups in prompt order), the metrics of their sampling and their dataset rows."""

    step: int  # the rollout step it was sampled for
    items: list[TrainItem]
    metrics: dict[str, float]
    prompts: list[int]

    def state_dict(self) -> dict:
        share = PackedShare.pack([self.items])
        return {"step": self.step, "metrics": self.metrics, "prompts": self.prompts,
                "share": {f.name: getattr(share, f.name) for f in dataclasses.fields(share)}}

    @classmethod
    def from_state_dict(cls, state: dict) -> ReadyBatch:
        return cls(state["step"], PackedShare(**state["share"]).train_items(), state["metrics"], state["prompts"])


class RolloutService:
    def __init__(self, cfg: DapoConfig, engine, dp_size: int):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.engine = engine
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        rows, _ = load_prompt_rows(cfg.data.train_path)  # skipped rows are counted in its warning
        if cfg.data.drop_duplicates:
            total = len(rows)
            rows = drop_duplicate_rows(rows)
            log.info("%s: training on %d unique problems of %d rows (data.drop_duplicates)", cfg.data.train_path,
                     len(rows), total)
        self.eval_rows = load_prompt_rows(cfg.data.eval_path)[0] if cfg.data.eval_path else []
        self.sampler = PromptSampler(len(rows), cfg.data.seed)
        self.prompts = PromptSource(rows, self.sampler, self.tokenizer, max_prompt_len=cfg.data.max_prompt_len,
                                    chat_template=cfg.data.chat_template, name=cfg.data.train_path)
        self.reward_pool = RewardPool(cfg.reward)
        self.params = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                     max_new_tokens=cfg.algorithm.max_response_len)
        self.dynamic_sampler = DynamicSampler(engine, self._score_group, self.prompts.next_items, cfg.algorithm,
                                              self.params, dp_size=dp_size)
        self.jobs = JobRunner(threaded=cfg.rollout.engine == "sglang")

    # -- jobs -----------------------------------------------------------------------------------------

    def start_batch(self, step: int) -> None:
        """Start sampling the kept batch of rollout step `step` (seeded by the run's seed and the step, so
        that a resumed run samples what the uninterrupted one did)."""
        self.dynamic_sampler.params = dataclasses.replace(self.params, seed=sample_seed(self.cfg.parallel.seed, step))
        self.jobs.start("batch", lambda: self._collect(step))

    def start_eval(self) -> None:
        """Start evaluating on the held-out prompts: take() then gives eval/avg@k and eval/pass@k ({} without)."""
        self.jobs.start("eval", self._evaluate)

    def wait(self) -> str:
        return self.jobs.wait()

    @property
    def restarted(self) -> str | None:
        return self.jobs.restarted

    def resynced(self) -> None:
        self.jobs.resynced()

    def take(self):
        return self.jobs.take()

    # -- what the jobs do ---------------------------------------------------------------------------------

    def _score_group(self, prompt: PromptItem, samples) -> list[bool]:
        texts = self.tokenizer.batch_decode([s.output_ids for s in samples], skip_special_tokens=True)
        return [v.correct for v in self.reward_pool.score(texts, [prompt.ground_truth] * len(texts))]

    def _collect(self, step: int) -> ReadyBatch:
        start = time.perf_counter()
        batch = self.dynamic_sampler.collect()
        items = batch.train_items()
        versions = [s.weight_version for g in batch.groups for s in g.samples]
        metrics = {**batch.metrics.as_dict(), "prompts_too_long": self.prompts.too_long,
                   "batch_tokens": float(sum(len(it.prompt_ids) + len(it.output_ids) for it in items)),
                   "time/sampling": time.perf_counter() - start}
        # The oldest weight version (rollout steps the weights had seen) that sampled the batch. Servers name the
        # weights they started with in their own way: those are the run's initial weights, version 0.
        if versions:
            metrics["weight_version"] = float(min(int(v) if v.isdigit() else 0 for v in versions))
        return ReadyBatch(step, items, metrics, sorted(g.prompt.index for g in batch.groups))

    def _evaluate(self) -> dict[str, float]:
        if not self.eval_rows:
            return {}
        e = self.cfg.eval
        encoded = [(r, self.prompts.encode(r)) for r in self.eval_rows[: e.max_prompts]]
        kept = [(r.ground_truth, ids) for r, ids in encoded if ids is not None]
        return evaluate(self.engine, self.reward_pool.score,
                        lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                        [ids for _, ids in kept], [t for t, _ in kept],
                        eval_params(e, self.cfg.algorithm.max_response_len), e.samples_per_prompt)

    # -- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The data position; only between jobs (a running job has drawn prompts it has not settled)."""
        if self.jobs.job is not None:
            raise RuntimeError(f"RolloutService.state_dict: a {self.jobs.job} job is running or its result not taken")
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        if hasattr(self.engine, "close"):  # servers this run started
            self.engine.close()
        self.reward_pool.close()


class JobRunner:
    """One job at a time, on a thread of its own (`threaded`) or inline; the main thread waits for it in `wait`,
    and syncs the weights for a server that restarted during it."""

    def __init__(self, threaded: bool):
        self.threaded = threaded
        self.job: str | None = None  # the running job's name, until its result is taken
        self._result = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._restarts: queue.SimpleQueue[tuple[str, threading.Event]] = queue.SimpleQueue()
        self._resyncing: threading.Event | None = None
        self.restarted: str | None = None  # the server waiting for the weights, after wait() said RESYNC

    def start(self, job: str, run: Callable[[], object]) -> None:
        if self.job is not None:
            raise RuntimeError(f"cannot start a {job} job while a {self.job} job's result is not taken")
        self.job = job
        self._done.clear()
        if self.threaded:
            threading.Thread(target=self._run, args=(run,), name=f"rollout-{job}", daemon=True).start()
        else:
            self._run(run)

    def wait(self) -> str:
        """Main thread: RESYNC when a restarted server waits for the weights (sync them, then `resynced()`);
        READY once the job is done (take() gives its result), or at once when there is none."""
        while self.job is not None:
            try:
                self.restarted, self._resyncing = self._restarts.get(timeout=0.05)
                return RESYNC
            except queue.Empty:
                if self._done.is_set():  # a job waiting for a resync cannot be done
                    break
        return READY

    def resynced(self) -> None:
        """Main thread: the weights are on the restarted server; its job goes on."""
        self._resyncing.set()
        self._resyncing = self.restarted = None

    def take(self):
        """The finished job's result; its error, raised, if it failed."""
        if self.job is None or not self._done.is_set():
            raise RuntimeError("no finished job to take: start one and wait() for READY first")
        result, error = self._result, self._error
        self.job = self._result = self._error = None
        if error is not None:
            raise error
        return result

    def server_restarted(self, url: str) -> None:
        """An engine thread of the running job: the server at `url` came back without the trainer's weights;
        block until the main thread has put them there (wait() -> RESYNC -> resynced())."""
        if not self.threaded or self.job is None or self._done.is_set():
            raise RuntimeError("an SGLang server restarted outside a rollout or an evaluation, where no rank "
                               "waits to sync its weights; restart the run (it resumes from its last checkpoint)")
        done = threading.Event()
        self._restarts.put((url, done))
        done.wait()

    def _run(self, run: Callable[[], object]) -> None:
        try:
            self._result = run()
        except BaseException as e:  # noqa: BLE001 -- raised by take() on the main thread
            self._error = e
        finally:
            self._done.set()
