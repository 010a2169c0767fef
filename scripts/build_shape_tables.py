"""Build the catalog's model shapes and write the files the planner ships (planner/catalog/shapes/).

One file per (catalog config, task) that transformers can build; a task it has no head for
ships the build's one-line error. Re-run after upgrading transformers: shipped shapes are read only
under the version they were built with. tests/test_shipped_shapes.py checks them.

Run: python scripts/build_shape_tables.py [--only NAME] (about a minute: a meta-device build each)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.catalog import catalog_config, catalog_entries  # noqa: E402
from planner.errors import PlannerInputError  # noqa: E402
from planner.scenario import Task  # noqa: E402
from planner.shapes_from_config import build_model_shape  # noqa: E402
from planner.shipped_shapes import LABEL_PROBES, SHAPES_DIR, refused_file_record, shape_file, shipped_file_record  # noqa: E402


def ship(name: str) -> int:
    config = catalog_config(name)
    source_config = json.dumps(config, sort_keys=True, default=str)
    written = 0
    for task in Task:
        labels = LABEL_PROBES if task is Task.SEQUENCE_CLASSIFICATION else LABEL_PROBES[:1]
        try:
            shapes = [build_model_shape(config, task, count, name) for count in labels]
        except PlannerInputError as error:
            record = refused_file_record(task, error)  # the same one-line error, without the build
        else:
            record = shipped_file_record(source_config, task, shapes)
        shape_file(source_config, task).write_text(json.dumps(record, separators=(",", ":")) + "\n")
        written += 1
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one catalog name")
    args = parser.parse_args()
    SHAPES_DIR.mkdir(parents=True, exist_ok=True)
    names = [args.only] if args.only else list(catalog_entries())
    if not args.only:
        for stale in SHAPES_DIR.glob("*.json"):
            stale.unlink()
    start = time.perf_counter()
    total = 0
    for index, name in enumerate(names, 1):
        count = ship(name)
        total += count
        print(f"[{index}/{len(names)}] {name}: {count} shapes ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"{total} shapes in {SHAPES_DIR.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
