"""Probe tables as shipped and as cached: what planner/catalog/probes/ ships equals a fresh
probe under the installed libraries; a cached table is found again; a broken or unwritable
cache costs a re-probe, never the answer."""

import itertools
import json

import pytest

from planner.estimate import Confidence, estimate
from planner.loading import load_model_shape, model_shape_for_config
from planner.probe import cache
from planner.probe.cache import SHIPPED_DIR, config_digest, probe_table, technique_key
from planner.probe.run import layout_for, record_probes
from planner.probe.solve import solve
from planner.scenario import Task, scenario_from_values
from planner.shapes_from_config import load_transformers_config


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "_MEMORY", {})


def _fresh(shape, scenario):
    config_dict = json.loads(shape.source_config)
    config = load_transformers_config(config_dict, scenario.task, scenario.num_labels)
    layout = layout_for(config)
    recordings = record_probes(config_dict, config, scenario, layout, cache.window_exceeded(shape, scenario),
                               gpu=cache.probe_gpu(scenario))
    return solve(recordings, layout, technique_key(shape, scenario))


@pytest.mark.parametrize("name,task,precision,device,capability", [
    ("distilbert-base-cased", Task.SEQUENCE_CLASSIFICATION, "fp32", "cpu", None),
    ("gpt2", Task.CAUSAL_LM, "bf16-mixed", "cpu", None),
    ("gpt2", Task.CAUSAL_LM, "bf16-mixed", "cuda", None),  # CUDA's kernels on fake tensors
    ("qwen2.5-0.5b", Task.CAUSAL_LM, "fp32", "cuda", None),
    # Probed again when the tracker stopped keeping gradients (the ones above were carried over:
    # scripts/carry_shipped_tables.py).
    ("bert-base-uncased", Task.SEQUENCE_CLASSIFICATION, "fp32", "cuda", None),
    # A T4's kernels (scripts/ship_kernel_classes.py): grouped-query attention on the math path,
    # stored in full; and GPT-2 in fp32, whose step is sm80's, stored as a reference to it.
    ("smollm2-135m", Task.CAUSAL_LM, "fp16-mixed", "cuda", "7.5"),
    ("gpt2", Task.CAUSAL_LM, "fp32", "cuda", "7.5"),
])
def test_shipped_table_equals_a_fresh_probe(name, task, precision, device, capability):
    shape = load_model_shape(name, task)
    scenario = scenario_from_values(task=task.value, batch_size=1, seq_len=8, device=device, precision=precision,
                                    compute_capability=capability)
    shipped = json.loads((SHIPPED_DIR / f"{config_digest(shape)}.json").read_text())
    key = technique_key(shape, scenario)
    assert key in shipped, "scripts/build_probe_tables.py was not re-run for the installed libraries"
    fresh = _fresh(shape, scenario).to_json()
    entry = shipped[key]
    if cache.SAME_AS in entry:  # another class's table, under that class's key
        entry = shipped[entry[cache.SAME_AS]] | {"key": key}
    if "trace" not in entry:
        fresh.pop("trace")  # the allocation trace is newer than the CPU tables, which load without it
    assert entry == fresh


@pytest.mark.parametrize("finetune", ["lora", "qlora"])
def test_shipped_adapter_table_equals_a_fresh_probe(finetune):
    """What fits' default LoRA and QLoRA classes ship for GPT-2 (scripts/build_probe_tables.py
    --adapters): one of each, over a bf16 base, probed again through PEFT on CUDA's kernels."""
    shape = load_model_shape("gpt2", Task.CAUSAL_LM)
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=8, device="cuda", precision="bf16",
                                    finetune=finetune)
    shipped = json.loads((SHIPPED_DIR / f"{config_digest(shape)}.json").read_text())
    key = technique_key(shape, scenario)
    assert key in shipped, "scripts/build_probe_tables.py --adapters was not re-run for the installed libraries"
    assert shipped[key] == cache._compute(shape, scenario, key).to_json()


def test_every_catalog_model_ships_its_default_table():
    from planner.catalog import catalog_entries

    missing = []
    for name, entry in catalog_entries().items():
        shape = load_model_shape(name, entry.default_task)
        tables = cache._read(SHIPPED_DIR / f"{config_digest(shape)}.json")
        for batch, device in itertools.product((1, 2), ("cpu", "cuda")):  # batch 1 is a class of its own
            scenario = scenario_from_values(task=entry.default_task.value, batch_size=batch, seq_len=8, device=device,
                                            attn="sdpa" if shape.supports_sdpa else "eager")
            if technique_key(shape, scenario) not in tables:
                missing.append(f"{name} at batch {batch} on {device}")
        # The Plan page's technique chart on CUDA: checkpointing in fp32 and bf16 autocast.
        for batch, precision in itertools.product((1, 2), ("fp32", "bf16-mixed")):
            scenario = scenario_from_values(task=entry.default_task.value, batch_size=batch, seq_len=8, device="cuda",
                                            attn="sdpa" if shape.supports_sdpa else "eager", precision=precision,
                                            gradient_checkpointing=True)
            if technique_key(shape, scenario) not in tables:
                missing.append(f"{name} checkpointing {precision} at batch {batch} on cuda")
        # On the dashboard's default T4 (scripts/ship_kernel_classes.py): its precisions and the
        # technique chart's bf16 autocast, with and without checkpointing.
        for batch, precision, checkpointing in itertools.product((1, 2), ("fp32", "fp16-mixed", "bf16-mixed"),
                                                                 (False, True)):
            scenario = scenario_from_values(task=entry.default_task.value, batch_size=batch, seq_len=8, device="cuda",
                                            attn="sdpa" if shape.supports_sdpa else "eager", precision=precision,
                                            gradient_checkpointing=checkpointing, compute_capability="7.5")
            if technique_key(shape, scenario) not in tables:
                missing.append(f"{name} {precision}, checkpointing {checkpointing}, at batch {batch} on a T4")
    assert not missing, missing


def test_a_shipped_class_the_probe_cannot_run_falls_back_at_once_with_its_reason(monkeypatch, tmp_path):
    """scripts/build_probe_tables.py ships the reason a class cannot be probed (store_unsupported),
    so a plan takes the recipe without probing (a probe here fails the test). The catalog ships
    none today; a shipped file holding one, as the script writes it, stands in."""
    from conftest import tiny_config
    from planner.probe import run

    shipped = tmp_path / "shipped"
    monkeypatch.setattr(cache, "SHIPPED_DIR", shipped)
    monkeypatch.setattr(run, "record_probes", lambda *a, **k: pytest.fail("probed a shipped class"))
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=64, device="cuda")
    shape = model_shape_for_config(tiny_config("tiny-llama"), scenario.task, 2, "tiny-llama")
    cache.store_unsupported(technique_key(shape, scenario), "a reason the shipping script met",
                            shipped / f"{config_digest(shape)}.json")
    assert cache.is_ready(shape, scenario)
    result = estimate(shape, scenario)
    assert result.confidence is Confidence.MODELLED  # LLaMA's recipe, labelled so
    assert any("a reason the shipping script met" in note and "recipe stands in" in note for note in result.notes)


def test_deberta_ships_its_cuda_tables_probed_with_the_batch_values(monkeypatch):
    """DeBERTa-v2's loss calls nonzero() on the labels: the catalog shipped that as a reason not
    to probe on CUDA's kernels until fake batches carried their values (test_batch_values.py)."""
    from planner.probe import run

    monkeypatch.setattr(run, "record_probes", lambda *a, **k: pytest.fail("probed a shipped class"))
    shape = load_model_shape("deberta-v3-base", Task.SEQUENCE_CLASSIFICATION)
    scenario = scenario_from_values(task="sequence-classification", batch_size=2, seq_len=64, device="cuda",
                                    attn="eager")
    assert cache.is_ready(shape, scenario)
    assert estimate(shape, scenario).confidence is Confidence.PROBED


def test_a_probed_table_is_cached_on_disk_and_read_back(tmp_path):
    from conftest import tiny_config

    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=16, device="cpu")
    shape = model_shape_for_config(tiny_config("tiny-gpt2"), scenario.task, 2, "tiny")
    first = estimate(shape, scenario)
    assert first.confidence is Confidence.PROBED
    assert (tmp_path / "probes" / f"{config_digest(shape)}.json").exists()
    cache._MEMORY.clear()
    assert probe_table(shape, scenario) == probe_table(shape, scenario)
    assert estimate(shape, scenario).peak_bytes == first.peak_bytes


def test_a_garbage_cache_file_is_probed_again(tmp_path):
    from conftest import tiny_config

    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=16, device="cpu")
    shape = model_shape_for_config(tiny_config("tiny-gpt2"), scenario.task, 2, "tiny")
    path = tmp_path / "probes" / f"{config_digest(shape)}.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert estimate(shape, scenario).confidence is Confidence.PROBED
    assert technique_key(shape, scenario) in json.loads(path.read_text())


def test_two_threads_probing_at_once_get_the_tables_one_thread_gets():
    """torch's module tracker hooks every module through global hooks: two probes on two threads
    (two dashboard sessions) saw each other's modules and failed (a KeyError on a weakref to the
    other model's Linear) or mis-recorded. Probes take turns; each thread shows only its own progress."""
    import threading

    jobs = {"distilbert-base-cased": (Task.SEQUENCE_CLASSIFICATION, 5), "qwen2.5-0.5b": (Task.CAUSAL_LM, 2)}
    cases = {}
    for name, (task, labels) in jobs.items():
        shape = load_model_shape(name, task, labels)
        scenario = scenario_from_values(task=task.value, num_labels=labels, batch_size=2, seq_len=8, device="cuda",
                                        attn="eager")
        assert not cache.is_ready(shape, scenario)  # neither class ships: both threads probe
        cases[name] = (shape, scenario)
    results, lines, errors = {}, {name: [] for name in jobs}, []
    start = threading.Barrier(len(jobs))

    def probe(name):
        try:
            with cache.probe_progress(lines[name].append):
                start.wait()
                results[name] = probe_table(*cases[name])
        except BaseException as error:  # the assertion below names it
            errors.append(error)

    threads = [threading.Thread(target=probe, args=(name,)) for name in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for name, (shape, scenario) in cases.items():
        assert not isinstance(results[name], str), results[name]
        assert results[name].to_json() == _fresh(shape, scenario).to_json()
        others = [other for other in jobs if other != name]
        assert any(line.startswith(f"probing {name} ") for line in lines[name]), lines[name]
        assert not any(other in line for other in others for line in lines[name]), lines[name]


def _built_parameters(config_dict: dict) -> list[tuple[str, tuple[int, ...], str]]:
    import torch
    import transformers

    config = load_transformers_config(config_dict, Task.CAUSAL_LM, 2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return [(name, tuple(p.shape), type(model).__name__) for name, p in model.named_parameters()]


def test_a_renamed_catalog_config_reads_the_catalog_s_tables_and_a_changed_one_does_not():
    """A fine-tune saved under another name, class list and transformers version: transformers
    builds the same model from it, so it is planned from the shipped tables with no probe."""
    catalog = load_model_shape("gpt2", Task.CAUSAL_LM)
    config = json.loads(catalog.source_config)
    renamed = {**config, "_name_or_path": "someone/gpt2-finetuned", "architectures": ["GPT2ForSequenceClassification"],
               "transformers_version": "4.40.0"}
    assert _built_parameters(renamed) == _built_parameters(config)
    shape = model_shape_for_config(renamed, Task.CAUSAL_LM, 2, "renamed")
    scenario = scenario_from_values(task="causal-lm", batch_size=4, seq_len=128, device="cuda",
                                    precision="bf16-mixed", gradient_checkpointing=True)
    assert cache.is_ready(shape, scenario)  # shipped: no probe will run
    assert estimate(shape, scenario).peak_bytes == estimate(catalog, scenario).peak_bytes
    deeper = model_shape_for_config({**renamed, "n_layer": config["n_layer"] + 1}, Task.CAUSAL_LM, 2, "deeper")
    assert config_digest(deeper) != config_digest(shape) and not cache.is_ready(deeper, scenario)
