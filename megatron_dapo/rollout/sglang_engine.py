"""The Engine interface over SGLang's HTTP API (/generate with n samples per prompt)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from megatron_dapo.rollout.engine import Sample, SamplingParams
from megatron_dapo.rollout.sglang_server import health_ok, post_json


class SGLangEngine:
    def __init__(self, url: str, *, max_in_flight: int = 32, request_timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.max_in_flight = max_in_flight
        self.timeout = request_timeout_s

    def healthy(self) -> bool:
        return health_ok(self.url)

    def _payload(self, prompt: list[int], n: int, params: SamplingParams) -> dict:
        sampling = {"n": n, "temperature": params.temperature, "top_p": params.top_p,
                    "max_new_tokens": params.max_new_tokens, "ignore_eos": params.ignore_eos}
        if params.stop_token_ids:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
        return {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}

    def _group(self, index: int, prompt: list[int], n: int, params: SamplingParams) -> list[Sample]:
        out = post_json(f"{self.url}/generate", self._payload(prompt, n, params), self.timeout)
        items = out if isinstance(out, list) else [out]
        if len(items) != n:
            raise RuntimeError(f"SGLang returned {len(items)} samples for prompt {index}, asked for {n}")
        samples = []
        for item in items:
            meta = item["meta_info"]
            ids = list(item["output_ids"])
            logprobs = [float(lp) for lp, _, _ in meta["output_token_logprobs"]]
            if len(logprobs) != len(ids):
                raise RuntimeError(f"SGLang returned {len(logprobs)} log-probs for {len(ids)} tokens")
            samples.append(Sample(index, ids, logprobs, meta["finish_reason"]["type"],
                                  str(meta.get("weight_version", ""))))
        return samples

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Sample]]:
        with ThreadPoolExecutor(max_workers=min(self.max_in_flight, max(1, len(prompts)))) as pool:
            futures = [pool.submit(self._group, i, p, n, params) for i, p in enumerate(prompts)]
            return [f.result() for f in futures]
