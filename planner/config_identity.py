"""What of a config.json decides the model transformers builds from it, for the tables shipped
and cached per config (probe tables, shapes, adapter counts).

A checkpoint's config names it: `_name_or_path` (the repository or folder it was saved
from), `architectures` (the classes it was saved from), `transformers_version` (the version
that wrote it), `_commit_hash`. `AutoModelFor<task>.from_config` reads none of these to
build (the task picks the class, and planner.model_shape.ModelShape.architecture is the class
built, not this list), so a fine-tune of a catalog model, the same config saved under another
name or by another transformers version, is the catalog model's tables at once instead of
minutes of probing.
"""

from __future__ import annotations

import functools
import hashlib
import json

NAMING_KEYS = frozenset({"_name_or_path", "architectures", "transformers_version", "_commit_hash"})


def built_config_text(source_config: str) -> str:
    """`source_config` (the config as canonical JSON) without the keys that only name the checkpoint."""
    config = json.loads(source_config)
    return json.dumps({key: value for key, value in config.items() if key not in NAMING_KEYS}, sort_keys=True)


# Looked up for every estimate (planner.probe.cache.config_digest): parsed and hashed once per config.
@functools.lru_cache(maxsize=1024)
def config_table_digest(source_config: str, *qualifiers: str) -> str:
    """The file name (20 hex digits of SHA-256) of a table for this config and `qualifiers`."""
    text = "\n".join((built_config_text(source_config), *qualifiers))
    return hashlib.sha256(text.encode()).hexdigest()[:20]
