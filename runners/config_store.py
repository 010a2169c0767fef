"""Uploaded config.json files kept by content hash, so a shared link restores the config
without a re-upload (on the machine that stored it): `<data dir>/configs/<sha256>.json`,
beside the run history (runners.history.data_dir: $PLANNER_DATA_DIR or <project root>/data).

Only a 64-digit lowercase hex SHA-256 ever becomes a path, so a hash from a URL cannot name
any other file; the bytes are stored as uploaded (a config under
planner.config_source.MAX_CONFIG_BYTES), written to a temporary file and renamed into place,
so a reader never sees half a file. Every failure is a one-line PlannerInputError.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from planner.config_source import MAX_CONFIG_BYTES
from planner.errors import PlannerInputError
from runners.history import data_dir

CONFIGS_DIRNAME = "configs"
SHORT_HASH_DIGITS = 12  # enough to tell uploads apart in a label
_HASH = re.compile(r"[0-9a-f]{64}")


def config_hash(data: bytes) -> str:
    """The SHA-256 of an upload's bytes, 64 lowercase hex digits: its name in the store and the URL."""
    return hashlib.sha256(data).hexdigest()


def is_config_hash(text: object) -> bool:
    return isinstance(text, str) and _HASH.fullmatch(text) is not None


def short_hash(digest: str) -> str:
    return digest[:SHORT_HASH_DIGITS]


def store_dir() -> Path:
    return data_dir() / CONFIGS_DIRNAME


def _path(digest: str) -> Path:
    if not is_config_hash(digest):  # never a path from anything else
        raise PlannerInputError("a stored config's hash must be 64 hexadecimal digits (its SHA-256)")
    return store_dir() / f"{digest}.json"


def store_config(data: bytes) -> str:
    """Keep `data` (an upload already parsed as a config) under its hash; the hash."""
    if len(data) > MAX_CONFIG_BYTES:
        raise PlannerInputError(f"a config.json must be under {MAX_CONFIG_BYTES:,} bytes to be stored")
    digest = config_hash(data)
    path = _path(digest)
    if path.is_file():
        return digest  # same bytes, same name: already stored
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upload-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as error:
        raise PlannerInputError(f"the uploaded config could not be stored in {path.parent} "
                                f"({error.strerror or error}): a link to it will need the file again") from None
    return digest


def load_config(digest: str) -> bytes:
    """The stored bytes of the upload with hash `digest`; a one-line error when none is stored."""
    path = _path(digest)
    try:
        data = path.read_bytes() if path.stat().st_size <= MAX_CONFIG_BYTES else None
    except FileNotFoundError:
        raise PlannerInputError(f"no uploaded config {short_hash(digest)}… is stored on this machine: "
                                "upload its config.json again (a link restores an upload only where it "
                                "was made)") from None
    except OSError as error:
        raise PlannerInputError(f"the stored config {short_hash(digest)}… could not be read "
                                f"({error.strerror or error}): upload its config.json again") from None
    if data is None or config_hash(data) != digest:
        raise PlannerInputError(f"the stored config {short_hash(digest)}… is damaged: upload its config.json again")
    return data
