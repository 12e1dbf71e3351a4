"""Reading the JSON files of a checkpoint folder, with errors that name the file."""

import json
from pathlib import Path


def read_json_object(path: Path, error: type[Exception]) -> dict:
    """The JSON object in `path`; `error` (the caller's own exception type) says what is wrong with it otherwise."""
    try:
        value = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except (OSError, ValueError) as problem:
        raise error(f"{path}: not readable JSON ({problem})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object")
    return value
