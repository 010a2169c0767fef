"""Probe again, under the current probe formats, every class (CPU and CUDA kernels) the shipped
tables hold under an older one (planner/catalog/probes/), and drop the old entries.

When what a probe records changes (planner.probe.cache.PROBE_FORMAT, CUDA_PROBE_FORMAT, or a
marker such as cache.FP16_AUTOCAST), the shipped tables are no longer read; this rebuilds exactly the classes that were shipped, read
back from their keys (planner.probe.cache.technique_key: task, labels, precision, checkpointing,
attention, engine, window, batch 1, target length, adapters, kernels), for the catalog model
whose config digest names the file. Optimizer steps are left as they are. Classes that a format
change leaves as they were can be carried over first without probing
(scripts/carry_shipped_tables.py).

    python scripts/reprobe_shipped.py [--part K/N] [--only NAME] [--containing TEXT] [--again]

`--part K/N` takes every N-th file from the K-th (0-based), so that N processes can share the
work, each writing only its own files (a few seconds per class; 1,032 CUDA classes took about
N x 45 minutes on two cores with N = 2). Progress is printed per file.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.catalog import catalog_config, catalog_entries  # noqa: E402
from planner.config_task import config_task  # noqa: E402
from planner.loading import load_model_shape  # noqa: E402
from planner.probe import cache  # noqa: E402
from planner.scenario import scenario_from_values  # noqa: E402

PROBED_SEQ_LEN = 8  # scripts/build_probe_tables.py: classes are probed at 8 tokens, or at the window


def models_by_digest() -> dict[str, list[tuple[str, object]]]:
    """Table file digest -> (catalog name, model shape) for each task the catalog ships it under."""
    found: dict[str, list[tuple[str, object]]] = {}
    for name, entry in catalog_entries().items():
        tasks = [entry.default_task]
        own = config_task(catalog_config(name))
        if own is not None and own.task not in tasks:
            tasks.append(own.task)
        for task in tasks:
            shape = load_model_shape(name, task)
            found.setdefault(cache.config_digest(shape), []).append((name, shape))
    return found


def scenario_of(key: str, shape):
    """The scenario a shipped CUDA key was probed for (its inverse: cache.technique_key)."""
    parts = key.split("|")
    task, labels, precision, checkpointing, attention, engine, window = parts[:7]
    values = dict(task=task, num_labels=int(labels.split("=")[1]) or 2, precision=precision,
                  gradient_checkpointing=checkpointing == "checkpointing", attn=attention, engine=engine,
                  device="cuda" if "|cuda-kernels=" in key else "cpu", batch_size=1 if "batch-1" in parts else 2,
                  seq_len=shape.sliding_window if window == "window-reached" else PROBED_SEQ_LEN)
    for part in parts[7:]:
        if part.startswith("cuda-kernels="):
            capability = cache.class_capability(part.split("=")[1])
            values["compute_capability"] = None if capability is None else "{}.{}".format(*capability)
        elif part.startswith("target="):
            values["target_len"] = int(part.split("=")[1])
        elif part.startswith(("lora:", "qlora:")):
            method, *fields = part.split(":")
            settings = dict(field.split("=", 1) for field in fields)
            values.update(finetune=method, lora_r=int(settings["r"]),
                          lora_dropout=0.05 if settings["dropout"] == "on" else 0.0, lora_targets=settings["targets"])
        elif part.startswith("4bit="):
            kind, double = part.split(":")[:2]
            values.update(quant_type=kind.split("=")[1], double_quant=double.split("=")[1] == "on")
    return scenario_from_values(**values)


def current_key(key: str) -> str:
    """A stored key as planner.probe.cache.technique_key writes it today: under the current probe
    format of its kind (cache.current_format), and a CUDA fp16-mixed class marked as probed under
    autocast (cache.FP16_AUTOCAST; classes shipped before were fp32 steps)."""
    wanted = cache.current_format(key)
    parts = [f"probe-format={wanted}" if part.startswith("probe-format=") else part for part in key.split("|")]
    if parts[2] == "fp16-mixed" and cache.FP16_AUTOCAST not in parts:
        kernels = [i for i, part in enumerate(parts) if part.startswith("cuda-kernels=")]
        if kernels:
            parts.insert(kernels[0], cache.FP16_AUTOCAST)
    return "|".join(parts)


def is_class_key(key: str) -> bool:
    """A technique class's table (CPU or CUDA kernels), not an optimizer step's temporaries."""
    return not key.startswith("optimizer-step|")


def scenario_for_key(key: str, shapes: list):
    """(shape, scenario) of the catalog model and scenario whose class, under the current format,
    `key` is; None when none is."""
    for _, shape in shapes:
        scenario = scenario_of(key, shape)
        if cache.technique_key(shape, scenario) == current_key(key):
            return shape, scenario
    return None


def shipped_files(part: str, only: str = "") -> Iterator[tuple[str, Path, list]]:
    """("[number/count]", path, catalog (name, shape)s) for every N-th shipped file from the K-th
    (`part` "K/N"), only those of catalog models whose name contains `only`; a file of no
    catalog model is named and left out."""
    k, n = (int(x) for x in part.split("/"))
    by_digest = models_by_digest()
    files = sorted(cache.SHIPPED_DIR.glob("*.json"))[k::n]
    for number, path in enumerate(files, start=1):
        shapes = by_digest.get(path.stem)
        if shapes is None:
            print(f"[{number}/{len(files)}] {path.name}: no catalog model: left as it is", flush=True)
        elif only in " ".join(name for name, _ in shapes):
            yield f"[{number}/{len(files)}]", path, shapes


def catalog_scenario(key: str, shapes: list, path: Path, otherwise: str):
    """scenario_for_key, saying so (and what is done: `otherwise`) where no catalog model gives it."""
    found = scenario_for_key(key, shapes)
    if found is None:
        print(f"  {path.name}: no catalog model and scenario give {key}: {otherwise}", flush=True)
    return found


def reprobe(path: Path, shapes: list, again: bool = False, containing: str = "") -> tuple[int, int]:
    """(re-probed, dropped) classes of one shipped file: those under an older probe format, or
    (`again`) those under the current one; only those whose key contains `containing`.
    Optimizer-step entries are left as they are (their own format: cache.STEP_PROBE_FORMAT)."""
    tables = cache._read(path)
    old = [key for key in tables if is_class_key(key) and (current_key(key) == key) == again and containing in key]
    if again:
        # The same keys: a shipped entry would be read back instead of probed (cache.probe_table
        # looks there), so they leave the file first.
        cache.write_tables({key: entry for key, entry in tables.items() if key not in old}, path)
    done = 0
    for key in old:
        found = catalog_scenario(key, shapes, path, "dropped")
        if found is None:
            continue
        shape, scenario = found
        table = cache.probe_table(shape, scenario)
        if isinstance(table, str):
            cache.store_unsupported(current_key(key), table, path)
        else:
            cache.store(table, path)
        done += 1
    if again:
        return done, 0  # probed again under the same keys: stored over the old entries
    tables = cache._read(path)
    kept = {key: entry for key, entry in tables.items() if key not in old}
    cache.write_tables(kept, path)
    return done, len(tables) - len(kept)


def main() -> int:
    os.environ["PLANNER_DATA_DIR"] = tempfile.mkdtemp(prefix="planner-reprobe-")  # probe afresh
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="0/1", help="K/N: every N-th file from the K-th")
    parser.add_argument("--again", action="store_true",
                        help="probe the classes under the current format again, in place (not the older ones)")
    parser.add_argument("--only", default="", help="only the files of catalog models whose name contains this")
    parser.add_argument("--containing", default="", help="only the classes whose key contains this text")
    args = parser.parse_args()
    started = time.perf_counter()
    for number, path, shapes in shipped_files(args.part, args.only):
        begun = time.perf_counter()
        done, dropped = reprobe(path, shapes, args.again, args.containing)
        print(f"{number} {shapes[0][0]}: {done} classes probed again, {dropped} old entries dropped, "
              f"{time.perf_counter() - begun:.0f} s ({time.perf_counter() - started:.0f} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
