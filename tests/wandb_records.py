"""The records of a wandb run file (run-ID.wandb), read back for the tests: wandb writes them offline and
ships no reader of its own. The file is a LevelDB log (32 KiB blocks of chunks, each with a 7-byte header:
crc32, length, kind) after wandb's 7-byte header; each record is a wandb_internal_pb2.Record."""

import json
import struct
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a wandb run file"
    out, pos, chunks = [], 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the padding at a block's end
            pos += left
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            out.append(record)
            chunks = b""
    return out


def history(path: Path) -> list[dict]:
    """The rows wandb.log wrote, without wandb's own keys (_step, _runtime, _timestamp)."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def run_record(path: Path):
    """The run record: id, project, display name and the config it was started with."""
    (run,) = [r.run for r in records(path) if r.WhichOneof("record_type") == "run"]
    return run


def run_config(path: Path) -> dict:
    return {u.key: json.loads(u.value_json) for u in run_record(path).config.update if not u.key.startswith("_")}
