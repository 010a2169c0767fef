"""Build what planning a catalog model needs without torch, and write the files the planner
ships: model shapes (planner/catalog/shapes/) and LoRA's adapter counts at the default
settings the fit finder searches (planner/catalog/adapters/).

One shape file per (catalog config, task) that transformers can build; a task it has no head
for ships the build's one-line error. One adapter file per (config, task, 2 labels, fp32 or
bf16 weights); a configuration PEFT refuses ships its refusal. Re-run after upgrading
transformers or PEFT: shipped files are read only under the versions they were built with.
tests/test_shipped_shapes.py checks them.

Run: python scripts/build_shape_tables.py [--only NAME] (minutes: a meta-device build each)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.adapters import built_adapter_count  # noqa: E402
from planner.catalog import catalog_config, catalog_entries  # noqa: E402
from planner.errors import PlannerInputError  # noqa: E402
from planner.scenario import Task  # noqa: E402
from planner.shapes_from_config import build_model_shape  # noqa: E402
from planner.finetune import FineTune, Method  # noqa: E402
from planner.shipped_adapters import ADAPTERS_DIR, SHIPPED_DTYPES, adapter_file, file_record  # noqa: E402
from planner.shipped_shapes import LABEL_PROBES, SHAPES_DIR, refused_file_record, shape_file, shipped_file_record  # noqa: E402


def ship(name: str) -> int:
    config = catalog_config(name)
    source_config = json.dumps(config, sort_keys=True, default=str)
    written = 0
    for task in Task:
        labels = LABEL_PROBES if task.uses_labels else LABEL_PROBES[:1]
        try:
            shapes = [build_model_shape(config, task, count, name) for count in labels]
        except PlannerInputError as error:
            record = refused_file_record(task, error)  # the same one-line error, without the build
        else:
            record = shipped_file_record(source_config, task, shapes)
            ship_adapters(source_config, task)
        shape_file(source_config, task).write_text(json.dumps(record, separators=(",", ":")) + "\n")
        written += 1
    return written


def ship_adapters(source_config: str, task: Task) -> None:
    finetune = FineTune(method=Method.LORA)
    for dtype in SHIPPED_DTYPES:
        try:
            record = file_record(finetune, count=built_adapter_count(source_config, task, 2, finetune, dtype))
        except PlannerInputError as error:
            record = file_record(finetune, refusal=error)
        adapter_file(source_config, task, 2, dtype).write_text(json.dumps(record, separators=(",", ":")) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one catalog name")
    args = parser.parse_args()
    names = [args.only] if args.only else list(catalog_entries())
    for folder in (SHAPES_DIR, ADAPTERS_DIR):
        folder.mkdir(parents=True, exist_ok=True)
        for stale in () if args.only else folder.glob("*.json"):
            stale.unlink()
    start = time.perf_counter()
    total = 0
    for index, name in enumerate(names, 1):
        count = ship(name)
        total += count
        print(f"[{index}/{len(names)}] {name}: {count} shapes ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"{total} shapes in {SHAPES_DIR.relative_to(ROOT)}, "
          f"{len(list(ADAPTERS_DIR.glob('*.json')))} adapter counts in {ADAPTERS_DIR.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
