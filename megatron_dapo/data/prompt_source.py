"""The training prompts, encoded, in the sampler's order: what dynamic sampling draws from.

A prompt longer than data.max_prompt_len is skipped and counted, never cut: cutting from the left
drops the chat template's start, from the right the question's end. Skipping consumes the sampler's
positions like any other draw, so a resumed run skips the same prompts.
"""

from __future__ import annotations

import logging

from megatron_dapo.config import ConfigError
from megatron_dapo.data.prompt_encoding import encode_prompt
from megatron_dapo.data.prompt_file import PromptRow
from megatron_dapo.data.prompt_sampler import PromptSampler
from megatron_dapo.samples import PromptItem

log = logging.getLogger(__name__)


class PromptSource:
    def __init__(self, rows: list[PromptRow], sampler: PromptSampler, tokenizer, *, max_prompt_len: int,
                 chat_template: bool = True, name: str = "data.train_path"):
        self.rows, self.sampler, self.tokenizer = rows, sampler, tokenizer
        self.max_prompt_len, self.chat_template, self.name = max_prompt_len, chat_template, name
        self.too_long = 0  # prompts skipped so far (training and evaluation)

    def encode(self, row: PromptRow) -> list[int] | None:
        """The row's prompt ids, or None (counted) when it is longer than max_prompt_len."""
        ids = encode_prompt(self.tokenizer, row.prompt, raw_prompt=not self.chat_template)
        if len(ids) <= self.max_prompt_len:
            return ids
        if not self.too_long:
            log.warning("a prompt of %d tokens is longer than data.max_prompt_len = %d: such prompts are skipped and "
                        "counted (metric prompts_too_long); raise data.max_prompt_len to train on them", len(ids),
                        self.max_prompt_len)
        self.too_long += 1
        return None

    def next_items(self, k: int) -> list[PromptItem]:
        """The next k prompts that fit."""
        items, skipped_in_a_row = [], 0
        while len(items) < k:
            for i in self.sampler.next_indices(k - len(items)):
                ids = self.encode(self.rows[i])
                if ids is not None:
                    items.append(PromptItem(i, ids, self.rows[i].ground_truth))
                    skipped_in_a_row = 0
                    continue
                skipped_in_a_row += 1
                if skipped_in_a_row > len(self.rows):
                    raise ConfigError(f"data.max_prompt_len: every prompt of {self.name} is longer than "
                                      f"{self.max_prompt_len} tokens; raise it")
        return items
