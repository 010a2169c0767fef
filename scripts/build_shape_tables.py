"""Build what planning a catalog model needs without torch, and write the files the planner
ships: model shapes (planner/catalog/shapes/), and LoRA's adapter counts and QLoRA's
quantised bases at the default settings the fit finder searches (planner/catalog/adapters/).

One shape file per (catalog config, task) that transformers can build; a task it has no head
for ships the build's one-line error. One adapter file per (config, task, 2 labels, fp32 or
bf16 weights), and one quantised base per (config, task, 2 labels) at nf4 with double
quantisation; a configuration PEFT or bitsandbytes refuses ships its refusal. Re-run after
upgrading transformers, PEFT or bitsandbytes: shipped files are read only under the versions
they were built with. tests/test_shipped_shapes.py checks them.

Run: python scripts/build_shape_tables.py [--only NAME] [--quantized-only]
(minutes: a meta-device build each; --quantized-only writes the quantised bases alone)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.adapters import built_adapter_count, built_quantized_base  # noqa: E402
from planner.catalog import catalog_config, catalog_entries  # noqa: E402
from planner.errors import PlannerInputError  # noqa: E402
from planner.scenario import Task  # noqa: E402
from planner.shapes_from_config import build_model_shape  # noqa: E402
from planner.finetune import FineTune, Method  # noqa: E402
from planner.shipped_adapters import (  # noqa: E402
    ADAPTERS_DIR,
    SHIPPED_DTYPES,
    SHIPPED_QUANTIZATION,
    adapter_file,
    file_record,
    quantized_file,
    quantized_record,
)
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
            ship_quantized(source_config, task)
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


def ship_quantized(source_config: str, task: Task) -> None:
    quant_type, double_quant = SHIPPED_QUANTIZATION
    try:
        record = quantized_record(built_quantized_base(source_config, task, 2, double_quant, quant_type))
    except PlannerInputError as error:
        record = quantized_record(refusal=error)
    quantized_file(source_config, task, 2, quant_type, double_quant).write_text(
        json.dumps(record, separators=(",", ":")) + "\n")


def ship_quantized_only(name: str) -> int:
    """The quantised bases of every task the shipped shapes build (not refused)."""
    source_config = json.dumps(catalog_config(name), sort_keys=True, default=str)
    written = 0
    for task in Task:
        if "error" in json.loads(shape_file(source_config, task).read_text()):
            continue
        ship_quantized(source_config, task)
        written += 1
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one catalog name")
    parser.add_argument("--quantized-only", action="store_true",
                        help="write only the quantised bases (the shapes must be shipped)")
    args = parser.parse_args()
    names = [args.only] if args.only else list(catalog_entries())
    if args.quantized_only:
        start = time.perf_counter()
        for index, name in enumerate(names, 1):
            count = ship_quantized_only(name)
            print(f"[{index}/{len(names)}] {name}: {count} quantised bases ({time.perf_counter() - start:.0f} s)",
                  flush=True)
        return
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
