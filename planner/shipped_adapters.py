"""LoRA's adapter counts and QLoRA's quantised bases shipped for the catalog, so the fit
finder searches LoRA and QLoRA plans of a catalog model without importing torch,
transformers, PEFT or bitsandbytes (seconds on two cores, on the dashboard's What fits page
among others: a catalog model's first QLoRA search imported bitsandbytes, and torch with it).

`planner.adapters.adapter_count` builds the PEFT-wrapped model on the meta device; what it
returns depends on the config, task, labels, dtype, the LoRA rank, alpha and targets, and
the versions of PEFT and transformers. planner/catalog/adapters/ holds one file per (config,
task, labels, dtype) with the default LoRA settings the fit finder searches (planner.finetune
FineTune()), written by scripts/build_shape_tables.py; a configuration PEFT refuses ships its
one-line refusal. `planner.adapters.quantized_base` (what transformers' bitsandbytes
integration makes 4-bit) depends on the config, task, labels, quantisation type and double
quantisation, and the versions of bitsandbytes and transformers: the same folder holds one
file per (config, task, 2 labels) at the finder's QLoRA settings (nf4, double quantisation),
or bitsandbytes' refusal. Anything else is built as before. tests/test_shipped_shapes.py
checks them.
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
QUANTIZED_FORMAT = 1
QUANTIZED_PACKAGES = ("bitsandbytes", "transformers")  # what a quantised base is built with
SHIPPED_QUANTIZATION = ("nf4", True)  # (quant_type, double_quant): planner.finetune.FineTune's defaults
SHIPPED_DTYPES = ("float32", "bfloat16")


def adapter_file(source_config: str, task: Task, num_labels: int, dtype_name: str) -> Path:
    labels = num_labels if task.uses_labels else 0
    return ADAPTERS_DIR / f"{config_table_digest(source_config, task.value, str(labels), dtype_name)}.json"


@functools.cache
def _versions(names: tuple[str, ...] = ("peft", "transformers")) -> str:
    """The installed versions of `names`, as a shipped file records them."""
    return ",".join(f"{name}={metadata.version(name)}" for name in names)


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


def quantized_file(source_config: str, task: Task, num_labels: int, quant_type: str, double_quant: bool) -> Path:
    labels = num_labels if task.uses_labels else 0
    digest = config_table_digest(source_config, task.value, str(labels), "qlora-base", quant_type, str(double_quant))
    return ADAPTERS_DIR / f"{digest}.json"


def quantized_record(base=None, refusal: PlannerInputError | None = None) -> dict:
    """The file's content: a QuantizedBase's fields, each 4-bit weight by its elements (its
    stored tensors follow from them: planner.adapters.quantized_weight_tensors), or the refusal."""
    entry = {"error": str(refusal)} if refusal is not None else {
        "weight_elements": list(base.weight_elements), "unquantized": [list(t) for t in base.unquantized_tensors]}
    return {"format": QUANTIZED_FORMAT, "versions": _versions(QUANTIZED_PACKAGES), "base": entry}


def shipped_quantized(source_config: str, task: Task, num_labels: int, double_quant: bool, quant_type: str):
    """The shipped QuantizedBase for these settings, or None (then it is built). Raises the
    shipped refusal as the build would."""
    from planner.adapters import quantized_base_from

    path = quantized_file(source_config, task, num_labels, quant_type, double_quant)
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if record.get("format") != QUANTIZED_FORMAT or record.get("versions") != _versions(QUANTIZED_PACKAGES):
        return None
    entry = record["base"]
    if "error" in entry:
        raise PlannerInputError(entry["error"])
    return quantized_base_from(tuple(entry["weight_elements"]),
                               tuple((n, bool(is_bias)) for n, is_bias in entry["unquantized"]), double_quant)
