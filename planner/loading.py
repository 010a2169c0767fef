"""Model shapes by source, cached: building a shape takes up to a second (the meta-device
build, after seconds importing torch and transformers), an estimate microseconds, so the
same (config, task, labels) is built once, and the catalog's are shipped
(planner.shipped_shapes)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from planner.config_source import resolve_config
from planner.model_shape import ModelShape
from planner.scenario import Task
from planner.shipped_shapes import shipped_shape

_SHAPES: dict[tuple[str, Task, int], ModelShape] = {}
_MAX_CACHED_SHAPES = 64


def model_shape_for_config(config: dict, task: Task, num_labels: int = 2, name: str = "model") -> ModelShape:
    source_config = json.dumps(config, sort_keys=True, default=str)
    key = (source_config, task, num_labels if task.uses_labels else 0)
    shape = _SHAPES.get(key)
    if shape is None:
        # The catalog's shapes are shipped; only other configs import torch to be built.
        shape = shipped_shape(source_config, task, num_labels, name)
    if shape is None:
        from planner.shapes_from_config import build_model_shape

        shape = build_model_shape(config, task, num_labels, name)
    if key not in _SHAPES:
        if len(_SHAPES) >= _MAX_CACHED_SHAPES:
            _SHAPES.pop(next(iter(_SHAPES)))
        _SHAPES[key] = shape
    # The same config under another name (an upload renamed) reuses the built shapes.
    return shape if shape.name == name else dataclasses.replace(shape, name=name)


def load_model_shape(source: str, task: Task, num_labels: int = 2, base_dir: Path | None = None,
                     allow_hub: bool = False) -> ModelShape:
    """ModelShape for a catalog name, a config.json path or (when allowed) a hub id."""
    config, name = resolve_config(source, base_dir=base_dir, allow_hub=allow_hub)
    return model_shape_for_config(config, task, num_labels, name)
