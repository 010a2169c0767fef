"""Ship the CUDA classes of another kernel class (planner.probe.cache.kernel_class), by default
sm75's (T4 and V100: no flash attention), for the classes shipped on sm80's kernels.

For each shipped file, every class probed on sm80's kernels under the current format, in the
given precisions (default fp32 and fp16-mixed: a T4 and a V100 have no bf16), is probed again
on `--arch`'s kernels. A class whose step records the very table sm80's did (SDPA chose the
same kernel for every call: a model without flash calls, in fp32) is stored as a reference to
it (planner.probe.cache.SAME_AS); the others in full. Classes already shipped for `--arch` are
left as they are, so an interrupted run goes on where it stopped.

    python scripts/ship_kernel_classes.py [--arch sm75] [--precisions fp32,fp16-mixed] [--part K/N] [--only NAME]
                                          [--containing TEXT]

Shipped: sm75's fp32, fp16-mixed and bf16-mixed classes (`--precisions bf16-mixed`: the Plan
page's technique chart draws bf16 autocast, with and without checkpointing, on every GPU, and a
page whose chart lacks a class draws it only on request). A few seconds per class: the fp32 and fp16-mixed classes of
`--part 0/2` (half the files) took 36 minutes on two cores busy with other work. Parts may run
side by side, never two runs on the same files at once (each writes its files whole).
Progress is printed per file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from planner.probe import cache  # noqa: E402
from reprobe_shipped import catalog_scenario, current_key, shipped_files  # noqa: E402

ALREADY_SHIPPED = "|cuda-kernels=" + cache.CUDA_PROBE_ARCH + "|"


def _without_key(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "key"}


def ship_file(path: Path, shapes: list, arch: str, precisions: tuple[str, ...], containing: str = "") -> tuple[int, int]:
    """(classes stored in full, classes stored as a reference to sm80's) for one shipped file."""
    tables = cache._read(path)
    sources = [key for key, entry in tables.items()
               if ALREADY_SHIPPED in key and current_key(key) == key and key.split("|")[2] in precisions
               and containing in key and cache.UNSUPPORTED not in entry]
    full = same = 0
    for key in sources:
        found = catalog_scenario(key, shapes, path, "skipped")
        if found is None:
            continue
        shape, scenario = found
        scenario = dataclasses.replace(scenario, compute_capability=cache.class_capability(arch))
        own_key = cache.technique_key(shape, scenario)
        if own_key in cache._read(path):
            continue
        table = cache.probe_table(shape, scenario)
        if isinstance(table, str):
            cache.store_unsupported(own_key, table, path)
            full += 1
        elif _without_key(json.loads(json.dumps(table.to_json()))) == _without_key(cache._read(path)[key]):
            cache.store_same_as(own_key, key, path)
            same += 1
        else:
            cache.store(table, path)
            full += 1
    return full, same


def main() -> int:
    os.environ["PLANNER_DATA_DIR"] = tempfile.mkdtemp(prefix="planner-ship-kernels-")  # probe afresh
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm75", help="the kernel class to ship (planner.probe.cache.kernel_class)")
    parser.add_argument("--precisions", default="fp32,fp16-mixed", help="comma-separated precisions")
    parser.add_argument("--part", default="0/1", help="K/N: every N-th file from the K-th")
    parser.add_argument("--only", default="", help="only the files of catalog models whose name contains this")
    parser.add_argument("--containing", default="", help="only the classes whose key contains this text")
    args = parser.parse_args()
    if args.arch == cache.CUDA_PROBE_ARCH or cache.kernel_class(cache.class_capability(args.arch)) != args.arch:
        parser.error(f"--arch must be a kernel class other than {cache.CUDA_PROBE_ARCH}, e.g. sm75")
    precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
    started = time.perf_counter()
    for number, path, shapes in shipped_files(args.part, args.only):
        begun = time.perf_counter()
        full, same = ship_file(path, shapes, args.arch, precisions, args.containing)
        print(f"{number} {shapes[0][0]}: {full} classes stored, {same} the same as "
              f"{cache.CUDA_PROBE_ARCH}'s, {time.perf_counter() - begun:.0f} s "
              f"({time.perf_counter() - started:.0f} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
