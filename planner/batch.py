"""`planner batch`'s input, line by line: which paths are batch files (a folder, FIFO or
device is named for what it is), lines read in bounded pieces (a line longer than any
scenario is read past, never kept), strict JSON (NaN and Infinity refused) and one answer
per line, carrying its `id`, that quotes at most MAX_ERROR_CHARS of what it refuses.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from pathlib import Path

from planner.errors import MAX_MESSAGE_CHARS, PlannerInputError

MAX_BATCH_LINE_CHARS = 1 << 20  # a scenario line is under a KiB; a longer one is not read whole
MAX_ID_CHARS = 200
MAX_ERROR_CHARS = MAX_MESSAGE_CHARS  # an error quotes what it refuses: never a 10 MB field back


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # json.loads accepts NaN and Infinity; JSON does not


def line_answer(line: str, answer: Callable[[dict], dict]) -> dict:
    """One line's answer: `answer(values)` for a scenario object, else {"error": ...}; the
    line's `id` is carried over."""
    try:
        values = json.loads(line, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:  # ValueError: JSONDecodeError, or an int over 4300 digits
        detail = getattr(error, "msg", None) or (
            "too deeply nested" if isinstance(error, RecursionError)
            else str(error) if "is not JSON" in str(error) else "a number is too long")
        return {"error": f"line is not valid JSON ({detail})"}
    if not isinstance(values, dict):
        return {"error": "line must be a JSON object"}
    scenario_id = values.get("id")
    if not (scenario_id is None or isinstance(scenario_id, (str, int, float))) or isinstance(scenario_id, bool) \
            or len(str(scenario_id)) > MAX_ID_CHARS:
        return {"error": f"'id' must be a string or number of at most {MAX_ID_CHARS} characters"}
    try:
        result = answer(values)
    except PlannerInputError as error:
        result = {"error": clipped(str(error))}
    except Exception as error:  # noqa: BLE001 (a planner bug on one line must not cost the others theirs)
        result = {"error": clipped(f"the planner failed on this line ({type(error).__name__}: {error}): "
                                    "please report it with the line")}
    if scenario_id is not None:
        result = {"id": scenario_id, **result}
    return result


def clipped(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 1] + "…"


def batch_lines(stream):
    """The file's lines, a line too long to be a scenario as a marker (read past, never kept)."""
    while True:
        line = stream.readline(MAX_BATCH_LINE_CHARS)
        if not line:
            return
        if len(line) == MAX_BATCH_LINE_CHARS and not line.endswith("\n"):
            while (rest := stream.readline(MAX_BATCH_LINE_CHARS)) and not rest.endswith("\n"):
                pass
            yield None
        else:
            yield line


def batch_file(text: str) -> Path:
    """The batch file, or a one-line error saying what the path is instead."""
    path = Path(text)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise PlannerInputError(f"batch file {text[:200]!r} does not exist") from None
    except OSError as error:
        raise PlannerInputError(f"cannot read batch file {text[:200]!r}: {error.strerror}") from None
    if stat.S_ISREG(mode):
        return path
    kind = ("a folder" if stat.S_ISDIR(mode) else "a named pipe (FIFO)" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file")
    raise PlannerInputError(f"batch file {text[:200]!r} is {kind}: pass a JSONL file, one scenario per line")
