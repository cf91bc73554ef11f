"""The one reader of the JSON and YAML files a user hands in (a model's config.json and weight index, the run's YAML,
a checkpoint's records): a file that is missing, unreadable, not UTF-8, malformed or of the wrong shape is an error
naming the file and what is wrong with it, never a parser's traceback."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_dapo.errors import DapoError


class UserFileError(DapoError, ValueError):
    """A file handed in that cannot be used as it is; the message names it."""


def _text(path: Path, error: type[DapoError]) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start}): is it the file you meant?") from None
    except OSError as e:  # a folder, no permission, an I/O error
        raise error(f"{path}: cannot be read: {e.strerror or e}") from None


def _shaped(value, where: str, expect: type, kind: str, error: type[DapoError]):
    """`value`, if it is an `expect`; else `error` naming `where` (the file, or the file and a key)."""
    if not isinstance(value, expect):
        raise error(f"{where}: must hold a {kind} {'object' if expect is dict else expect.__name__}, "
                    f"holds {type(value).__name__} {str(value)[:80]!r}")
    return value


def read_json(path, *, expect: type = dict, error: type[DapoError] = UserFileError):
    """The JSON value in `path`, which must be an `expect`; `error`: the class raised, naming the file."""
    path = Path(path)
    try:
        value = json.loads(_text(path, error))
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    return _shaped(value, str(path), expect, "JSON", error)


def read_yaml(path, *, expect: type = dict, error: type[DapoError] = UserFileError):
    """The YAML value in `path` (an empty file is an empty mapping), which must be an `expect`; `error`: the class
    raised, naming the file."""
    import yaml

    path = Path(path)
    try:
        value = yaml.safe_load(_text(path, error))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise error(f"{path}: not valid YAML{where}: {problem}") from None
    return _shaped({} if value is None else value, str(path), expect, "YAML", error)


def json_field(value: dict, key: str, expect: type, path, error: type[DapoError] = UserFileError):
    """`value[key]` of the JSON object read from `path`, which must be an `expect`: the file and the key named
    otherwise."""
    if key not in value:
        raise error(f"{path}: no {key!r} key")
    return _shaped(value[key], f"{path}: {key!r}", expect, "JSON", error)
