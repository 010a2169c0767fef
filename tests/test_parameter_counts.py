"""Exact parameter shapes from configs alone: counts equal the published ones.

Published counts (sum of p.numel() over model.parameters(), tied weights once), from the
model cards / papers: GPT-2 family (OpenAI 2019, HF model cards), Llama 2 (Touvron et al.
2023, meta-llama cards), Mistral 7B, Llama 3.x (meta-llama cards), TinyLlama, OPT
(Zhang et al. 2022), Pythia (Biderman et al. 2023, table 1 "total params"), Qwen2.5,
Gemma, Phi-2, and distilbert-base-cased with the lesson's 2-label head.
"""

import pytest

from planner.catalog import catalog_entries
from planner.loading import load_model_shape
from planner.scenario import Task

PUBLISHED = {
    ("gpt2", Task.CAUSAL_LM): 124_439_808,
    ("gpt2-xl", Task.CAUSAL_LM): 1_557_611_200,
    ("llama-2-7b", Task.CAUSAL_LM): 6_738_415_616,
    ("llama-2-70b", Task.CAUSAL_LM): 68_976_648_192,
    ("mistral-7b-v0.1", Task.CAUSAL_LM): 7_241_732_096,
    ("llama-3.1-8b", Task.CAUSAL_LM): 8_030_261_248,
    ("llama-3.2-1b", Task.CAUSAL_LM): 1_235_814_400,
    ("tinyllama-1.1b", Task.CAUSAL_LM): 1_100_048_384,
    ("opt-125m", Task.CAUSAL_LM): 125_239_296,
    ("pythia-160m", Task.CAUSAL_LM): 162_322_944,
    ("qwen2.5-0.5b", Task.CAUSAL_LM): 494_032_768,
    ("gemma-2b", Task.CAUSAL_LM): 2_506_172_416,
    ("phi-2", Task.CAUSAL_LM): 2_779_683_840,
    ("distilbert-base-cased", Task.SEQUENCE_CLASSIFICATION): 65_783_042,
}


@pytest.mark.parametrize("name,task", list(PUBLISHED))
def test_parameter_count_matches_published(name, task):
    assert load_model_shape(name, task, 2).num_parameters == PUBLISHED[(name, task)]


def test_tied_embeddings_counted_once():
    shape = load_model_shape("gpt2", Task.CAUSAL_LM)
    assert shape.tied_embeddings
    assert sum(1 for p in shape.params if p.shape == (50257, 768)) == 1


def test_catalog_is_broad_and_buildable():
    entries = catalog_entries()
    assert len(entries) >= 20
    families = {e.family for e in entries.values()}
    assert {"encoder", "gpt2", "opt", "gpt-neox", "llama"} <= families
    sizes = []
    for entry in entries.values():
        shape = load_model_shape(entry.name, entry.default_task, 2)
        sizes.append(shape.num_parameters)
    assert min(sizes) < 150_000_000 and max(sizes) > 60_000_000_000
