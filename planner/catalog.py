"""The bundled model catalog: real config.json files in planner/catalog/, described by
planner/catalog/index.json (hub id, family, published parameter count and its source)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from planner.errors import PlannerInputError
from planner.scenario import Task

CATALOG_DIR = Path(__file__).resolve().parent / "catalog"


@dataclass(frozen=True)
class CatalogEntry:
    name: str  # file stem, what users type: "llama-2-7b"
    hub_id: str
    family: str
    description: str
    published_params: int | None
    published_params_source: str
    published_params_class: str

    @property
    def default_task(self) -> Task:
        # Encoders are fine-tuned as classifiers in the lessons; the rest are language models.
        return Task.SEQUENCE_CLASSIFICATION if self.family == "encoder" else Task.CAUSAL_LM

    @property
    def config_path(self) -> Path:
        return CATALOG_DIR / f"{self.name}.json"


@functools.cache
def catalog_entries() -> dict[str, CatalogEntry]:
    index = json.loads((CATALOG_DIR / "index.json").read_text())
    return {name: CatalogEntry(name=name, **fields) for name, fields in sorted(index.items())}


def catalog_names() -> list[str]:
    return list(catalog_entries())


def catalog_config(name: str) -> dict:
    """The config dict of a catalog model; PlannerInputError for an unknown name."""
    entry = catalog_entries().get(name.strip().lower())
    if entry is None:
        raise PlannerInputError(
            f"unknown catalog model {name!r}: run `python -m planner catalog` to list the "
            f"{len(catalog_entries())} bundled models, or pass a config.json path"
        )
    return json.loads(entry.config_path.read_text())
