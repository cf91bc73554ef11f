"""An Engine that samples from the live Megatron policy in-process: no server, no weight sync.

It runs the very GPTModel the trainer updates, so samples always come from the current weights;
`weight_version` is whatever the trainer last set (the step). Meant for the embedded CPU demo and
for debugging, at tensor = pipeline parallel = 1 (larger layouts sample through SGLang).

All prompts x n rows are decoded together with megatron-core's static KV cache
(StaticInferenceContext). Rows are left-aligned, so token i of every row sits at rotary position i
and the causal mask is all the masking needed: the cache is filled up to the shortest prompt, then
one position per step for every row, a row taking its own prompt token where it still has one and
a sampled token after. Finished rows are dropped from the batch (and the cache) as they pile up.
Whole groups share one cache up to max_batch_tokens cache positions (rows x (longest prompt +
max_new_tokens)); more prompts are decoded batch after batch. A decode step's cost is mostly fixed (a
forward of the whole model per position) while rows are nearly free at small sizes, so the budget is
in positions: a demo-sized batch decodes in one pass, a long-context one stays within memory.
Samples are drawn from the engine's own torch.Generator, seeded once: the same seed and the same
requests give the same samples.

Log-probs: each sampled token's log_softmax(logits / temperature) over the true vocabulary, taken
before the top_p cut: what SGLang returns by default, and what policy.forward.response_logprobs
recomputes at the run's rollout.temperature (training refuses rollout.top_p < 1, where the sampled
distribution is the renormalised nucleus instead). Greedy decoding (temperature below 1e-6) returns
the argmax's log_softmax(logits), the temperature-1 log-prob, as SGLang does. Each Sample also carries the
sum of the entropies of those distributions over its tokens (Sample.entropy_sum): the policy's entropy on
every token generated, kept or dropped, which SGLang does not return.

Routes (a mixture of experts, `record_routes`): the experts each router chose for every position the engine ran
through the model, prompt and output but for the last sampled token (never run), returned with each Sample as
SGLang's return_routed_experts returns them; the routers choose by themselves while the engine decodes, whatever
routing replay set them to in training.

Stopping follows SGLang: a token in stop_token_ids or the model's EOS ids ends a row with "stop"
(the token is kept, with its log-prob); ignore_eos turns off both; max_new_tokens, or the model's
max_position_embeddings, ends it with "length". A temperature below 1e-6 decodes greedily.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_dapo.config import ConfigError
from megatron_dapo.rollout.engine import Sample, SamplingParams
from megatron_dapo.samples import route_dtype

GREEDY_TEMPERATURE = 1e-6  # below it, argmax (as SGLang does)
COMPACT_FRACTION = 0.25  # drop finished rows once they are this share of the batch


def hf_eos_token_ids(hf_config: dict) -> list[int]:
    """The EOS ids of a Hugging Face config.json (`eos_token_id`: an int or a list)."""
    eos = hf_config.get("eos_token_id")
    if eos is None:
        raise ConfigError("eos_token_id: missing from the model's config.json; set it, or the local engine cannot "
                          "tell where a response ends")
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A token per row of fp32 logits [rows, vocab], its log-prob as SGLang returns it by default:
    log_softmax(logits / temperature), before the top_p cut, and that distribution's entropy. Greedy (temperature
    below 1e-6): the argmax, and log_softmax(logits) and its entropy."""
    if params.temperature < GREEDY_TEMPERATURE:
        token = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(dim=-1)
    else:
        scaled = logits / params.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        probs = torch.softmax(scaled, dim=-1)
        entropy = -(probs * logp).sum(dim=-1)  # before the top_p cut, like the log-probs
        if params.top_p < 1:
            # Keep the most likely tokens until their mass reaches top_p (SGLang's rule).
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            cut = (sorted_probs.cumsum(dim=-1) - sorted_probs) > params.top_p
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(cut, 0.0))
        # An exponential race, argmax p / E with E ~ Exp(1), draws from p; cheaper than multinomial. E is
        # kept off 0 so a token of probability 0 can never win.
        race = torch.empty_like(probs).exponential_(generator=generator).clamp_(min=torch.finfo(probs.dtype).tiny)
        token = (probs / race).argmax(dim=-1)
    return token, logp.gather(1, token[:, None]).squeeze(1), entropy


class LocalEngine:
    """Engine over an in-process policy stage (a GPTModel, or it wrapped in megatron's DDP)."""

    def __init__(self, model: torch.nn.Module, *, vocab_size: int, max_positions: int,
                 eos_token_ids: Sequence[int], device: torch.device, seed: int = 0, max_batch_tokens: int = 2**16,
                 weight_version: str = "0", record_routes: bool = False,
                 decode: Callable[[list[int]], str] | None = None):
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        cp = parallel_state.get_context_parallel_world_size()
        if tp != 1 or pp != 1 or cp != 1:
            raise ConfigError(f"rollout.engine: 'local' samples in-process and needs tensor_parallel = "
                              f"pipeline_parallel = context_parallel = 1, the policy has TP={tp} x PP={pp} x CP={cp}; "
                              "use rollout.engine: 'sglang' for a parallel policy")
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens: must be >= 1, got {max_batch_tokens}")
        self.model = model
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        self.device = device
        self.max_batch_tokens = max_batch_tokens
        self.weight_version = weight_version  # the trainer sets it after each step
        self.generator = torch.Generator(device=device).manual_seed(seed)
        from megatron_dapo.policy.routing_replay import routers_of

        self.routers = routers_of(model)
        if record_routes and not self.routers:
            raise ConfigError("rollout.routing_replay: the policy has no router to record (a dense model); set "
                              "rollout.routing_replay to false")
        self.record_routes = record_routes
        self.decode = decode  # token ids -> text (the tokenizer's), for SamplingParams.stop

    def healthy(self) -> bool:
        return True  # nothing out of process that could have died

    def stream(self, prompts: list[list[int]], n: int, params: SamplingParams) -> LocalGroupStream:
        self._check(prompts, n)
        if params.stop and self.decode is None:
            raise ValueError("SamplingParams.stop: this LocalEngine was built without `decode` (the tokenizer's), "
                             "which stop strings are matched in")
        if params.seed is not None:  # the same call with the same seed draws the same samples
            self.generator.manual_seed(params.seed & (2**63 - 1))
        return LocalGroupStream(self, prompts, n, params, self.weight_version)

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Sample]]:
        groups = {group[0].prompt_index: group for group in self.stream(prompts, n, params)}
        return [groups[i] for i in range(len(prompts))]

    def _check(self, prompts: list[list[int]], n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n: the group size must be a whole number >= 1, got {n!r}")
        for i, p in enumerate(prompts):
            if not 1 <= len(p) < self.max_positions:
                raise ValueError(f"prompts[{i}]: {len(p)} tokens; a prompt needs 1 to {self.max_positions - 1} "
                                 "(the model's max_position_embeddings, less one position to answer in)")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"prompts[{i}]: token ids must be in [0, {self.vocab_size}), got {min(p)}..{max(p)}")

    @contextlib.contextmanager
    def _eval_mode(self):
        """megatron uses the KV cache only in eval mode; the model is back in its own mode whenever the caller
        has control. The routers choose by themselves (a policy trained with routing replay was left replaying)."""
        was_training = self.model.training
        self.model.eval()
        for router in self.routers:
            if router.router_replay is not None:
                router.router_replay.clear_router_replay_action()
        try:
            yield
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def _logits(self, tokens: torch.Tensor, start: int, context) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits [rows, vocab] after feeding tokens [rows, k] at positions start..start+k-1; with
        record_routes, the experts the routers chose for those positions, [rows, k, MoE layers, top_k]."""
        positions = torch.arange(start, start + tokens.shape[1], device=self.device).expand_as(tokens)
        chosen: list[torch.Tensor] = []
        hooks = [r.register_forward_hook(lambda _, __, out: chosen.append(out[1])) for r in self.routers
                 ] if self.record_routes else []
        try:
            logits = self.model(tokens, positions, None, inference_context=context, runtime_gather_output=True)
        finally:
            for h in hooks:
                h.remove()
        context.increment_sequence_len_offset(tokens.shape[1])
        routes = None
        if chosen:  # each router's map [positions x rows, experts], positions outermost -> its top_k expert ids
            k = self.routers[0].topk
            ids = [m.to(torch.int8).topk(k, dim=-1).indices.sort(dim=-1).values for m in chosen]
            routes = torch.stack(ids, dim=1).view(tokens.shape[1], tokens.shape[0], len(chosen), k).transpose(0, 1)
        return logits[:, -1, : self.vocab_size].float(), routes  # columns past the vocabulary are padding

    def _decode(self, prompts: list[list[int]], n: int, params: SamplingParams, should_stop: Callable[[], bool],
                dropped_rows: Callable[[], Iterable[int]] = tuple) -> Iterator[FinishedRow]:
        """Decode n rows per prompt together (row r is sample r % n of prompt r // n); rows as they finish.
        dropped_rows(), asked between decode steps: rows newly cancelled, left out from then on."""
        batch = _DecodeBatch(self, prompts, n, params)
        while not batch.done and not should_stop():
            batch.drop(dropped_rows())
            if batch.done:
                return
            with self._eval_mode():
                finished = batch.advance(should_stop)
            yield from finished


@dataclass(frozen=True)
class FinishedRow:
    row: int
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    routes: np.ndarray | None = None  # Sample.routes
    entropy_sum: float | None = None  # Sample.entropy_sum


class _DecodeBatch:
    """The rows decoded together, their tokens so far and their KV cache."""

    def __init__(self, engine: LocalEngine, prompts: list[list[int]], n: int, params: SamplingParams):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.engine, self.params = engine, params
        dev = engine.device
        self.prompt_len = torch.tensor([len(p) for p in prompts], device=dev).repeat_interleave(n)
        total = min(int(self.prompt_len.max()) + params.max_new_tokens, engine.max_positions)
        padded = torch.zeros(len(prompts), total, dtype=torch.long)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = torch.tensor(p)
        self.tokens = padded.repeat_interleave(n, dim=0).to(dev)  # [rows, total]: prompt left-aligned, then samples
        self.logps = torch.zeros(self.tokens.shape, device=dev)  # at the position of each sampled token
        self.entropies = torch.zeros(self.tokens.shape, device=dev)  # of the distribution it was sampled from
        ends = [] if params.ignore_eos else sorted({*params.stop_token_ids, *engine.eos_token_ids})
        self.stop_ids = torch.tensor(ends, dtype=torch.long, device=dev)
        # A stop string completed by the newest token lies within the text of the last tokens: every token decodes
        # to a character or more, or to a partial one (a byte of a multi-byte character), hence 4 per character.
        self.stop_window = 4 * max(map(len, params.stop), default=0) + 1
        self.last = torch.clamp(self.prompt_len + params.max_new_tokens, max=total) - 1  # last position per row
        self.context = StaticInferenceContext(len(self.tokens), total)
        self.active = torch.arange(len(self.tokens), device=dev)  # the rows in the KV cache, in its order
        self.live = torch.ones(len(self.tokens), dtype=torch.bool, device=dev)  # of those, the unfinished ones
        self.t = int(self.prompt_len.min())  # the position filled next
        self.logits: torch.Tensor | None = None  # next-token logits of the active rows
        self.done = False
        self.routes = None  # [rows, total, MoE layers, top_k]: the experts of each position run (record_routes)
        if engine.record_routes:
            config = engine.routers[0].config
            self.routes = torch.zeros(len(self.tokens), total, sum(config.moe_layer_freq), config.moe_router_topk,
                                      dtype=torch.int16, device=dev)
            self.route_dtype = route_dtype(config.num_moe_experts)

    def _run(self, rows: torch.Tensor, start: int, tokens: torch.Tensor) -> torch.Tensor:
        """The engine's next-token logits for `tokens` of `rows` at positions from `start`, their routes kept."""
        logits, routes = self.engine._logits(tokens, start, self.context)
        if routes is not None:
            self.routes[rows, start:start + tokens.shape[1]] = routes.to(self.routes.dtype)
        return logits

    def drop(self, rows: Iterable[int]) -> None:
        """Leave these rows out (their group was cancelled): no longer live, they never finish, and the next
        compaction takes them out of the batch and its KV cache."""
        rows = sorted(set(rows))
        if not rows:
            return
        self.live &= ~torch.isin(self.active, torch.tensor(rows, dtype=torch.long, device=self.active.device))
        if not bool(self.live.any()):
            self.done = True

    def _stop_texts(self, active: torch.Tensor, candidates: torch.Tensor, t: int) -> torch.Tensor:
        """Which of the active rows' responses the token at `t` completes a stop string in (checked every token, so
        a match in the last tokens' text is a new one)."""
        hits = torch.zeros_like(candidates)
        for i in candidates.nonzero().flatten().tolist():
            r = int(active[i])
            start = max(int(self.prompt_len[r]), t + 1 - self.stop_window)
            text = self.engine.decode(self.tokens[r, start:t + 1].tolist())
            hits[i] = any(stop in text for stop in self.params.stop)
        return hits

    def advance(self, should_stop: Callable[[], bool]) -> list[FinishedRow]:
        """Decode positions until some rows finish, all are done, or should_stop() is true."""
        if self.logits is None:
            self.logits = self._run(self.active, 0, self.tokens[:, : self.t])
        while not should_stop():
            finished = self._step()
            if finished or self.done:
                return finished
        return []

    def _step(self) -> list[FinishedRow]:
        t, active = self.t, self.active
        token, logp, entropy = sample_tokens(self.logits, self.params, self.engine.generator)
        sampled = t >= self.prompt_len[active]  # rows past their prompt; the others take their prompt token
        self.tokens[active, t] = torch.where(sampled, token, self.tokens[active, t])
        self.logps[active, t] = logp
        self.entropies[active, t] = entropy
        stopped = sampled & torch.isin(token, self.stop_ids)
        if self.params.stop:
            stopped |= self._stop_texts(active, sampled & self.live & ~stopped, t)
        done = self.live & (stopped | (sampled & (t == self.last[active])))
        finished = []
        for i in done.nonzero().flatten().tolist():
            r = int(active[i])
            response = slice(int(self.prompt_len[r]), t + 1)
            routes = None if self.routes is None else self.routes[r, :t].cpu().numpy().astype(self.route_dtype)
            finished.append(FinishedRow(r, self.tokens[r, response].tolist(), self.logps[r, response].tolist(),
                                        "stop" if stopped[i] else "length", routes,
                                        float(self.entropies[r, response].sum())))
        self.live &= ~done
        self.t += 1
        if not bool(self.live.any()):
            self.done = True
            return finished
        if int((~self.live).sum()) >= COMPACT_FRACTION * len(active):
            keep = self.live.nonzero().flatten()
            self.active, self.live = active[keep], self.live[keep]
            self.context.key_value_memory_dict = {layer: (k[:, keep], v[:, keep])
                                                  for layer, (k, v) in self.context.key_value_memory_dict.items()}
        self.logits = self._run(self.active, t, self.tokens[self.active, t : t + 1])
        return finished


class LocalGroupStream:
    """Groups from a LocalEngine as their last sample finishes; decoding happens while iterating."""

    def __init__(self, engine: LocalEngine, prompts: list[list[int]], n: int, params: SamplingParams,
                 weight_version: str):
        self.engine, self.prompts, self.n, self.params = engine, prompts, n, params
        self.weight_version = weight_version
        self.aborted = False
        self.cancelled: set[int] = set()  # prompt indices whose groups are not wanted any more

    def abort(self, indices: Iterable[int] | None = None) -> None:
        if indices is None:
            self.aborted = True
        else:
            self.cancelled.update(int(i) for i in indices)

    def __iter__(self) -> Iterator[list[Sample]]:
        # Whole groups per batch of rows, so each group completes inside one batch. A batch takes the next
        # prompts not cancelled when it starts; a group cancelled later has its rows dropped from the batch.
        n = self.n
        positions = min(max(map(len, self.prompts), default=0) + self.params.max_new_tokens, self.engine.max_positions)
        per_batch = max(1, self.engine.max_batch_tokens // (n * positions))
        left = list(range(len(self.prompts)))
        while not self.aborted:
            left = [p for p in left if p not in self.cancelled]
            if not left:
                return
            batch, left = left[:per_batch], left[per_batch:]
            position = {p: k for k, p in enumerate(batch)}
            dropped: set[int] = set()

            def newly_cancelled(position=position, dropped=dropped) -> list[int]:
                new = [p for p in self.cancelled & position.keys() if p not in dropped]
                dropped.update(new)
                return [position[p] * n + j for p in new for j in range(n)]

            pending: dict[int, list[Sample | None]] = {}
            for row in self.engine._decode([self.prompts[p] for p in batch], n, self.params,
                                           lambda: self.aborted, newly_cancelled):
                p = batch[row.row // n]
                if p in self.cancelled:
                    pending.pop(p, None)
                    continue
                group = pending.setdefault(p, [None] * n)
                group[row.row % self.n] = Sample(p, row.output_ids, row.logprobs, row.finish_reason,
                                                 self.weight_version, routes=row.routes,
                                                 entropy_sum=row.entropy_sum)
                if None not in group:
                    if self.aborted:
                        return
                    yield pending.pop(p)
