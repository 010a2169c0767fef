"""Sidebar values <-> the URL query string, so a plan can be shared as a link (no Streamlit
here: app.py passes st.query_params in and out).

Only keys of inputs.DEFAULTS travel, each parsed back to its default's type; a value that
does not parse, is out of the planner's bounds (inputs.MAXIMA), or names no catalog model /
GPU preset / choice, is dropped (its widget keeps its default, and the page says which
were dropped and why) rather than breaking the page. The uploaded config travels as its
content hash (`config_hash`, 64 hex digits, nothing else accepted, so a link cannot name a
file): on the machine that stored it the link restores it (runners.config_store); elsewhere
the page says it is not stored there. A hub model travels as its id (`hub_model_id`).
The fine-tuning method travels under planner.finetune.FINETUNE_KEYS (the CLI's and `planner
batch`'s names): LoRA's settings only with LoRA or QLoRA, QLoRA's only with QLoRA; LoRA
alpha is absent while it follows the rank (2 x r).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from planner.catalog import catalog_entries
from planner.config_source import is_hub_model_id
from planner.errors import PlannerInputError
from planner.finetune import ALL_LINEAR, QUANT_TYPES, Method, parse_targets
from planner.scenario import Attention, Device, Task
from runners.config_store import is_config_hash
from views.inputs import (
    DEFAULTS,
    FINETUNE_LABELS,
    GPU_PRESETS,
    MAXIMA,
    MODEL_SOURCE_LABELS,
    OPTIMIZER_LABELS,
    PRECISION_LABELS,
    STRATEGY_LABELS,
)

_CHOICES: dict[str, tuple[str, ...]] = {
    "model_source": tuple(MODEL_SOURCE_LABELS),
    "task": tuple(t.value for t in Task),
    "optimizer": tuple(OPTIMIZER_LABELS),
    "precision": tuple(PRECISION_LABELS),
    "attn": tuple(a.value for a in Attention),
    "device": tuple(d.value for d in Device),
    "gpu_preset": tuple(GPU_PRESETS),
    "strategy": tuple(STRATEGY_LABELS),
    "finetune": tuple(FINETUNE_LABELS),
    "quant_type": QUANT_TYPES,
}
_POSITIVE_INTS = ("num_labels", "batch_size", "seq_len", "target_len", "grad_accum", "gpu_count", "lora_r")
_LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets")
_QLORA_KEYS = ("quant_type", "double_quant")
_MAX_TARGETS_CHARS = 500
_MIN_GIB = 0.01  # the GPU capacity widget's own minimum
# ASCII digits only ("²".isdigit() is true) and short enough for int() (4,300 digits at most).
_WHOLE_NUMBER = re.compile(r"\+?[0-9]{1,30}")


def encode(values: Mapping[str, object]) -> dict[str, str]:
    """Query parameters for the values that differ from the defaults (short links)."""
    params = {}
    # A stored upload's hash and a hub id belong to their own source only.
    source = values.get("model_source", DEFAULTS["model_source"])
    unused = {"config_hash": source != "upload", "hub_model_id": source != "hub"}
    # LoRA's settings belong to LoRA and QLoRA, QLoRA's to QLoRA only.
    method = values.get("finetune", DEFAULTS["finetune"])
    unused |= {key: method == Method.FULL.value for key in _LORA_KEYS}
    unused |= {key: method != Method.QLORA.value for key in _QLORA_KEYS}
    for key, default in DEFAULTS.items():
        value = values.get(key, default)
        if value == default or unused.get(key, False):
            continue
        params[key] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return params


def decode(params: Mapping[str, object]) -> dict[str, object]:
    """Widget values from query parameters; unknown keys and unparsable values are dropped."""
    return decode_with_rejects(params)[0]


def decode_with_rejects(params: Mapping[str, object]) -> tuple[dict[str, object], dict[str, str]]:
    """(widget values, {dropped key: why}) from query parameters; unknown keys are ignored."""
    values: dict[str, object] = {}
    rejected: dict[str, str] = {}
    for key, raw in params.items():
        if key not in DEFAULTS:
            continue
        if isinstance(raw, (list, tuple)):
            raw = raw[-1] if raw else ""
        text = str(raw).strip()
        parsed = _parse(key, text)
        if parsed is None:
            rejected[key] = _expected(key)
        else:
            values[key] = parsed
    return values, rejected


def rejects_warning(rejected: Mapping[str, str]) -> str:
    """One line naming the link's dropped keys and what each must be. Keys and reasons only,
    never the link's own text (which could carry Markdown into the page)."""
    return ("The link's " + "; ".join(f"{key} must be {why}" for key, why in rejected.items())
            + ": those kept their defaults.")


def _expected(key: str) -> str:
    """What a value for `key` must be (the page shows it for a dropped one; no user text)."""
    if key in _POSITIVE_INTS:
        return f"a whole number from 1 to {MAXIMA[key]:,}"
    if key in ("catalog_model", "gpu_preset"):
        return "a name from its list"
    if key == "config_hash":
        return "64 hexadecimal digits (a stored upload's SHA-256)"
    if key == "hub_model_id":
        return "a hub model id like owner/name"
    if key == "lora_alpha":
        return "a positive number (absent: 2 x the rank)"
    if key == "lora_dropout":
        return "a probability from 0 to below 1"
    if key == "lora_targets":
        return f"{ALL_LINEAR} or comma-separated module names"
    if key in _CHOICES:
        return "one of " + ", ".join(_CHOICES[key])
    if isinstance(DEFAULTS[key], bool):
        return "true or false"
    if isinstance(DEFAULTS[key], float):
        return f"a number from {_MIN_GIB} to {MAXIMA.get(key, float('inf')):,.0f}"
    return "a value this page can take"


def _parse(key: str, text: str) -> object | None:
    default = DEFAULTS[key]
    if key == "catalog_model":
        return text if text in catalog_entries() else None
    if key == "config_hash":
        return text.lower() if is_config_hash(text.lower()) else None
    if key == "hub_model_id":
        return text if is_hub_model_id(text) else None
    if key in _CHOICES:
        return text if text in _CHOICES[key] else None
    if key in ("lora_alpha", "lora_dropout"):
        try:
            number = float(text[:40])
        except ValueError:
            return None
        # The planner's own bounds (planner.finetune); both comparisons are false for NaN.
        ok = 0 < number < float("inf") if key == "lora_alpha" else 0 <= number < 1
        return number if ok else None
    if key == "lora_targets":
        if len(text) > _MAX_TARGETS_CHARS:
            return None
        try:
            parse_targets(text)
        except PlannerInputError:
            return None
        return text
    if isinstance(default, bool):
        return {"true": True, "false": False, "1": True, "0": False}.get(text.lower())
    if key in _POSITIVE_INTS:
        if not _WHOLE_NUMBER.fullmatch(text):
            return None
        number = int(text)
        return number if 1 <= number <= MAXIMA[key] else None
    if isinstance(default, float):
        try:
            number = float(text[:40])
        except ValueError:
            return None
        return number if _MIN_GIB <= number <= MAXIMA.get(key, float("inf")) else None  # also false for NaN
    return None
