"""The rollout service: training prompts -> engine -> math-verify -> advantages and dynamic sampling -> the
kept batch of a step, ready to deal out; and held-out evaluation.

Jobs (a step's batch, an evaluation) run one after another in the order queued: `start_batch` /
`start_eval`, then `wait` until the oldest is done (READY) and `take` its result. `wait` returns RESYNC when
a server restarted mid-job needs the trainer's weights (`restarted` names it): the driver's main thread,
which keeps every collective to itself, syncs them with every rank and calls `resynced`. With SGLang
servers the service runs in a process of its own (rollout_service_process.py), its jobs on a thread there
(JobRunner), which is what lets the overlapping rollout modes sample the next steps' batches while this
one trains. The in-process engine samples with the live policy, inline on the driver's main thread (no
server to restart; the device-faithful checks are per thread).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_dapo.data.prompt_file import drop_duplicate_rows, load_prompt_rows
from megatron_dapo.data.prompt_sampler import PromptSampler
from megatron_dapo.data.prompt_source import PromptSource
from megatron_dapo.parallel.rank_shares import PackedShare
from megatron_dapo.reward import RewardPool
from megatron_dapo.rollout.engine import SamplingParams, sample_seed
from megatron_dapo.run_config import DapoConfig
from megatron_dapo.samples import PromptItem, TrainItem, version_number
from megatron_dapo.service.dynamic_sampler import DynamicSampler
from megatron_dapo.service.evaluation import eval_params, evaluate

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
        self.reward_pool = RewardPool(cfg.reward)  # its workers start (import math-verify) while the rest loads
        try:
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
            self.params = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                         max_new_tokens=cfg.algorithm.max_response_len)
            self.dynamic_sampler = DynamicSampler(engine, self._score_groups, self.prompts.next_items, cfg.algorithm,
                                                  self.params, dp_size=dp_size,
                                                  score_as_completed=cfg.rollout.engine == "sglang")
            self.jobs = JobRunner(threaded=cfg.rollout.engine == "sglang")
            # Setup's, not the first step's: seconds of worker start-up, and a worker that cannot start is named now.
            self.reward_pool.wait_until_ready()
        except BaseException:  # a bad prompt file, tokenizer or worker: the workers started above are stopped
            self.reward_pool.close()
            raise

    @classmethod
    def in_process(cls, cfg: DapoConfig, policy, device, dp_size: int) -> RolloutService:
        """Over the in-process engine, which samples with the live `policy` (checkpoint.policy_from_hf.Policy)."""
        from megatron_dapo.rollout.local_engine import LocalEngine, hf_eos_token_ids

        engine = LocalEngine(policy.module, vocab_size=policy.spec.vocab_size,
                             max_positions=policy.spec.max_position_embeddings,
                             eos_token_ids=hf_eos_token_ids(policy.hf_config), device=device, seed=cfg.parallel.seed,
                             weight_version="0", record_routes=cfg.rollout.routing_replay)
        return cls(cfg, engine, dp_size)

    # -- jobs ---------------------------------------------------------------------------------------

    def start_batch(self, step: int) -> None:
        """Queue the sampling of the kept batch of rollout step `step` (seeded by the run's seed and the step, so
        that a resumed run samples what the uninterrupted one did)."""
        self.jobs.start("batch", lambda: self._collect(step))

    def start_eval(self) -> None:
        """Queue an evaluation on the held-out prompts: take() then gives eval/avg@k and eval/pass@k ({} without)."""
        self.jobs.start("eval", self._evaluate)

    def wait(self, timeout: float | None = None) -> str | None:
        return self.jobs.wait(timeout)

    @property
    def restarted(self) -> str | None:
        return self.jobs.restarted

    @property
    def pending(self) -> list[str]:
        return self.jobs.pending

    def resynced(self) -> None:
        self.jobs.resynced()

    def take(self):
        return self.jobs.take()

    # -- what the jobs do ---------------------------------------------------------------------------------

    def _score_groups(self, groups: list[tuple[PromptItem, list]]) -> list[list[bool]]:
        """One call to the reward pool for all these groups (it spreads their answers over its workers)."""
        samples = [s for _, group in groups for s in group]
        texts = self.tokenizer.batch_decode([s.output_ids for s in samples], skip_special_tokens=True)
        truths = [prompt.ground_truth for prompt, group in groups for _ in group]
        correct = iter([v.correct for v in self.reward_pool.score(texts, truths)])
        return [[next(correct) for _ in group] for _, group in groups]

    def _collect(self, step: int) -> ReadyBatch:
        start, idle_s = time.perf_counter(), self.jobs.idle_s
        sampler = self.dynamic_sampler
        sampler.params = dataclasses.replace(self.params, seed=sample_seed(self.cfg.parallel.seed, step))
        if self.cfg.rollout.mode == "async":  # trained at `step` by weights of version `step`
            sampler.min_version = step - self.cfg.rollout.max_staleness
        batch = sampler.collect()
        items = batch.train_items()
        metrics = {**batch.metrics.as_dict(), "prompts_too_long": self.prompts.too_long,
                   "batch_tokens": float(sum(len(it.prompt_ids) + len(it.output_ids) for it in items)),
                   "time/sampling": time.perf_counter() - start, "time/rollout_idle": idle_s}
        # The weights that started each response, and how many versions older they are than those the batch
        # trains (version `step`).
        versions = [version_number(s.weight_version) for g in batch.groups for s in g.samples]
        staleness = [step - v for v in versions]
        if versions:
            metrics.update(weight_version=float(min(versions)), staleness=float(max(staleness)),
                           **{"staleness/mean": sum(staleness) / len(staleness)})
            metrics.update({f"staleness/frac_{k}": c / len(staleness)
                            for k, c in sorted(collections.Counter(staleness).items())})
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
        if self.jobs.pending:
            raise RuntimeError(f"RolloutService.state_dict: jobs {self.jobs.pending} are running or their results "
                               "not taken")
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        self.jobs.close()
        if hasattr(self.engine, "close"):  # servers this run started
            self.engine.close()
        self.reward_pool.close()


class JobRunner:
    """Jobs run one after another in the order started, on a thread of their own (`threaded`) or inline as
    they start; the main thread waits for the oldest in `wait` (and syncs the weights for a server that
    restarted meanwhile), then takes its result."""

    def __init__(self, threaded: bool):
        self.threaded = threaded
        self._jobs: collections.deque[_Job] = collections.deque()  # started, results not taken; oldest first
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()  # for the worker thread
        self._worker: threading.Thread | None = None
        self._running: _Job | None = None
        self._started_at = 0.0  # when the running job started (time.monotonic)
        self._finished_at: float | None = None  # when the worker last ran out of jobs
        self._restarts: queue.SimpleQueue[tuple[str, threading.Event]] = queue.SimpleQueue()
        self._resyncing: threading.Event | None = None
        self.restarted: str | None = None  # the server waiting for the weights, after wait() said RESYNC
        self.idle_s = 0.0  # seconds the worker had no job before the running one started
        self._closed = False

    @property
    def running_s(self) -> float | None:
        """Seconds the running job has run; None when none runs."""
        return None if self._running is None else time.monotonic() - self._started_at

    @property
    def pending(self) -> list[str]:
        """The names of the jobs started and not taken, oldest first."""
        return [job.name for job in self._jobs]

    def start(self, name: str, run: Callable[[], object]) -> None:
        job = _Job(name, run)
        self._jobs.append(job)
        if not self.threaded:
            self._run(job)
            return
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="rollout-jobs", daemon=True)
            self._worker.start()
        self._queue.put(job)

    def wait(self, timeout: float | None = None) -> str | None:
        """Main thread: RESYNC when a restarted server waits for the weights (sync them, then `resynced()`);
        READY once the oldest job is done (take() gives its result), or at once when there is none; None
        when `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._jobs:
            try:
                self.restarted, self._resyncing = self._restarts.get_nowait()
                return RESYNC
            except queue.Empty:
                pass
            # Back at once when the job is done; every 50 ms to look for a restarted server meanwhile.
            if self._jobs[0].done.wait(0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic()))):
                break
            if deadline is not None and time.monotonic() >= deadline:
                return None
        return READY

    def resynced(self) -> None:
        """Main thread: the weights are on the restarted server; its job goes on."""
        self._resyncing.set()
        self._resyncing = self.restarted = None

    def take(self):
        """The oldest job's result; its error, raised, if it failed."""
        if not self._jobs or not self._jobs[0].done.is_set():
            raise RuntimeError("no finished job to take: start one and wait() for READY first")
        job = self._jobs.popleft()
        if job.error is not None:
            raise job.error
        return job.result

    def server_restarted(self, url: str) -> None:
        """An engine thread of the running job: the server at `url` came back without the trainer's weights;
        block until the main thread has put them there (wait() -> RESYNC -> resynced())."""
        if not self.threaded or self._running is None:
            raise RuntimeError("an SGLang server restarted outside a rollout or an evaluation, where no rank "
                               "waits to sync its weights; restart the run (it resumes from its last checkpoint)")
        done = threading.Event()
        self._restarts.put((url, done))
        done.wait()
        if self._closed:
            raise RuntimeError(f"the rollout service closed while the restarted server {url} waited for the weights")

    def close(self) -> None:
        """Release the jobs blocked on a resync that will not come (the driver stops): they fail."""
        self._closed = True
        while True:
            try:
                self._restarts.get_nowait()[1].set()
            except queue.Empty:
                break
        if self._resyncing is not None:
            self._resyncing.set()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            self._run(job)
            if self._queue.empty():
                self._finished_at = time.perf_counter()

    def _run(self, job: _Job) -> None:
        now = time.perf_counter()
        self.idle_s = 0.0 if self._finished_at is None else now - self._finished_at
        self._finished_at = None
        self._started_at = time.monotonic()
        self._running = job
        try:
            job.result = job.run()
        except BaseException as e:  # noqa: BLE001 -- raised by take() on the main thread
            job.error = e
        finally:
            self._running = None
            job.done.set()


@dataclass
class _Job:
    name: str
    run: Callable[[], object]
    result: object = None
    error: BaseException | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
