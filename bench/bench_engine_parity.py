"""Where the engine's log-probs part from the trainer's, in fp32 on this CPU: a real SGLang server (deterministic
inference, our CPU batch-invariant shim) samples responses, and the same tokens' log-probs are compared four ways:

- the engine's decode: the log-prob each token got as it was sampled (one token per forward, against the cache);
- the engine's prefill: the same prompt + response sent back as a prompt, its log-probs in one forward
  (`input_token_logprobs`), as the trainer computes them;
- the trainer: the Megatron policy's old-log-prob recompute (megatron-core, TP 1, fp32);
- transformers: the Hugging Face model's forward in fp32, the plain reference.

Each pair's largest and mean |difference| and the share of tokens bitwise equal say which step parts them: the
decode against the prefill is the engine's own kernels (a row of a small matrix, attention against a cache), the
prefill against the trainer or transformers is the model's ops (norms, rotary, attention, the fused MLP, the
log-softmax).

    python bench/bench_engine_parity.py [--prompts 8] [--samples 4] [--max-new-tokens 48] [--no-deterministic]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from megatron_dapo.demo.tiny_model import make_tiny_model
from megatron_dapo.rollout.sglang_server import SGLangServer, SGLangServerConfig, post_json

PROMPTS = ["The capital of France is", "1 + 1 =", "def fibonacci(n):", "Once upon a time", "The quick brown fox",
           "import torch", "In the beginning", "Water boils at"]


def engine_samples(url: str, prompts: list[list[int]], samples: int, max_new_tokens: int) -> list[tuple]:
    """(prompt, output ids, decode log-probs) per sample, at temperature 1."""
    out = []
    for prompt in prompts:
        answers = post_json(f"{url}/generate", {
            "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"n": samples, "max_new_tokens": max_new_tokens, "temperature": 1.0,
                                "ignore_eos": True}}, 300)
        for a in answers if samples > 1 else [answers]:
            out.append((prompt, a["output_ids"], [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]))
    return out


def engine_prefill(url: str, prompt: list[int], output: list[int]) -> list[float]:
    """The engine's log-probs of `output` after `prompt` in one forward over both (a prompt of its own)."""
    answer = post_json(f"{url}/generate", {
        "input_ids": prompt + output, "return_logprob": True, "logprob_start_len": len(prompt) - 1,
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}}, 300)
    got = [lp for lp, _, _ in answer["meta_info"]["input_token_logprobs"]]
    return got[-len(output):]


def transformers_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


# The points compared op by op: (name, transformers' module under model.model, megatron-core's under the GPTModel)
OPS = [("embedding", "embed_tokens", "embedding")]
for _i in range(2):
    OPS += [(f"layer {_i} input norm", f"layers.{_i}.input_layernorm", f"decoder.layers.{_i}.input_layernorm"),
            (f"layer {_i} attention", f"layers.{_i}.self_attn", f"decoder.layers.{_i}.self_attention"),
            (f"layer {_i} MLP norm", f"layers.{_i}.post_attention_layernorm", f"decoder.layers.{_i}.pre_mlp_layernorm"),
            (f"layer {_i} MLP", f"layers.{_i}.mlp", f"decoder.layers.{_i}.mlp"),
            (f"layer {_i} output", f"layers.{_i}", f"decoder.layers.{_i}")]
OPS += [("final norm", "norm", "decoder.final_layernorm")]


def capture(model, names: list[str], batch_first: bool) -> dict[str, torch.Tensor]:
    """Forward hooks keeping each named module's output as [tokens, features] (megatron-core's are [s, b, h])."""
    store, modules = {}, dict(model.named_modules())

    def hook(name):
        def keep(module, args, output):
            out = (output[0] if isinstance(output, tuple) else output).detach()
            store[name] = (out[0] if batch_first else out[:, 0]).clone()
        return keep

    for name in names:
        modules[name].register_forward_hook(hook(name))
    return store


def trainer_logprobs(model_dir: Path, responses: list[tuple], hf) -> tuple[list[list[float]], list[str]]:
    """The trainer's old-log-prob recompute at TP 1 in fp32 (a world of one), and the op-by-op table of its first
    response against transformers' forward (`hf`)."""
    from megatron_dapo.checkpoint.hf_weights import load_hf_weights
    from megatron_dapo.checkpoint.policy_from_hf import open_hf_checkpoint
    from megatron_dapo.config import ModelConfig, ParallelConfig
    from megatron_dapo.parallel.runtime import free_port, init_runtime, shutdown_runtime
    from megatron_dapo.policy.forward import logprob_recomputer
    from megatron_dapo.policy.model import build_model

    parallel = ParallelConfig(device="cpu")
    runtime = init_runtime(parallel, environ={"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": str(free_port())})
    try:
        checkpoint, spec = open_hf_checkpoint(ModelConfig(path=str(model_dir), dtype="float32"))
        model = build_model(spec, parallel, pre_process=True, post_process=True, params_dtype=torch.float32)
        load_hf_weights(model, checkpoint.get, spec, parallel)
        recompute = logprob_recomputer(model, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                                       max_tokens_per_micro_batch=4096, device=runtime.device)
        logprobs = recompute([(p, o, None) for p, o, _ in responses], 1.0)
        # op by op, on the first response alone: the same forward on both sides
        prompt, output, _ = responses[0]
        ours = capture(model, [m for _, _, m in OPS] + ["output_layer"], batch_first=False)
        theirs = capture(hf.model, [h for _, h, _ in OPS], batch_first=True)
        recompute([(prompt, output, None)], 1.0)
        with torch.no_grad():
            their_logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
        rows = [diff_row(name, ours[m], theirs[h]) for name, h, m in OPS]
        # the output layer runs on the response's positions only (padded vocabulary columns left out)
        rows.append(diff_row("logits (response positions)", ours["output_layer"][:, :spec.vocab_size],
                             their_logits))
        rows.append(diff_row("log-prob of the sampled token", torch.tensor(recompute([(prompt, output, None)],
                                                                                     1.0)[0]),
                             torch.tensor(transformers_logprobs(hf, prompt, output))))
        return logprobs, rows
    finally:
        shutdown_runtime()


def diff_row(name: str, a: torch.Tensor, b: torch.Tensor) -> str:
    a, b = a.double(), b.double()
    return f"| {name} | {(a - b).abs().max().item():.3g} | {100 * (a == b).float().mean().item():.1f}% |"


def compare(name: str, a: list[list[float]], b: list[list[float]]) -> str:
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    equal = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return (f"| {name} | {len(diffs)} | {max(diffs):.3g} | {sum(diffs) / len(diffs):.3g} | "
            f"{100 * equal / len(diffs):.1f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--no-deterministic", action="store_true", help="without --enable-deterministic-inference")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        tokenizer = make_tiny_model(model_dir, PROMPTS * 20, seed=0, hidden=64, layers=2,
                                    max_positions=args.max_new_tokens + 32)
        prompts = [tokenizer.encode(p) for p in itertools.islice(itertools.cycle(PROMPTS), args.prompts)]
        extra = [] if args.no_deterministic else ["--enable-deterministic-inference"]
        config = SGLangServerConfig(str(model_dir), device="cpu", dtype="float32", max_total_tokens=8192,
                                    startup_timeout_s=600, extra_args=extra)
        with SGLangServer(config, Path(tmp) / "server.log") as server:
            responses = engine_samples(server.url, prompts, args.samples, args.max_new_tokens)
            prefill = [engine_prefill(server.url, p, o) for p, o, _ in responses]
        decode = [lp for _, _, lp in responses]
        hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
        transformers = [transformers_logprobs(hf, p, o) for p, o, _ in responses]
        trainer, ops = trainer_logprobs(model_dir, responses, hf)
    mode = "off" if args.no_deterministic else "on"
    print(f"\nfp32, a tiny random Qwen2 (hidden 64, 2 layers), {len(responses)} responses of {args.max_new_tokens} "
          f"tokens, temperature 1; SGLang deterministic inference {mode}")
    print("| pair | tokens | max abs diff | mean abs diff | bitwise equal |")
    print("|---|---|---|---|---|")
    for name, a, b in (("engine decode vs engine prefill", decode, prefill),
                       ("engine prefill vs trainer", prefill, trainer),
                       ("engine decode vs trainer", decode, trainer),
                       ("trainer vs transformers", trainer, transformers),
                       ("engine prefill vs transformers", prefill, transformers)):
        print(compare(name, a, b))
    print("\nthe trainer against transformers op by op, on the first response's forward (prompt and response)")
    print("| output of | max abs diff | bitwise equal |")
    print("|---|---|---|")
    print("\n".join(ops))

if __name__ == "__main__":
    main()
