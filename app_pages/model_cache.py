"""Model shapes for the dashboard behind st.cache_resource, keyed on the config's text.

Building a shape takes up to a second (transformers on the meta device), and every
widget change reruns the page, so one (config, task, labels) is built once per server.
"""

from __future__ import annotations

import json

import streamlit as st

from planner.loading import model_shape_for_config
from planner.model_shape import ModelShape
from planner.scenario import Scenario, Task


@st.cache_resource(max_entries=32, show_spinner="Building the model's parameter shapes…")
def _shape_for(config_json: str, task: str, num_labels: int, name: str) -> ModelShape:
    return model_shape_for_config(json.loads(config_json), Task(task), num_labels, name)


def cached_model_shape(config: dict, name: str, scenario: Scenario) -> ModelShape:
    """The ModelShape that `scenario`'s task and labels need; PlannerInputError for a bad config."""
    # sort_keys: the same config with its keys in another order is the same cache entry.
    config_json = json.dumps(config, sort_keys=True)
    return _shape_for(config_json, scenario.task.value, scenario.num_labels, name)
