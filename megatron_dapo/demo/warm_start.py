"""A short supervised warm start in plain transformers: the policy learns the answer format (and a
little arithmetic) from reference solutions, so that DAPO has groups of mixed correctness to learn from."""

from __future__ import annotations

import random

import torch


def supervised_warm_start(model_dir, out_dir, pairs: list[tuple[list[int], list[int]]], *, steps: int,
                          batch_size: int = 64, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Fine-tune on (prompt ids, response ids) pairs, loss on response tokens only; save the model and
    its tokenizer to out_dir (a Hugging Face folder like model_dir). Returns the loss of every step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))
    pad = model.config.pad_token_id
    losses = []
    for _ in range(steps):
        batch = rng.sample(pairs, batch_size)
        length = max(len(p) + len(r) for p, r in batch)
        ids = torch.full((batch_size, length), pad, dtype=torch.long)
        labels = torch.full((batch_size, length), -100, dtype=torch.long)
        attention = torch.zeros(batch_size, length, dtype=torch.long)
        for row, (p, r) in enumerate(batch):
            seq = p + r
            ids[row, : len(seq)] = torch.tensor(seq)
            labels[row, len(p): len(seq)] = torch.tensor(r)
            attention[row, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        losses.append(loss.item())
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return losses
