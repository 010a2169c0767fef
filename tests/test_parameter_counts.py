"""Exact parameter shapes from configs alone: counts equal the published ones.

Published counts (sum of p.numel() over model.parameters(), tied weights once), from the
model cards / papers: GPT-2 family (OpenAI 2019, HF model cards), Llama 2 (Touvron et al.
2023, meta-llama cards), Mistral 7B, Llama 3.x (meta-llama cards), TinyLlama, OPT
(Zhang et al. 2022), Pythia (Biderman et al. 2023, table 1 "total params"), Qwen2.5,
Gemma, Phi-2, and distilbert-base-cased with the lesson's 2-label head. Added with the
larger catalog: Gemma 2 / Gemma 3 1B, Qwen3, Phi-3(.5)-mini, Mixtral 8x7B, Qwen1.5-MoE
(model cards, each exact count matching KerasHub's preset metadata), SmolLM2 / SmolLM3,
OLMoE, Mistral NeMo (hub safetensors metadata), OPT-350M, Pythia-410M / 2.8B (paper
table 1), GPT-Neo 125M. Where planner/catalog/index.json has no exact count for the class
the planner builds, the model is not listed here.
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
    ("gemma-2-2b", Task.CAUSAL_LM): 2_614_341_888,
    ("gemma-2-9b", Task.CAUSAL_LM): 9_241_705_984,
    ("gemma-3-1b", Task.CAUSAL_LM): 999_885_952,
    ("qwen3-0.6b", Task.CAUSAL_LM): 596_049_920,
    ("qwen3-1.7b", Task.CAUSAL_LM): 1_720_574_976,
    ("qwen3-4b", Task.CAUSAL_LM): 4_022_468_096,
    ("qwen3-8b", Task.CAUSAL_LM): 8_190_735_360,
    ("phi-3-mini-4k-instruct", Task.CAUSAL_LM): 3_821_079_552,
    ("phi-3.5-mini-instruct", Task.CAUSAL_LM): 3_821_079_552,
    ("smollm2-135m", Task.CAUSAL_LM): 134_515_008,
    ("smollm2-360m", Task.CAUSAL_LM): 361_821_120,
    ("smollm2-1.7b", Task.CAUSAL_LM): 1_711_376_384,
    ("smollm3-3b", Task.CAUSAL_LM): 3_075_098_624,
    ("mixtral-8x7b-v0.1", Task.CAUSAL_LM): 46_702_792_704,
    ("qwen1.5-moe-a2.7b", Task.CAUSAL_LM): 14_315_784_192,
    ("olmoe-1b-7b", Task.CAUSAL_LM): 6_919_161_856,
    ("mistral-nemo-12b", Task.CAUSAL_LM): 12_247_782_400,
    ("opt-350m", Task.CAUSAL_LM): 331_196_416,
    ("pythia-410m", Task.CAUSAL_LM): 405_334_016,
    ("pythia-2.8b", Task.CAUSAL_LM): 2_775_208_960,
    ("gpt-neo-125m", Task.CAUSAL_LM): 125_198_592,
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
