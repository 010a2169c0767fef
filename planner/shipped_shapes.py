"""Model shapes shipped for the catalog, so planning a catalog model never imports torch or
transformers (importing them costs seconds; the dashboard's first page waited on it).

A shape is what `planner.shapes_from_config.build_model_shape` derives from the meta-device
build; it depends on the config, the task, the number of labels and transformers' version
(the classes it builds). planner/catalog/shapes/ holds one file per (config, task), written
by scripts/build_shape_tables.py and found only under the transformers version it was built
with; anything else is built as before.

Labels: a classification head's tensors have `num_labels` rows. The file records which
dimensions those are, found by building the head twice (2 and 3 labels) and seeing which
dimensions changed, so any label count is the shipped shape with those dimensions set.
tests/test_shipped_shapes.py checks the shipped shapes, and label counts, against fresh builds.
"""

from __future__ import annotations

import functools
import json
from importlib import metadata
from pathlib import Path

from planner.config_identity import config_table_digest
from planner.errors import PlannerInputError
from planner.model_shape import (ArchFamily, FsdpUnit, FsdpUnitKind, MlpKind, ModelShape, NormKind,
                                 ParamTensor)
from planner.scenario import Task

SHAPES_DIR = Path(__file__).resolve().parent / "catalog" / "shapes"
SHAPE_FORMAT = 1
# Built twice with these label counts to find the label dimensions; the shipped shape is the first.
LABEL_PROBES = (2, 3)

_SCALARS = ("model_type", "architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "intermediate_size", "vocab_size", "max_positions", "activation", "hidden_dropout",
            "attention_dropout", "embedding_dropout", "rotary_fraction", "tied_embeddings",
            "float_buffer_elements", "other_buffer_bytes", "embedding_elements", "sliding_window",
            "supports_sdpa")


def shape_file(source_config: str, task: Task) -> Path:
    """Where the shape of this canonical config JSON under `task` is shipped."""
    return SHAPES_DIR / f"{config_table_digest(source_config, task.value)}.json"


@functools.cache
def _transformers_version() -> str:
    return metadata.version("transformers")


def shape_to_json(shape: ModelShape) -> dict:
    """Every field of `shape` but its name and config (the caller has both), as JSON values."""
    record = {name: getattr(shape, name) for name in _SCALARS}
    record.update(
        family=shape.family.value, task=shape.task.value, num_labels=shape.num_labels,
        params=[[p.name, list(p.shape)] for p in shape.params],
        mlp=shape.mlp.value, norm=shape.norm.value,
        embedding_param_names=sorted(shape.embedding_param_names),
        fsdp_units=[[unit.kind.value, sorted(unit.param_names)] for unit in shape.fsdp_units],
    )
    if not shape.supports_checkpointing:  # written only when False: every catalog model supports it
        record["supports_checkpointing"] = False
    return record


def shape_from_json(record: dict, source_config: str, name: str, num_labels: int,
                    label_dims: list[list[int]]) -> ModelShape:
    """The shape `record` holds, with `num_labels` rows in each (param, dim) of `label_dims`."""
    dims = [list(shape) for _, shape in record["params"]]
    for param_index, dim_index in label_dims:
        dims[param_index][dim_index] = num_labels
    params = tuple(ParamTensor(param_name, tuple(d)) for (param_name, _), d in zip(record["params"], dims))
    return ModelShape(
        name=name, family=ArchFamily(record["family"]), task=Task(record["task"]), num_labels=num_labels,
        params=params, mlp=MlpKind(record["mlp"]), norm=NormKind(record["norm"]),
        embedding_param_names=frozenset(record["embedding_param_names"]),
        fsdp_units=tuple(FsdpUnit(FsdpUnitKind(kind), frozenset(names)) for kind, names in record["fsdp_units"]),
        source_config=source_config, supports_checkpointing=record.get("supports_checkpointing", True),
        **{field: record[field] for field in _SCALARS},
    )


def label_dimensions(with_two: ModelShape, with_three: ModelShape) -> list[list[int]]:
    """[param index, dim index] of every dimension that is the label count (2 in one build, 3 in
    the other); a head whose tensors differ otherwise cannot be shipped this way."""
    if [p.name for p in with_two.params] != [p.name for p in with_three.params]:
        raise ValueError(f"{with_two.name}: the parameters differ by label count, not only their sizes")
    positions = []
    for index, (two, three) in enumerate(zip(with_two.params, with_three.params)):
        if len(two.shape) != len(three.shape):
            raise ValueError(f"{two.name}: its rank differs by label count")
        for dim, (a, b) in enumerate(zip(two.shape, three.shape)):
            if a != b:
                if (a, b) != LABEL_PROBES:
                    raise ValueError(f"{two.name}: dimension {dim} is {a} and {b}, not the label count")
                positions.append([index, dim])
    return positions


def shipped_file_record(source_config: str, task: Task, shapes: list[ModelShape]) -> dict:
    """The file's content for the builds of `source_config` under `task` with LABEL_PROBES labels
    (one build for tasks without labels)."""
    label_dims = label_dimensions(*shapes) if task.uses_labels else []
    return {"format": SHAPE_FORMAT, "transformers": _transformers_version(), "task": task.value,
            "label_dims": label_dims, "shape": shape_to_json(shapes[0])}


def refused_file_record(task: Task, error: PlannerInputError) -> dict:
    """The file's content for a task transformers cannot build this config for: the build's error."""
    return {"format": SHAPE_FORMAT, "transformers": _transformers_version(), "task": task.value,
            "error": str(error)}


def shipped_shape(source_config: str, task: Task, num_labels: int, name: str) -> ModelShape | None:
    """The shipped shape of this config and task, or None when none was shipped for it under
    the installed transformers (then it is built). Raises the build's one-line error where
    transformers has no such model (a task without a head)."""
    path = shape_file(source_config, task)
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if record.get("format") != SHAPE_FORMAT or record.get("transformers") != _transformers_version():
        return None
    if "error" in record:
        raise PlannerInputError(record["error"])
    return shape_from_json(record["shape"], source_config, name, num_labels, record["label_dims"])
