"""scripts/reprobe_shipped.py reads each shipped class back from its key: for every shipped
table (CPU and CUDA kernels), the scenario it reads gives the same key again
(cache.technique_key), so that re-probing after a format change rebuilds exactly the classes
that were shipped."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import reprobe_shipped  # noqa: E402

from planner.probe import cache  # noqa: E402


def test_every_shipped_class_key_is_read_back_as_its_scenario():
    by_digest = reprobe_shipped.models_by_digest()
    checked = 0
    for path in sorted(cache.SHIPPED_DIR.glob("*.json")):
        for key in cache._read(path):
            if key.startswith("optimizer-step|"):
                continue
            assert path.stem in by_digest, f"{path.name}: no catalog model"
            assert any(cache.technique_key(shape, reprobe_shipped.scenario_of(key, shape)) == key
                       for _, shape in by_digest[path.stem]), key
            checked += 1
    assert checked >= 1300


def test_the_carry_scan_names_the_modules_whose_inputs_get_their_gradients_apart():
    """scripts/carry_shipped_tables.py carries a model's tables over unprobed only when its step
    calls no module with gradient-requiring inputs from distinct autograd nodes: BERT's output
    modules take the residual beside the branch; GPT-2's blocks take one hidden state."""
    import carry_shipped_tables

    from planner.loading import load_model_shape
    from planner.scenario import Task, scenario_from_values

    def scan(name, task):
        scenario = scenario_from_values(task=task.value, batch_size=1, seq_len=8, device="cpu")
        return carry_shipped_tables.modules_with_inputs_from_distinct_nodes(load_model_shape(name, task), scenario)

    assert scan("bert-base-cased", Task.SEQUENCE_CLASSIFICATION) == ["BertOutput", "BertSelfOutput"]
    assert scan("gpt2", Task.CAUSAL_LM) == []
