"""A short supervised warm start in plain transformers: the policy learns the answer format and some
sums from reference solutions, until it gets a target share of validation prompts right when
sampling, so that DAPO starts with groups of mixed correctness to learn from."""

from __future__ import annotations

import logging
import random

import torch

log = logging.getLogger(__name__)


def _batch(pairs: list[tuple[list[int], list[int]]], pad: int):
    length = max(len(p) + len(r) for p, r in pairs)
    ids = torch.full((len(pairs), length), pad, dtype=torch.long)
    labels = torch.full((len(pairs), length), -100, dtype=torch.long)  # loss on response tokens only
    attention = torch.zeros(len(pairs), length, dtype=torch.long)
    for row, (p, r) in enumerate(pairs):
        seq = p + r
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(p): len(seq)] = torch.tensor(r)
        attention[row, : len(seq)] = 1
    return ids, labels, attention


@torch.no_grad()
def sampled_accuracy(model, pairs: list[tuple[list[int], list[int]]], pad: int, max_new_tokens: int) -> float:
    """Share of prompts whose one sample at temperature 1 is exactly the reference response."""
    model.eval()
    length = max(len(p) for p, _ in pairs)
    ids = torch.tensor([[pad] * (length - len(p)) + p for p, _ in pairs])  # left-padded for generate
    attention = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p, _ in pairs])
    out = model.generate(input_ids=ids, attention_mask=attention, do_sample=True, temperature=1.0, top_k=0,
                         max_new_tokens=max_new_tokens, pad_token_id=pad)
    right = sum(row[length: length + len(r)].tolist() == r for row, (_, r) in zip(out, pairs))
    model.train()
    return right / len(pairs)


def supervised_warm_start(model_dir, out_dir, pairs: list[tuple[list[int], list[int]]], *, target_accuracy: float,
                          max_steps: int, check_every: int = 50, batch_size: int = 64, lr: float = 1e-3,
                          seed: int = 0) -> tuple[int, float]:
    """Fine-tune on (prompt ids, response ids) pairs until the sampled accuracy on held-back pairs reaches
    target_accuracy (checked every check_every steps) or max_steps; save the model and its tokenizer to
    out_dir. Returns (steps taken, sampled accuracy reached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    train, check = pairs[256:], pairs[:256]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad = model.config.pad_token_id
    accuracy, step = 0.0, 0
    while step < max_steps and accuracy < target_accuracy:
        for _ in range(check_every):
            ids, labels, attention = _batch(rng.sample(train, batch_size), pad)
            for group in opt.param_groups:  # linear warmup over the first 20 steps
                group["lr"] = lr * min(1.0, (step + 1) / 20)
            loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
        accuracy = sampled_accuracy(model, check, pad, max(len(r) for _, r in check))
        log.info("warm start: step %d, loss %.3f, sampled accuracy %.1f %%", step, loss.item(), 100 * accuracy)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return step, accuracy
