"""Prompt files in DAPO-Math-17K's schema, as parquet or JSONL.

One row: `prompt` (chat messages, each {role, content}), `reward_model` ({ground_truth, style}),
`data_source`, `ability`, `extra_info` (e.g. {index}). Reading keeps the fields training needs and
skips, with one warning, the rows that cannot be trained on (no prompt or no ground truth); a file
that cannot be read at all, or that has no usable row, is an error naming the path.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from megatron_dapo.errors import DapoError

log = logging.getLogger(__name__)

FORMATS = (".parquet", ".jsonl")
_SHOWN_SKIPS = 5  # skipped rows named in the warning


class DataError(DapoError, ValueError):
    """Prompt data that cannot be used as given; the message names the file, row or argument."""


@dataclass(frozen=True)
class PromptRow:
    """One trainable prompt: chat messages and the answer the reward checks against."""

    prompt: list[dict]  # chat messages, each with at least "role" and "content"
    ground_truth: str
    data_source: str = ""
    extra_info: dict = field(default_factory=dict)
    row_index: int = 0  # position of the row in its file (JSONL: line number - 1)


def _format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise DataError(f"{path}: unknown prompt file type {suffix or '(no suffix)'!r}; "
                        f"use one of {', '.join(FORMATS)}")
    return suffix


def _messages(prompt) -> list[dict]:
    """The row's chat messages; a plain string is taken as one user message. Raises ValueError with the reason."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError("missing or empty prompt")
    messages = []
    for message in prompt:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError("a prompt message is not {role: str, content: str}")
        # Parquet gives every message every key of the column's struct: drop the ones this message lacks.
        messages.append({k: v for k, v in message.items() if v is not None})
    if not any(m["content"].strip() for m in messages):
        raise ValueError("missing or empty prompt")
    return messages


def _ground_truth(reward_model) -> str:
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if isinstance(truth, (int, float)) and not isinstance(truth, bool):
        truth = str(truth)
    if not isinstance(truth, str) or not truth.strip():
        raise ValueError("missing or empty reward_model.ground_truth")
    return truth


def _prompt_row(record, row_index: int) -> PromptRow:
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    extra_info = record.get("extra_info")
    return PromptRow(prompt=_messages(record.get("prompt")), ground_truth=_ground_truth(record.get("reward_model")),
                     data_source=str(record.get("data_source") or ""),
                     extra_info=extra_info if isinstance(extra_info, dict) else {}, row_index=row_index)


def _parquet_records(path: Path) -> Iterator[tuple[int, object]]:
    """(row index, row as a dict), a record batch at a time so a large file is never all Python objects at once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable parquet file ({exc})") from None
    names = file.schema_arrow.names
    for column in ("prompt", "reward_model"):
        if column not in names:
            raise DataError(f"{path}: no column {column!r} (columns: {names}); a prompt file needs "
                            "'prompt' (chat messages) and 'reward_model' (with 'ground_truth')")
    columns = [c for c in ("prompt", "reward_model", "data_source", "extra_info") if c in names]
    row_index = 0
    try:
        for batch in file.iter_batches(batch_size=4096, columns=columns):
            for record in batch.to_pylist():
                yield row_index, record
                row_index += 1
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: unreadable after row {row_index} ({exc})") from None


def _jsonl_records(path: Path) -> Iterator[tuple[int, object]]:
    """(line index, parsed object, or the exception) for every non-blank line."""
    with path.open("rb") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except ValueError as exc:  # includes undecodable bytes
                yield i, exc


def load_prompt_rows(path) -> tuple[list[PromptRow], int]:
    """Read a parquet or JSONL prompt file: (usable rows in file order, number of rows skipped)."""
    path = Path(path)
    suffix = _format(path)
    if not path.is_file():
        raise DataError(f"{path}: no such prompt file")
    records = _parquet_records(path) if suffix == ".parquet" else _jsonl_records(path)
    rows, skipped, total = [], [], 0
    for row_index, record in records:
        total += 1
        try:
            if isinstance(record, Exception):
                raise ValueError(f"invalid JSON ({record})")
            rows.append(_prompt_row(record, row_index))
        except ValueError as exc:
            skipped.append((row_index, str(exc)))
    if not rows:
        first = f"; row {skipped[0][0]}: {skipped[0][1]}" if skipped else ""
        raise DataError(f"{path}: no usable rows out of {total}{first}")
    if skipped:
        shown = ", ".join(f"{i} ({why})" for i, why in skipped[:_SHOWN_SKIPS])
        more = f", and {len(skipped) - _SHOWN_SKIPS} more" if len(skipped) > _SHOWN_SKIPS else ""
        log.warning("%s: skipped %d of %d rows that cannot be trained on: rows %s%s", path, len(skipped), total,
                    shown, more)
    return rows, len(skipped)


def drop_duplicate_rows(rows: list[PromptRow]) -> list[PromptRow]:
    """The rows with the same prompt and ground truth as an earlier row left out (DAPO-Math-17K's parquet
    repeats each of its 17K problems about 100 times), first occurrences in file order."""
    seen: set[tuple[str, str]] = set()
    unique = []
    for row in rows:
        key = (json.dumps(row.prompt, sort_keys=True), row.ground_truth)
        if key not in seen:
            seen.add(key)
            unique.append(row)
    return unique


def write_rows(path, rows: list[dict]) -> None:
    """Write DAPO-schema rows (dicts) to .parquet (nested types, as the real dataset) or .jsonl, atomically."""
    path = Path(path)
    suffix = _format(path)
    if not rows:
        raise DataError(f"{path}: no rows to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if suffix == ".parquet":
            import pyarrow as pa  # here, not above: JSONL needs no pyarrow (the GPU check machine has none)
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), tmp)
        else:
            with tmp.open("w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
