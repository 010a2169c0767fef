"""LoRA's adapter counts shipped for the catalog, so the fit finder searches LoRA plans of a
catalog model without importing torch, transformers or PEFT (seconds on two cores, on the
dashboard's What fits page among others).

`planner.adapters.adapter_count` builds the PEFT-wrapped model on the meta device; what it
returns depends on the config, task, labels, dtype, the LoRA rank, alpha and targets, and
the versions of PEFT and transformers. planner/catalog/adapters/ holds one file per (config,
task, labels, dtype) with the default LoRA settings the fit finder searches (planner.finetune
FineTune()), written by scripts/build_shape_tables.py; a configuration PEFT refuses ships its
one-line refusal. Anything else is built as before. tests/test_shipped_shapes.py checks them.
"""

from __future__ import annotations

import functools
import json
from importlib import metadata
from pathlib import Path

from planner.config_identity import config_table_digest
from planner.errors import PlannerInputError
from planner.finetune import FineTune
from planner.scenario import Task

ADAPTERS_DIR = Path(__file__).resolve().parent / "catalog" / "adapters"
ADAPTER_FORMAT = 1
SHIPPED_DTYPES = ("float32", "bfloat16")


def adapter_file(source_config: str, task: Task, num_labels: int, dtype_name: str) -> Path:
    labels = num_labels if task.uses_labels else 0
    return ADAPTERS_DIR / f"{config_table_digest(source_config, task.value, str(labels), dtype_name)}.json"


@functools.cache
def _versions() -> str:
    return ",".join(f"{name}={metadata.version(name)}" for name in ("peft", "transformers"))


def settings_key(finetune: FineTune) -> str:
    """What of the LoRA settings changes the adapters PEFT creates (not the method or dropout)."""
    return f"r={finetune.lora_r}|alpha={finetune.alpha}|targets={finetune.targets_text}|{_versions()}"


def file_record(finetune: FineTune, count=None, refusal: PlannerInputError | None = None) -> dict:
    """The file's content: an AdapterCount's fields, or PEFT's refusal."""
    entry = {"error": str(refusal)} if refusal is not None else {
        "trainable_parameters": count.trainable_parameters, "trainable_bytes": count.trainable_bytes,
        "all_parameters": count.all_parameters, "all_bytes": count.all_bytes,
        "trainable": [[name, list(dims), size] for name, dims, size in count.trainable],
        "parameter_bytes": list(count.parameter_bytes)}
    return {"format": ADAPTER_FORMAT, "settings": settings_key(finetune), "count": entry}


def shipped_count(source_config: str, task: Task, num_labels: int, finetune: FineTune, dtype_name: str):
    """The shipped AdapterCount for these settings, or None (then it is built). Raises PEFT's
    shipped refusal as the build would."""
    from planner.adapters import AdapterCount

    path = adapter_file(source_config, task, num_labels, dtype_name)
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if record.get("format") != ADAPTER_FORMAT or record.get("settings") != settings_key(finetune):
        return None
    entry = record["count"]
    if "error" in entry:
        raise PlannerInputError(entry["error"])
    return AdapterCount(entry["trainable_parameters"], entry["trainable_bytes"], entry["all_parameters"],
                        entry["all_bytes"], tuple((name, tuple(dims), size) for name, dims, size in entry["trainable"]),
                        tuple(entry["parameter_bytes"]))
