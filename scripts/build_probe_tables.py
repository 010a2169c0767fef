"""Probe the bundled catalog and write the tables the planner ships (planner/catalog/probes/).

One file per catalog config, holding its probe tables for the default technique classes
(default task, SDPA where the model has it, the lessons' loop, no checkpointing; fp32 and
bf16 autocast; batch 1 and larger batches; `--all` adds pure bf16 and checkpointing) and
the optimizer step's temporaries (AdamW; `--all`: the fit finder's four optimizers). Anything else is probed
on first use and cached per user.
tests/test_probe_cache.py checks a shipped table against a fresh probe.

Run: python scripts/build_probe_tables.py [--only NAME] (minutes: a few seconds per class)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.catalog import catalog_entries  # noqa: E402
from planner.loading import load_model_shape  # noqa: E402
from planner.probe import cache  # noqa: E402
from planner.scenario import scenario_from_values  # noqa: E402

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
STEP_OPTIMIZERS = ("adamw", "adamw8bit", "hf-adafactor", "sgd")
BATCH_CLASSES = (2, 1)  # batch 1 is a technique class of its own (planner.probe.cache)


def ship(name: str, everything: bool) -> int:
    entry = catalog_entries()[name]
    shape = load_model_shape(name, entry.default_task)
    path = cache.SHIPPED_DIR / f"{cache.config_digest(shape)}.json"
    written = 0
    attention = "sdpa" if shape.supports_sdpa else "eager"
    for precision in PRECISIONS if everything else PRECISIONS[:2]:
        for checkpointing, batch in itertools.product((False, True) if everything else (False,), BATCH_CLASSES):
            scenario = scenario_from_values(task=entry.default_task.value, batch_size=batch, seq_len=8, device="cpu",
                                            precision=precision, gradient_checkpointing=checkpointing,
                                            attn=attention)
            table = cache.probe_table(shape, scenario)
            if isinstance(table, str):
                print(f"  {name} {precision} checkpointing={checkpointing} batch {batch}: not probed ({table})")
                continue
            cache.store(table, path)
            written += 1
        for optimizer in STEP_OPTIMIZERS if everything else STEP_OPTIMIZERS[:1]:
            scenario = scenario_from_values(task=entry.default_task.value, batch_size=1, seq_len=8, device="cpu",
                                            precision=precision, optimizer=optimizer, attn=attention)
            step = cache.probed_step_temporaries(shape, scenario)
            if isinstance(step, str):
                print(f"  {name} {optimizer} {precision}: step not probed ({step})")
                continue
            cache.store_step(shape, scenario, step, path)
            written += 1
    return written


def main() -> int:
    # Probe afresh: never copy a table from this user's cache into the shipped files.
    os.environ["PLANNER_DATA_DIR"] = tempfile.mkdtemp(prefix="planner-ship-")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="catalog names containing this text")
    parser.add_argument("--all", action="store_true", help="every precision, checkpointing and fit optimizer")
    args = parser.parse_args()
    names = [n for n in catalog_entries() if not args.only or args.only in n]
    for number, name in enumerate(names, start=1):
        started = time.perf_counter()
        written = ship(name, args.all)
        print(f"[{number}/{len(names)}] {name}: {written} entries in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
