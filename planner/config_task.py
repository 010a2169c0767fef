"""The task a config.json was saved for, read from its `architectures` list (the class
`save_pretrained` wrote, e.g. "MistralForCausalLM"), so an uploaded config is planned as
the model it is rather than as whatever task the sidebar last held.

Only the head suffixes the planner builds are recognised; a config without
`architectures`, or with a head the planner does not model ("ForPreTraining",
"ForQuestionAnswering"), names no task (None) and the caller keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.scenario import Task

# Class-name endings -> task, as transformers names its heads (GPT-2's causal LM is "LMHeadModel").
_HEAD_SUFFIXES = (
    ("ForCausalLM", Task.CAUSAL_LM),
    ("LMHeadModel", Task.CAUSAL_LM),
    ("ForMaskedLM", Task.MASKED_LM),
    ("ForSequenceClassification", Task.SEQUENCE_CLASSIFICATION),
    ("ForTokenClassification", Task.TOKEN_CLASSIFICATION),
    ("ForConditionalGeneration", Task.SEQ2SEQ_LM),
)


@dataclass(frozen=True)
class ConfigTask:
    task: Task
    architecture: str  # the `architectures` entry it was read from


def config_task(config: dict) -> ConfigTask | None:
    """The task of the first `architectures` entry with a known head; None when none has one."""
    architectures = config.get("architectures")
    if not isinstance(architectures, list):
        return None
    for name in architectures:
        if not isinstance(name, str):
            continue
        for suffix, task in _HEAD_SUFFIXES:
            if name.endswith(suffix):
                return ConfigTask(task, name)
    return None
