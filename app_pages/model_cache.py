"""Model shapes for the dashboard, shared by every session and keyed on the config's text
(app_pages.shared_results), and hub configs behind st.cache_data, keyed on the model id.

Building a shape takes up to a second (transformers on the meta device), and every
widget change reruns the page, so one (config, task, labels) is built once per server.
A hub config is fetched once per id and hub URL; a failed fetch (offline, unknown id) is
remembered for HUB_RETRY_S only, so reruns in that window do not wait on the network again
and a later one retries.
"""

from __future__ import annotations

import json

import streamlit as st

from app_pages.shared_results import SharedResults
from planner.config_source import HUB_TIMEOUT_S, config_from_hub, configured_hub_url
from planner.errors import PlannerInputError
from planner.loading import model_shape_for_config
from planner.model_shape import ModelShape
from planner.scenario import Scenario, Task


_SHAPES = SharedResults(kept=32)


def _shape_for(config_json: str, task: str, num_labels: int, name: str) -> ModelShape:
    return _SHAPES.get((config_json, task, num_labels, name),
                       lambda: model_shape_for_config(json.loads(config_json), Task(task), num_labels, name),
                       computing=lambda: st.spinner("Building the model's parameter shapes…"))


def cached_model_shape(config: dict, name: str, scenario: Scenario) -> ModelShape:
    """The ModelShape that `scenario`'s task and labels need; PlannerInputError for a bad config."""
    # sort_keys: the same config with its keys in another order is the same cache entry.
    config_json = json.dumps(config, sort_keys=True)
    return _shape_for(config_json, scenario.task.value, scenario.num_labels, name)


HUB_RETRY_S = 30  # how long a failed hub fetch is remembered before the next rerun retries
HUB_ADVICE = "download its config.json and upload it (Model from: Upload config.json)"


@st.cache_data(ttl=HUB_RETRY_S, max_entries=64, show_spinner="Fetching config.json from the hub…")
def _hub_attempt(model_id: str, hub_url: str) -> tuple[dict | None, str | None]:
    # (config, None) or (None, the one-line error): an error is a value here, so it is cached
    # for the ttl; a success is kept for good by _hub_config.
    try:
        return config_from_hub(model_id, timeout_s=HUB_TIMEOUT_S, hub_url=hub_url, advice=HUB_ADVICE), None
    except PlannerInputError as error:
        return None, str(error)


@st.cache_data(max_entries=64, show_spinner=False)
def _hub_config(model_id: str, hub_url: str) -> dict:
    config, error = _hub_attempt(model_id, hub_url)
    if error is not None:
        raise PlannerInputError(error)  # not cached: st.cache_data keeps return values only
    return config


def cached_hub_config(model_id: str) -> dict:
    """A hub model's config.json, fetched once per id; PlannerInputError (one line) when
    offline or unknown."""
    return _hub_config(model_id, configured_hub_url())
