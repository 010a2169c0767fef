"""Where a model config comes from: a catalog name, a config.json path, uploaded bytes,
or (only when asked, and only when online) a model id on the Hugging Face hub.

Every failure is a PlannerInputError with one line saying what to do instead.
Configs are parsed as JSON only: no pickle or other code-executing format is ever read.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from planner.catalog import catalog_config, catalog_entries
from planner.errors import PlannerInputError

MAX_CONFIG_BYTES = 1 << 20  # a real config.json is a few KiB; 1 MiB leaves room, stops abuse
MAX_JSON_DEPTH = 32
HUB_TIMEOUT_S = 10.0
HUB_URL = "https://huggingface.co"
# Where the hub is: $PLANNER_HUB_URL, else huggingface_hub's own $HF_ENDPOINT (a mirror), else HUB_URL.
HUB_URL_ENV = "PLANNER_HUB_URL"
HUB_ADVICE = "download its config.json and pass the path"
# The hub's repo names: letters, digits, '-', '_', '.', at most 96 characters, optionally
# under an owner ("owner/name"); never '..' or a leading punctuation mark (no path tricks).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


def configured_hub_url() -> str:
    """The hub's base URL, read at call time (a test or a mirror sets it in the environment)."""
    return (os.environ.get(HUB_URL_ENV, "").strip() or os.environ.get("HF_ENDPOINT", "").strip()
            or HUB_URL).rstrip("/")


def is_hub_model_id(text: object) -> bool:
    """Whether `text` has the shape of a hub model id ("owner/name" or "name")."""
    return isinstance(text, str) and _HUB_ID.fullmatch(text) is not None and ".." not in text


def _depth(value, level: int = 0) -> int:
    if level > MAX_JSON_DEPTH:
        return level
    if isinstance(value, dict):
        return max([_depth(v, level + 1) for v in value.values()] or [level + 1])
    if isinstance(value, list):
        return max([_depth(v, level + 1) for v in value] or [level + 1])
    return level


def config_from_bytes(data: bytes, source_name: str = "uploaded config") -> dict:
    """Parse and sanity-check a config.json given as bytes."""
    if len(data) > MAX_CONFIG_BYTES:
        raise PlannerInputError(
            f"{source_name} is {len(data):,} bytes; a config.json must be under {MAX_CONFIG_BYTES:,} bytes"
        )
    try:
        config = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise PlannerInputError(f"{source_name} is not UTF-8 text: upload the model's config.json") from None
    except (ValueError, RecursionError) as error:  # ValueError: JSONDecodeError, or an int over 4300 digits
        detail = getattr(error, "msg", None) or (
            "too deeply nested" if isinstance(error, RecursionError) else "a number is too long")
        raise PlannerInputError(f"{source_name} is not valid JSON ({detail}): upload the model's config.json") from None
    if not isinstance(config, dict):
        raise PlannerInputError(f"{source_name} must hold a JSON object, like a transformers config.json")
    if _depth(config) > MAX_JSON_DEPTH:
        raise PlannerInputError(f"{source_name} is nested deeper than {MAX_JSON_DEPTH} levels: not a config.json")
    if not isinstance(config.get("model_type"), str):
        raise PlannerInputError(f"{source_name} has no 'model_type' string: it must be a transformers config.json")
    return config


def config_from_path(path: Path) -> dict:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlannerInputError(f"config file {str(path)!r} does not exist")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise PlannerInputError(f"{path.name} is {size:,} bytes; a config.json must be under {MAX_CONFIG_BYTES:,} bytes")
    return config_from_bytes(path.read_bytes(), path.name)


def config_from_hub(model_id: str, timeout_s: float = HUB_TIMEOUT_S, hub_url: str | None = None,
                    advice: str = HUB_ADVICE) -> dict:
    """config.json of a hub model; a clear error (never a hang) when offline or unknown.
    `hub_url` None: configured_hub_url(); `advice` ends the offline message."""
    import urllib.error
    import urllib.parse
    import urllib.request

    if not is_hub_model_id(model_id):
        raise PlannerInputError(f"{str(model_id)[:200]!r} is not a hub model id like 'owner/name'")
    base = configured_hub_url() if hub_url is None else hub_url
    url = f"{base}/{urllib.parse.quote(model_id)}/resolve/main/config.json"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (fixed https host)
            data = response.read(MAX_CONFIG_BYTES + 1)
    except urllib.error.HTTPError as error:
        raise PlannerInputError(f"the hub has no config.json for {model_id!r} (HTTP {error.code})") from None
    except (urllib.error.URLError, TimeoutError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise PlannerInputError(
            f"cannot reach the Hugging Face hub for {model_id!r} ({reason}): {advice}"
        ) from None
    return config_from_bytes(data, f"{model_id} config.json")


def config_model_name(config: dict) -> str:
    """What a config calls its model: its `_name_or_path`, else its first architecture, else
    its model_type (a parsed config always has one); at most 200 characters."""
    for value in (config.get("_name_or_path"),
                  (config.get("architectures") or [None])[0] if isinstance(config.get("architectures"), list)
                  else None,
                  config.get("model_type")):
        if isinstance(value, str) and value.strip():
            return value.strip()[:200]
    return "config.json"


def model_label(config: dict, path: Path) -> str:
    """What to call a model read from a file: its file name, unless that says only
    "config.json" (then the config's own `_name_or_path`, else the folder holding it)."""
    if path.name.lower() != "config.json":
        return path.name
    named = config.get("_name_or_path")
    if isinstance(named, str) and named.strip():
        return named.strip()[:200]
    return path.resolve().parent.name or path.name


def resolve_config(source: str, base_dir: Path | None = None, allow_hub: bool = False) -> tuple[dict, str]:
    """(config dict, display name) for a catalog name, a path, or a hub id when allow_hub."""
    text = str(source).strip()
    if not text:
        raise PlannerInputError("no model given: pass a catalog name or a config.json path")
    if text.lower() in catalog_entries():
        return catalog_config(text), text.lower()
    try:
        path = Path(text).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if path.exists() or text.endswith(".json"):
            config = config_from_path(path)
            return config, model_label(config, path)
    except PlannerInputError:
        raise
    except (OSError, RuntimeError, ValueError) as error:  # name too long, unreadable, no home for "~user"...
        raise PlannerInputError(f"cannot read config {text[:200]!r}: {getattr(error, 'strerror', None) or error}") from None
    if allow_hub and "/" in text:
        return config_from_hub(text), text
    hint = " (or pass --hub to fetch it from the hub)" if "/" in text else ""
    raise PlannerInputError(
        f"{text!r} is neither a catalog model nor a config file{hint}: "
        "run `python -m planner catalog` to list the bundled models"
    )
