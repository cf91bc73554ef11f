"""A held-out evaluation split that shares no problem with the training split."""

from __future__ import annotations

import random
from typing import TypeVar

from megatron_dapo.data.prompt_encoding import raw_prompt_text
from megatron_dapo.data.prompt_file import DataError, PromptRow

Row = TypeVar("Row", dict, PromptRow)


def problem_key(row: dict | PromptRow) -> str:
    """What makes two rows the same problem: their prompt text."""
    return raw_prompt_text(row.prompt if isinstance(row, PromptRow) else row["prompt"])


def split_held_out(rows: list[Row], num_eval: int, seed: int) -> tuple[list[Row], list[Row]]:
    """(train, eval): eval holds num_eval distinct problems chosen with `seed`, one row each; train holds every
    row whose problem is not in eval (duplicates included). Both keep the input order."""
    first_row: dict[str, int] = {}
    for i, row in enumerate(rows):
        first_row.setdefault(problem_key(row), i)
    if isinstance(num_eval, bool) or not isinstance(num_eval, int) or not 1 <= num_eval < len(first_row):
        raise DataError(f"split_held_out num_eval: must be a whole number from 1 to {len(first_row) - 1} (the rows "
                        f"hold {len(first_row)} distinct problems and training needs one), got {num_eval!r}")
    keys = list(first_row)
    random.Random(seed).shuffle(keys)
    held_out = set(keys[:num_eval])
    eval_rows = sorted(first_row[k] for k in held_out)
    train = [row for row in rows if problem_key(row) not in held_out]
    return train, [rows[i] for i in eval_rows]
