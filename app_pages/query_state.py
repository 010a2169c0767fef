"""Sidebar values <-> the URL query string, so a plan can be shared as a link (no Streamlit
here: app.py passes st.query_params in and out).

Only keys of inputs.DEFAULTS travel, each parsed back to its default's type; a value that
does not parse, or names no catalog model / GPU preset / choice, is dropped (its widget
keeps its default) rather than breaking the page. The uploaded config cannot travel in a
link: a shared upload-plan opens on the upload source, waiting for the file.
"""

from __future__ import annotations

from collections.abc import Mapping

from app_pages.inputs import (DEFAULTS, GPU_PRESETS, MODEL_SOURCE_LABELS, OPTIMIZER_LABELS, PRECISION_LABELS,
                              STRATEGY_LABELS)
from planner.catalog import catalog_entries
from planner.scenario import Attention, Device, Task

_CHOICES: dict[str, tuple[str, ...]] = {
    "model_source": tuple(MODEL_SOURCE_LABELS),
    "task": tuple(t.value for t in Task),
    "optimizer": tuple(OPTIMIZER_LABELS),
    "precision": tuple(PRECISION_LABELS),
    "attn": tuple(a.value for a in Attention),
    "device": tuple(d.value for d in Device),
    "gpu_preset": tuple(GPU_PRESETS),
    "strategy": tuple(STRATEGY_LABELS),
}
_POSITIVE_INTS = ("num_labels", "batch_size", "seq_len", "grad_accum", "gpu_count")
_MAXIMA = {"gpu_count": 4096}  # the widget's own max_value


def encode(values: Mapping[str, object]) -> dict[str, str]:
    """Query parameters for the values that differ from the defaults (short links)."""
    params = {}
    for key, default in DEFAULTS.items():
        value = values.get(key, default)
        if value == default:
            continue
        params[key] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return params


def decode(params: Mapping[str, object]) -> dict[str, object]:
    """Widget values from query parameters; unknown keys and unparsable values are dropped."""
    values: dict[str, object] = {}
    for key, raw in params.items():
        if key not in DEFAULTS:
            continue
        if isinstance(raw, (list, tuple)):
            raw = raw[-1] if raw else ""
        text = str(raw).strip()
        parsed = _parse(key, text)
        if parsed is not None:
            values[key] = parsed
    return values


def _parse(key: str, text: str) -> object | None:
    default = DEFAULTS[key]
    if key == "catalog_model":
        return text if text in catalog_entries() else None
    if key in _CHOICES:
        return text if text in _CHOICES[key] else None
    if isinstance(default, bool):
        return {"true": True, "false": False, "1": True, "0": False}.get(text.lower())
    if key in _POSITIVE_INTS:
        return int(text) if text.isdigit() and 1 <= int(text) <= _MAXIMA.get(key, float("inf")) else None
    if isinstance(default, float):
        try:
            number = float(text)
        except ValueError:
            return None
        return number if 0.01 <= number < float("inf") else None  # the widget's own minimum
    return None
