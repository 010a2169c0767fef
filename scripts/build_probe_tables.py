"""Probe the bundled catalog and write the tables the planner ships (planner/catalog/probes/).

One file per catalog config, holding its probe tables for the default technique classes
(default task, SDPA where the model has it, the lessons' loop, no checkpointing; fp32 and
bf16 autocast; batch 1 and larger batches; `--all` adds pure bf16 and checkpointing), on CPU
kernels and on the CUDA kernels CUDA plans are probed with (planner.probe.cache.probe_gpu),
and the optimizer step's temporaries on CPU (AdamW and both Adafactors, whose per-tensor loops
CUDA plans take too; `--all`: the fit finder's optimizers as well; CUDA's multi-tensor steps are
read from torch's code, planner.optimizer_step). Anything else is probed on
first use and cached per user.
tests/test_probe_cache.py checks a shipped table against a fresh probe.

`--adapters` ships, instead, the LoRA and QLoRA classes that What fits' default search probes
(LoRA and QLoRA at PEFT's defaults, on CUDA, on the GPUs of ADAPTER_SEARCH_GPUS): a first search
otherwise probes up to 16 classes, minutes on two cores.

Every run first drops shipped entries under an older probe format or other library versions
(never read). Run: python scripts/build_probe_tables.py [--only NAME] [--device cpu|cuda] [--all] [--eager] [--adapters]
(a few seconds per class: about an hour for the catalog on two cores). What is shipped beyond the
default classes: `--all` for DistilBERT, GPT-2, Mistral-7B and Llama-2-7B (the dashboard's defaults
and the fit finder's usual 7B models), `--eager` for DistilBERT and GPT-2, on CUDA, `--checkpointing`
for every model on CUDA (the Plan page's technique chart draws those classes: without them a first
Plan page of a model probed four classes, about 25 s), and `--adapters` for DistilBERT and GPT-2.
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

from planner.catalog import catalog_config, catalog_entries  # noqa: E402
from planner.config_task import config_task  # noqa: E402
from planner.loading import load_model_shape  # noqa: E402
from planner.probe import cache  # noqa: E402
from planner.scenario import scenario_from_values  # noqa: E402

PRECISIONS = ("fp32", "bf16-mixed", "bf16", "fp16-mixed")  # fp16-mixed: what a T4 (no bf16) searches
STEP_OPTIMIZERS = ("adamw", "adamw8bit", "hf-adafactor", "sgd", "adafactor")
# Shipped for every model: AdamW, and the per-tensor loops a CUDA plan takes its step from
# (planner.estimate.PER_TENSOR_ON_CUDA: the Plan page's technique chart draws torch's Adafactor,
# the fit finder searches transformers').
DEFAULT_STEP_OPTIMIZERS = ("adamw", "adafactor", "hf-adafactor")
BATCH_CLASSES = (2, 1)  # batch 1 is a technique class of its own (planner.probe.cache)
DEVICES = ("cpu", "cuda")


def ship(name: str, everything: bool, devices: tuple[str, ...] = DEVICES, eager: bool = False,
         checkpointing: bool = False, own_task: bool = False) -> int:
    """Probe and store `name`'s classes; `eager`: eager attention's too, where SDPA is the default;
    `checkpointing`: the default precisions' checkpointing classes too (the Plan page's
    technique chart draws them for every model); `own_task`: under the task the config's
    `architectures` names instead of the catalog's (what an uploaded copy of it is planned as)."""
    entry = catalog_entries()[name]
    task = entry.default_task
    if own_task:
        found = config_task(catalog_config(name))
        if found is None:
            return 0
        task = found.task
    shape = load_model_shape(name, task)
    path = cache.SHIPPED_DIR / f"{cache.config_digest(shape)}.json"
    written = 0
    attentions = ("sdpa", "eager") if shape.supports_sdpa and eager else ("sdpa",) if shape.supports_sdpa else ("eager",)
    # With `everything`, sequences that reach a sliding window too (a class of their own): the
    # fit finder's longest-sequence search goes there.
    window = shape.sliding_window
    seq_lens = (8,) + ((window,) if everything and window and (shape.max_positions or window) >= window else ())
    for precision in PRECISIONS if everything else PRECISIONS[:2]:
        for device, checkpointing, batch, attention, seq_len in itertools.product(
                devices, (False, True) if everything or checkpointing else (False,), BATCH_CLASSES, attentions,
                seq_lens):
            scenario = scenario_from_values(task=task.value, batch_size=batch, seq_len=seq_len,
                                            device=device, precision=precision, gradient_checkpointing=checkpointing,
                                            attn=attention)
            table = cache.probe_table(shape, scenario)
            if isinstance(table, str):
                print(f"  {name} {device} {precision} checkpointing={checkpointing} batch {batch}: "
                      f"not probed ({table})")
                # Shipped too, so a plan falls back to the recipe at once instead of re-trying.
                cache.store_unsupported(cache.technique_key(shape, scenario), table, path)
                continue
            cache.store(table, path)
            written += 1
        if "cpu" not in devices:
            continue
        for optimizer in STEP_OPTIMIZERS if everything else DEFAULT_STEP_OPTIMIZERS:
            scenario = scenario_from_values(task=task.value, batch_size=1, seq_len=8, device="cpu",
                                            precision=precision, optimizer=optimizer, attn=attentions[0])
            step = cache.probed_step_temporaries(shape, scenario)
            if isinstance(step, str):
                print(f"  {name} {optimizer} {precision}: step not probed ({step})")
                continue
            cache.store_step(shape, scenario, step, path)
            written += 1
    return written


# What fits' default search (the sidebar's defaults: batch 8 x 512 tokens, AdamW, fp32) on a GPU
# without bf16 (the default T4) and on one with it (adapters over a bf16 base are searched there).
ADAPTER_SEARCH_GPUS = ("t4", "a100-80gb")
ADAPTER_MARKS = ("|lora:", "|qlora:")


def ship_adapters(name: str) -> int:
    """Run What fits' default search for `name` with an empty user cache, and ship every LoRA or
    QLoRA class (and adapter step) it probed: what a first search would otherwise probe."""
    from planner.device_fit import reserved_check
    from planner.fit import FitTarget, find_fits
    from planner.gpus import GPUS, scenario_on
    from planner.verdict import room_for_plans

    entry = catalog_entries()[name]
    shape = load_model_shape(name, entry.default_task)
    digest = cache.config_digest(shape)
    base = scenario_from_values(task=entry.default_task.value, batch_size=8, seq_len=512)
    for key in ADAPTER_SEARCH_GPUS:
        gpu = GPUS[key]
        find_fits(shape, scenario_on(base, gpu), gpu.capacity_bytes,
                  FitTarget(base.seq_len, effective_batch=base.batch_size), gpu,
                  room_for=room_for_plans(gpu.capacity_bytes, base.device, gpu),
                  check=reserved_check(gpu.capacity_bytes, base.device, gpu))
    probed = cache._read(cache._user_dir() / f"{digest}.json")
    path = cache.SHIPPED_DIR / f"{digest}.json"
    written = 0
    for key, entry_json in probed.items():
        if any(mark in key for mark in ADAPTER_MARKS):
            cache._store_entry(key, entry_json, path)
            written += 1
    return written


def prune_stale() -> int:
    """Drop shipped entries the planner no longer reads (an older probe format, or other library
    versions): keys name both (planner.probe.cache.technique_key)."""
    dropped = 0
    for path in sorted(cache.SHIPPED_DIR.glob("*.json")):
        tables = cache._read(path)
        kept = {key: entry for key, entry in tables.items() if _current(key)}
        if len(kept) != len(tables):
            dropped += len(tables) - len(kept)
            cache.write_tables(kept, path)
    return dropped


def _current(key: str) -> bool:
    parts = key.split("|")
    return f"probe-format={cache.current_format(key)}" in parts and parts[-1] == cache.library_versions()


def main() -> int:
    # Probe afresh: never copy a table from this user's cache into the shipped files.
    os.environ["PLANNER_DATA_DIR"] = tempfile.mkdtemp(prefix="planner-ship-")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="a catalog name, or text the names to probe contain")
    parser.add_argument("--all", action="store_true", help="every precision, checkpointing and fit optimizer")
    parser.add_argument("--device", choices=DEVICES, help="one device's kernels only (default: both)")
    parser.add_argument("--eager", action="store_true", help="eager attention too, for models whose default is SDPA")
    parser.add_argument("--checkpointing", action="store_true",
                        help="the default precisions' checkpointing classes too (the Plan page's chart)")
    parser.add_argument("--config-task", action="store_true",
                        help="under the task the config's architectures name (an uploaded copy's), not the catalog's")
    parser.add_argument("--adapters", action="store_true",
                        help="instead: the LoRA and QLoRA classes What fits' default search probes")
    args = parser.parse_args()
    print(f"dropped {prune_stale()} stale shipped entries", flush=True)
    # A whole catalog name is that model alone (gpt2, not gpt2-xl too); other text, every name containing it.
    names = ([args.only] if args.only in catalog_entries() else
             [n for n in catalog_entries() if not args.only or args.only in n])
    devices = (args.device,) if args.device else DEVICES
    for number, name in enumerate(names, start=1):
        started = time.perf_counter()
        written = (ship_adapters(name) if args.adapters
                   else ship(name, args.all, devices, args.eager, checkpointing=args.checkpointing,
                              own_task=args.config_task))
        print(f"[{number}/{len(names)}] {name}: {written} entries in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
