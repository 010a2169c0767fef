"""The catalog's shipped model shapes (planner/catalog/shapes/) equal fresh meta-device builds,
for every label count, and planning a catalog model imports neither torch nor transformers."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from planner.catalog import catalog_config, catalog_entries
from planner.errors import PlannerInputError
from planner.scenario import Task
from planner.shapes_from_config import build_model_shape
from planner.shipped_shapes import shape_file, shape_to_json, shipped_shape

ROOT = Path(__file__).resolve().parents[1]


def _source(name: str) -> str:
    return json.dumps(catalog_config(name), sort_keys=True, default=str)


def _same(shipped, built) -> None:
    assert shipped is not None, "scripts/build_shape_tables.py was not re-run for the installed transformers"
    assert shipped.name == built.name and shipped.source_config == built.source_config
    assert shape_to_json(shipped) == shape_to_json(built)
    assert shipped.stats == built.stats


@pytest.mark.parametrize("name", list(catalog_entries()))
def test_every_catalog_task_is_shipped(name):
    for task in Task:
        assert shape_file(_source(name), task).is_file(), f"{name} {task.value}: not shipped"


@pytest.mark.parametrize("name", list(catalog_entries()))
def test_shipped_default_task_equals_a_fresh_build(name):
    task = catalog_entries()[name].default_task
    _same(shipped_shape(_source(name), task, 2, name), build_model_shape(catalog_config(name), task, 2, name))


def test_shipped_shapes_for_other_tasks_and_label_counts():
    """Random (model, task, labels): the label dimensions substituted give the head a fresh build has."""
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    for name in rng.sample(list(catalog_entries()), 6):
        task = rng.choice(list(Task))
        labels = rng.randint(1, 40)
        try:
            built = build_model_shape(catalog_config(name), task, labels, name)
        except PlannerInputError as error:
            with pytest.raises(PlannerInputError) as shipped_error:
                shipped_shape(_source(name), task, labels, name)
            assert str(shipped_error.value) == str(error), f"seed {seed}: {name} {task.value}"
            continue
        _same(shipped_shape(_source(name), task, labels, name), built)


def test_shipped_adapter_counts_equal_peft_s_own():
    """Random catalog models at their default task: the shipped count (or refusal) is PEFT's."""
    from planner.adapters import built_adapter_count
    from planner.finetune import FineTune, Method
    from planner.shipped_adapters import SHIPPED_DTYPES, shipped_count

    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    finetune = FineTune(method=Method.LORA)
    for name in rng.sample(list(catalog_entries()), 4):
        task, dtype = catalog_entries()[name].default_task, rng.choice(SHIPPED_DTYPES)
        try:
            built = built_adapter_count(_source(name), task, 2, finetune, dtype)
        except PlannerInputError as error:
            with pytest.raises(PlannerInputError) as shipped_error:
                shipped_count(_source(name), task, 2, finetune, dtype)
            assert str(shipped_error.value) == str(error), f"seed {seed}: {name}"
            continue
        assert shipped_count(_source(name), task, 2, finetune, dtype) == built, f"seed {seed}: {name} {dtype}"
    # Other settings are not shipped: they are built.
    assert shipped_count(_source("gpt2"), Task.CAUSAL_LM, 2, FineTune(method=Method.LORA, lora_r=8), "float32") is None


def test_shipped_quantized_bases_equal_bitsandbytes_own():
    """Random catalog models at their default task: the shipped QLoRA base (or refusal) is
    what transformers' bitsandbytes integration makes of the model."""
    from planner.adapters import built_quantized_base
    from planner.shipped_adapters import SHIPPED_QUANTIZATION, shipped_quantized

    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    quant_type, double_quant = SHIPPED_QUANTIZATION
    for name in rng.sample(list(catalog_entries()), 3):
        task = catalog_entries()[name].default_task
        try:
            built = built_quantized_base(_source(name), task, 2, double_quant, quant_type)
        except PlannerInputError as error:
            with pytest.raises(PlannerInputError) as shipped_error:
                shipped_quantized(_source(name), task, 2, double_quant, quant_type)
            assert str(shipped_error.value) == str(error), f"seed {seed}: {name}"
            continue
        assert shipped_quantized(_source(name), task, 2, double_quant, quant_type) == built, f"seed {seed}: {name}"
    # Other settings are not shipped: they are built.
    assert shipped_quantized(_source("gpt2"), Task.CAUSAL_LM, 2, double_quant, "fp4") is None
    assert shipped_quantized(_source("gpt2"), Task.CAUSAL_LM, 2, not double_quant, quant_type) is None


def test_a_shape_built_under_another_transformers_is_not_read(tmp_path, monkeypatch):
    import planner.shipped_shapes as shipped

    name = "gpt2"
    source = _source(name)
    record = json.loads(shape_file(source, Task.CAUSAL_LM).read_text())
    record["transformers"] = "0.0.1"
    monkeypatch.setattr(shipped, "SHAPES_DIR", tmp_path)
    shape_file(source, Task.CAUSAL_LM).write_text(json.dumps(record))
    assert shipped_shape(source, Task.CAUSAL_LM, 2, name) is None


def test_planning_a_catalog_model_imports_neither_torch_nor_transformers(tmp_path):
    """An estimate, the largest batch and sequence, What fits' search with its LoRA plans (the
    dashboard's default model, which PEFT refuses all-linear LoRA for), and a CUDA search
    that proposes QLoRA plans (their quantised bases shipped), each answer tested by the
    caching allocator's replay: none imports torch, transformers, PEFT or bitsandbytes, with
    nothing cached but what the catalog ships."""
    script = (
        "import sys\n"
        "from planner.loading import load_model_shape\n"
        "from planner.estimate import estimate\n"
        "from planner.fit import fit_limits\n"
        "from planner.scenario import Task, scenario_from_values\n"
        "shape = load_model_shape('llama-2-7b', Task.CAUSAL_LM)\n"
        "scenario = scenario_from_values(task='causal-lm', batch_size=4, seq_len=512)\n"
        "estimate(shape, scenario)\n"
        "fit_limits(shape, scenario, 80 * 2**30)\n"
        "from planner.fit import FitTarget, find_fits\n"
        "from planner.gpus import GPUS, scenario_on\n"
        "bert = load_model_shape('distilbert-base-cased', Task.SEQUENCE_CLASSIFICATION)\n"
        "base = scenario_on(scenario_from_values(task='sequence-classification', batch_size=8, seq_len=512), "
        "GPUS['t4'])\n"
        "fits = find_fits(bert, base, 15 * 2**30, FitTarget(seq_len=512, effective_batch=8), GPUS['t4'])\n"
        "assert any('LoRA plans left out: PEFT refuses' in line for line in fits.left_out), fits.left_out\n"
        "from planner.device_fit import reserved_check\n"
        "from planner.finetune import Method\n"
        "from planner.verdict import room_for_plans\n"
        "gpt2, a10 = load_model_shape('gpt2', Task.CAUSAL_LM), GPUS['a10']\n"
        "base = scenario_on(scenario_from_values(task='causal-lm', batch_size=1, seq_len=512), a10)\n"
        "fits = find_fits(gpt2, base, a10.capacity_bytes, FitTarget(512), a10, room_for=room_for_plans(\n"
        "    a10.capacity_bytes, base.device, a10), check=reserved_check(a10.capacity_bytes, base.device, a10))\n"
        "assert any(o.scenario.finetune.method is Method.QLORA for o in fits.options), fits.options\n"
        "print(sorted(m for m in ('torch', 'transformers', 'peft', 'bitsandbytes') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PLANNER_DATA_DIR": str(tmp_path / "data")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
