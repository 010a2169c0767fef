"""planner.build_guard: a config is sized before anything is built, from every field its
architecture's config class holds, and refused in one line when no real model is that
large; configs the planner cannot model (no attention heads, heads that do not group,
probabilities outside [0, 1]) are refused in one line too (issue 15, items 1, 2 and 8)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from planner.build_guard import MAX_LAYERS, check_build_size, module_budget
from planner.errors import PlannerInputError
from planner.loading import model_shape_for_config
from planner.scenario import Task
from planner.shapes_from_config import load_transformers_config
from tests.conftest import ROOT

SMALL_T5 = {"model_type": "t5", "d_model": 64, "d_kv": 32, "d_ff": 128, "num_heads": 2, "vocab_size": 100}
SMALL_BART = {"model_type": "bart", "d_model": 64, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
              "encoder_attention_heads": 2, "decoder_attention_heads": 2, "vocab_size": 100}
SMALL_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 100}
SMALL_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "intermediate_size": 128, "vocab_size": 100}

# The reproductions: each was built (for minutes, or into tens of trillions of
# parameters) or raised outside PlannerInputError before the guard.
TOO_LARGE = {
    "t5 num_layers 100000": ({**SMALL_T5, "num_layers": 100_000}, "'num_layers' (alias 'num_hidden_layers') = 100,000 layers"),
    "t5 num_decoder_layers 100000": ({**SMALL_T5, "num_decoder_layers": 100_000}, "'num_decoder_layers'"),
    "bart encoder_layers 100000": ({**SMALL_BART, "encoder_layers": 100_000}, "'encoder_layers' (alias 'num_hidden_layers') = 100,000"),
    "gpt2 n_positions 10**12": ({**SMALL_GPT2, "n_positions": 10**12}, "'n_positions' (alias 'max_position_embeddings') = 1,000,000,000,000"),
    "t5 d_ff 10**12": ({**SMALL_T5, "d_ff": 10**12}, "'d_ff' = 1,000,000,000,000"),
    # Each layer count within bounds, together beyond them.
    "bart 400 + 400 layers": ({**SMALL_BART, "encoder_layers": 400, "decoder_layers": 400}, "800 layers in all"),
    # Under its standard alias (attribute_map), and inside a sub-config.
    "gpt2 max_position_embeddings 10**12": ({**SMALL_GPT2, "max_position_embeddings": 10**12},
                                            "'n_positions' (alias 'max_position_embeddings')"),
    "llava text_config 100000 layers": ({"model_type": "llava", "text_config": {"model_type": "llama",
                                                                                "num_hidden_layers": 100_000}},
                                        "'text_config.num_hidden_layers' = 100,000 layers"),
    # Under the single-size bound, but one matrix alone above a trillion elements.
    "gpt2 vocab x width": ({**SMALL_GPT2, "n_embd": 1 << 20, "vocab_size": 1 << 24}, "times the width"),
}
NOT_PLANNABLE = {
    "kv heads 3 with 4 heads": ({**SMALL_LLAMA, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    "mamba": ({"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100},
              "has no num_attention_heads"),
    "rwkv": ({"model_type": "rwkv", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100},
             "has no num_attention_heads"),
    "partial_rotary_factor abc": ({**SMALL_LLAMA, "partial_rotary_factor": "abc"}, "'partial_rotary_factor'"),
    "dropout NaN": ({**SMALL_GPT2, "resid_pdrop": float("nan")}, "'resid_pdrop' = nan must be a probability"),
    "dropout 5.0": ({**SMALL_GPT2, "attn_pdrop": 5.0}, "'attn_pdrop' = 5.0 must be a probability"),
    "dropout negative": ({**SMALL_LLAMA, "attention_dropout": -0.1}, "must be a probability"),
}


@pytest.mark.parametrize("config, expected", TOO_LARGE.values(), ids=TOO_LARGE.keys())
def test_oversized_configs_are_refused_before_building(config, expected):
    with pytest.raises(PlannerInputError, match="beyond any real model") as error:
        load_transformers_config(config, Task.SEQUENCE_CLASSIFICATION, 2)
    assert expected in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("config, expected", NOT_PLANNABLE.values(), ids=NOT_PLANNABLE.keys())
def test_configs_the_planner_cannot_model_are_one_line_errors(config, expected):
    with pytest.raises(PlannerInputError) as error:
        model_shape_for_config(config, Task.CAUSAL_LM)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_every_default_config_of_the_catalog_architectures_passes():
    """The bounds sit above every real model: the bundled catalog and transformers' own
    defaults for the catalog's architectures are all accepted."""
    from planner.catalog import catalog_config, catalog_entries

    for name in catalog_entries():
        load_transformers_config(catalog_config(name), Task.CAUSAL_LM, 2)
    from transformers import AutoConfig

    for model_type in ("t5", "bart", "gpt2", "llama", "mixtral", "qwen2_moe", "esm", "switch_transformers"):
        check_build_size(AutoConfig.for_model(model_type))


def test_layer_indices_in_lists_are_not_counted_as_layers():
    """Qwen2-MoE's `mlp_only_layers` lists layer indices: 0..27 sum past any bound, yet
    describe the same 28 layers."""
    config = {"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 28, "num_attention_heads": 4,
              "intermediate_size": 128, "vocab_size": 100, "mlp_only_layers": list(range(28))}
    load_transformers_config(config, Task.CAUSAL_LM, 2)


# Run in a child under a 2 GiB address-space limit: the worst configs above are refused,
# and the deepest the guard accepts is built, each within 10 s.
_WORST_CASES = textwrap.dedent("""
    import json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    from planner.errors import PlannerInputError
    from planner.loading import model_shape_for_config
    from planner.scenario import Task
    report = []
    for config in json.loads(sys.argv[1]):
        start = time.monotonic()
        try:
            model_shape_for_config(config, Task.SEQUENCE_CLASSIFICATION)
            answer = "built"
        except PlannerInputError as error:
            answer = str(error)
        report.append([answer, time.monotonic() - start])
    # This program's own peak resident memory: VmHWM starts again at exec, where ru_maxrss also
    # keeps the forking pytest worker's (gigabytes late in a run, shared pages counted).
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    report.append(peak)
    print(json.dumps(report))
""")


def test_worst_configs_are_answered_within_10_s_and_2_gib():
    deepest = {**SMALL_T5, "num_layers": MAX_LAYERS // 2, "num_decoder_layers": MAX_LAYERS // 2}
    configs = [config for config, _ in TOO_LARGE.values()] + [deepest]
    done = subprocess.run([sys.executable, "-c", _WORST_CASES, json.dumps(configs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    *answers, max_rss = json.loads(done.stdout.splitlines()[-1])
    assert [answer == "built" for answer, _ in answers] == [False] * len(TOO_LARGE) + [True], answers
    assert all(seconds < 10 for _, seconds in answers), answers
    assert max_rss < 2 << 30


def test_a_count_the_names_do_not_reveal_is_stopped_while_building():
    """ALBERT's `inner_group_num` is not named as layers: 4,096 inner groups built for 40 s
    before the module budget stopped it."""
    config = {"model_type": "albert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 64, "vocab_size": 100, "inner_group_num": 4096}
    # The real budget, scaled down so the test stays fast.
    with pytest.raises(PlannerInputError, match="more than 2,000 modules"), module_budget(2_000):
        model_shape_for_config(config, Task.SEQUENCE_CLASSIFICATION)


def test_the_module_budget_counts_only_its_own_thread():
    import threading

    import torch

    def another_session_builds():
        torch.nn.Sequential(*[torch.nn.Linear(1, 1) for _ in range(3)])

    with module_budget(1):
        other = threading.Thread(target=another_session_builds)
        other.start()
        other.join()  # three registrations on another thread: not ours to count
        torch.nn.Sequential(torch.nn.Linear(1, 1))  # one here: within the budget
        with pytest.raises(PlannerInputError, match="more than 1 modules"):
            torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
