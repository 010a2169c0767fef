"""Streamlit glue every page shares: the sidebar's model and scenario, loaded once per
rerun, with bad input shown as one error line (the page then stops drawing, the app lives on).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import streamlit as st

from app_pages.model_cache import cached_hub_config, cached_model_shape
from planner.config_task import config_task
from planner.errors import PlannerInputError
from planner.estimate import Estimate, estimate
from planner.model_shape import ModelShape
from planner.parallel import ParallelEstimate, parallel_estimate
from planner.probe.cache import is_ready, probe_progress
from planner.scenario import Device, Scenario
from planner.strategy import ParallelPlan
from views.escaping import markdown_text
from views.inputs import (
    CONFIG_SOURCES,
    ModelSource,
    SidebarValues,
    base_values,
    capacity_bytes,
    model_config,
    parallel_plan_for,
    scenario_for,
)


@dataclass(frozen=True)
class PageContext:
    values: SidebarValues
    config: dict
    name: str
    shape: ModelShape
    scenario: Scenario
    result: Estimate  # one full replica on one device
    capacity_bytes: int  # of one GPU
    parallel: ParallelPlan  # the sidebar's GPU count and strategy
    per_device: ParallelEstimate | None  # what one GPU holds under `parallel`; None on one GPU

    @property
    def base_values(self) -> dict:
        return base_values(self.values)

    @functools.cached_property  # every cached chart of a render asks; the config is hashed once
    def scenario_key(self) -> tuple:
        """What every number on a page follows from: the sidebar's values and the model's config
        (a hub id or an uploaded file names it, the config is what was read)."""
        digest = hashlib.sha256(json.dumps(self.config, sort_keys=True, default=str).encode()).hexdigest()
        return (self.values, digest)

    @property
    def per_gpu(self) -> Estimate | ParallelEstimate:
        """What one GPU holds: the plan on one device, or its share under the strategy."""
        return self.result if self.per_device is None else self.per_device


def load_context() -> PageContext | None:
    """The chosen model's shape and the sidebar scenario's estimate; None (after saying why) when unusable."""
    values = SidebarValues.from_state(st.session_state)
    try:
        chosen = model_config(values, hub_config=cached_hub_config)
        if chosen is None:
            st.info(_WAITING.get(values.model_source, _WAITING[ModelSource.UPLOAD.value]))
            return None
        config, name = chosen
        scenario = scenario_for(values)
        shape = cached_model_shape(config, name, scenario)
        result = estimate_with_progress(shape, scenario)
        capacity = capacity_bytes(values)
        parallel = parallel_plan_for(values)
        per_device = parallel_estimate(shape, scenario, parallel, result) if parallel.distributed else None
    except PlannerInputError as error:
        # Bad input is the user's to fix: say what and how, keep the page alive.
        st.error(markdown_text(error), icon=":material/error:")  # it may quote a file name
        return None
    return PageContext(values, config, name, shape, scenario, result, capacity, parallel, per_device)


T = TypeVar("T")


# Shown only while a result is computed, never when it is served from the cache: the first
# LoRA or CPU-kernel plan of a model probes its training step, seconds per technique class.
@st.cache_resource(max_entries=512, show_spinner="Computing (a model's first LoRA or CPU plans probe its own "
                                                 "training step on fake tensors: seconds per technique)…")
def _per_scenario(kind: str, key: tuple, _build: Callable[[], object]) -> object:
    return _build()  # `_build` is not hashed (Streamlit skips arguments named with "_")


def cached_for_scenario(context: PageContext, kind: str, build: Callable[[], T], *inputs) -> T:
    """`build()` once per server for the same sidebar scenario, model and page `inputs`: every
    session re-renders its page on each change, and the charts' dozens of estimates and their
    Plotly figures are the same for every session with the same inputs. `build` must depend on
    nothing else (never on the run history), and its result is shared: never mutate it."""
    return _per_scenario(kind, (context.scenario_key, *inputs), build)  # type: ignore[return-value]


_WAITING = {
    ModelSource.UPLOAD.value: "Upload a model's config.json in the sidebar, or pick a catalog model.",
    ModelSource.HUB.value: "Enter a Hugging Face hub model id (owner/name) in the sidebar, or pick a catalog model.",
}


def estimate_with_progress(shape: ModelShape, scenario: Scenario) -> Estimate:
    """A CPU-kernel estimate of a model never probed runs the probe first (seconds): show it."""
    if scenario.device is not Device.CPU or is_ready(shape, scenario):
        return estimate(shape, scenario)
    label = f"Probing {markdown_text(shape.name)}'s own training step on fake tensors (once per model and technique)…"
    with st.status(label, expanded=True) as status, probe_progress(status.write):
        result = estimate(shape, scenario)
        status.update(label="Probed the model's own training step", state="complete", expanded=False)
    return result


def model_caption(shape: ModelShape, parallel: ParallelPlan | None = None) -> str:
    """The model line under each page's title; with several GPUs (`parallel`), their count and strategy."""
    positions = f", {shape.max_positions:,} positions" if shape.max_positions is not None else ""
    distributed = parallel is not None and parallel.distributed
    gpus = f"; {parallel.num_devices} GPUs, {parallel.strategy.value}" if distributed else ""
    # The name is the user's (an upload's file name): Markdown-escaped, so it is only text.
    return (f"**{markdown_text(shape.name)}**: {markdown_text(shape.architecture)}, "
            f"{shape.num_parameters:,} parameters{positions}{gpus}")


def task_override_note(context: PageContext) -> str | None:
    """One line when an uploaded or hub config is planned with another task than its `architectures` names
    (Markdown: the architecture is the config's own text, escaped)."""
    if context.values.model_source not in CONFIG_SOURCES:
        return None  # a catalog model's task is a choice among equals (an encoder classifies or fills masks)
    found = config_task(context.config)
    if found is None or found.task is context.scenario.task:
        return None
    return (f"The config's architectures name {markdown_text(found.architecture)} ({found.task.value}); "
            f"planned as {context.scenario.task.value}, the task chosen in the sidebar.")


def start_page(title: str) -> PageContext | None:
    """Every page's opening: its title, the context, the model line under the title, and a
    note when the sidebar's task overrides the uploaded config's."""
    st.title(title)
    context = load_context()
    if context is not None:
        st.caption(model_caption(context.shape, context.parallel))
        note = task_override_note(context)
        if note is not None:
            st.info(note, icon=":material/swap_horiz:")
    return context


def rerun_when_a_run_finishes(finished_runs: int, key: str) -> None:
    """Rerun the whole page once more runs have finished than at the last render, so the
    tables drawn outside the auto-refreshing fragment (history, measured runs) show them."""
    if finished_runs > st.session_state.get(key, finished_runs):
        st.session_state[key] = finished_runs
        st.rerun()
    st.session_state[key] = finished_runs
