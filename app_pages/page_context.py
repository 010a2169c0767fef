"""Streamlit glue every page shares: the sidebar's model and scenario, loaded once per
rerun, with bad input shown as one error line (the page then stops drawing, the app lives on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import streamlit as st

from app_pages.model_cache import cached_hub_config, cached_model_shape
from app_pages.shared_results import SharedResults
from planner.config_task import config_task
from planner.errors import PlannerInputError
from planner.estimate import Estimate, estimate
from planner.model_shape import ModelShape
from planner.parallel import ParallelEstimate, parallel_estimate
from planner.probe.cache import probe_progress
from planner.scenario import Scenario
from planner.strategy import ParallelPlan
from views.comparison import MethodRow, compare_methods
from views.escaping import markdown_text
from views.inputs import (
    CONFIG_SOURCES,
    ModelSource,
    SidebarValues,
    base_values,
    capacity_bytes,
    finetune_values,
    lora_settings,
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
        """The sidebar's scenario with full fine-tuning (what the technique comparisons start from)."""
        return base_values(self.values)

    @property
    def plan_values(self) -> dict:
        """The sidebar's scenario as planned, its fine-tuning method included (FINETUNE_KEYS; none
        for full fine-tuning, as the run history holds full runs)."""
        method = finetune_values(self.values) if self.scenario.finetune.uses_adapters else {}
        return base_values(self.values) | method

    @property
    def lora_settings(self) -> dict:
        return lora_settings(self.values)

    @functools.cached_property  # every cached chart of a render asks; the config is hashed once
    def config_digest(self) -> str:
        """The model's config as read (a hub id or an uploaded file names it; the config is what counts)."""
        return hashlib.sha256(json.dumps(self.config, sort_keys=True, default=str).encode()).hexdigest()

    @functools.cached_property
    def scenario_key(self) -> str:
        """What every number on a page follows from: the sidebar's values and the model's config,
        as one digest: a short key for the results sessions share (app_pages.shared_results)."""
        return hashlib.sha256(f"{self.values!r}|{self.config_digest}".encode()).hexdigest()

    def scenario_key_apart_from(self, field: str) -> str:
        """scenario_key with one sidebar value (a SidebarValues field) left out, for what does
        not follow from it: the largest batch that fits is the same whatever batch is chosen."""
        apart = dataclasses.replace(self.values, **{field: None})
        return hashlib.sha256(f"{apart!r}|{self.config_digest}".encode()).hexdigest()

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
        if parallel.distributed and scenario.finetune.uses_adapters:  # as `planner parallel` refuses it
            raise PlannerInputError(f"{scenario.finetune.method.value} across several GPUs is not planned yet: "
                                    "set the number of GPUs to 1, or fine-tune in full")
        per_device = parallel_estimate(shape, scenario, parallel, result) if parallel.distributed else None
    except PlannerInputError as error:
        # Bad input is the user's to fix: say what and how, keep the page alive.
        st.error(markdown_text(error), icon=":material/error:")  # it may quote a file name
        return None
    return PageContext(values, config, name, shape, scenario, result, capacity, parallel, per_device)


T = TypeVar("T")


# Shown only while a result is computed, never when it is served: the first LoRA or CPU-kernel
# plan of a model probes its training step, seconds per technique class.
_COMPUTING = "Computing (a model's first LoRA or CPU plans probe its own training step on fake tensors: " \
             "seconds per technique)…"
_PER_SCENARIO = SharedResults(kept=512)


def _per_scenario(kind: str, key: tuple, build: Callable[[], T]) -> T:
    return _PER_SCENARIO.get((kind, *key), build, computing=lambda: st.spinner(_COMPUTING))


def cached_for_scenario(context: PageContext, kind: str, build: Callable[[], T], *inputs) -> T:
    """`build()` once per server for the same sidebar scenario, model and page `inputs`: every
    session re-renders its page on each change, and the charts' dozens of estimates, the
    allocator's replays and the tables are the same for every session with the same inputs.
    `build` must depend on nothing else (never on the run history) and draw nothing (only the
    session computing it would see it), and its result is shared: never mutate it."""
    return _per_scenario(kind, (context.scenario_key, *inputs), build)  # type: ignore[return-value]


def cached_for_scenario_apart_from(context: PageContext, field: str, kind: str, build: Callable[[], T],
                                   *inputs) -> T:
    """As cached_for_scenario, for what does not follow from the sidebar value `field`: a change
    of that value alone serves it from the cache."""
    return _per_scenario(kind, (context.scenario_key_apart_from(field), *inputs), build)  # type: ignore[return-value]


def cached_for_model(context: PageContext, kind: str, build: Callable[[], T], *inputs) -> T:
    """As cached_for_scenario, for what follows from the model and `inputs` alone, not from the
    rest of the sidebar (the lines of "peak against batch size" start from the baseline's
    optimizer and precision whatever the sidebar says): a change of those serves it from the cache."""
    return _per_scenario(kind, (context.config_digest, context.name, *inputs), build)  # type: ignore[return-value]


@contextlib.contextmanager
def combination_progress(label: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar while the block runs a fit search (planner.fit.find_fits' `progress`):
    yields `progress(done, total)`, which moves it; the bar is gone after the block."""
    bar = st.progress(0.0, text=f"{label}…")

    def progress(done: int, total: int) -> None:
        bar.progress(done / total if total else 1.0, text=f"{label}: {done:,} of {total:,} combinations")

    try:
        yield progress
    finally:
        bar.empty()


# Long searches (What fits), server-wide by scenario and page inputs, each with its own progress bar.
_SEARCHES = SharedResults(kept=64)


def searched_with_progress(context: PageContext, kind: str, label: str,
                           search: Callable[[Callable[[int, int], None]], T], *inputs) -> T:
    """`search(progress)` once per server for the same sidebar scenario, model and page
    `inputs`, as cached_for_scenario, with a progress bar while it runs: `progress(done,
    total)` moves it. Its result is shared: never mutate it. Two sessions asking at once may
    both search (each is told its own progress); the first result kept is served after."""
    key = (kind, context.scenario_key, *inputs)
    hit, result = _SEARCHES.found(key)
    if hit:
        return result  # type: ignore[return-value]
    with combination_progress(label) as progress:
        return _SEARCHES.keep(key, search(progress))


_WAITING = {
    ModelSource.UPLOAD.value: "Upload a model's config.json in the sidebar, or pick a catalog model.",
    ModelSource.HUB.value: "Enter a Hugging Face hub model id (owner/name) in the sidebar, or pick a catalog model.",
}


@contextlib.contextmanager
def probe_status(name: str) -> Iterator[None]:
    """Inside: the probe's progress lines in a status box, opened at its first line (so a plan
    served from a stored table, or refused before any probe, shows none)."""
    label = f"Probing {markdown_text(name)}'s own training step on fake tensors (once per model and technique)…"
    opened = []

    def show(message: str) -> None:
        if not opened:
            opened.append(st.status(label, expanded=True))
        opened[0].write(markdown_text(message))

    try:
        with probe_progress(show):
            yield
    except PlannerInputError:
        if opened:  # the page's error line says why
            opened[0].update(label="The probe could not plan this", state="error", expanded=False)
        raise
    if opened:
        opened[0].update(label="Probed the model's own training step", state="complete", expanded=False)


def estimate_with_progress(shape: ModelShape, scenario: Scenario) -> Estimate:
    """A model's first estimate of a technique class probes its training step (seconds to a
    minute) unless its tables ship: show the probe's progress lines."""
    with probe_status(shape.name):
        return estimate(shape, scenario)


COMPARE_METHODS = "compare_methods"  # session state shared by the Techniques and Report pages' boxes


def method_comparison(context: PageContext, records: list, key: str) -> list[MethodRow] | None:
    """Full fine-tuning, LoRA and QLoRA side by side for the sidebar's model and scenario, when
    the user ticks the box (`key`: the page's own; the choice itself is kept across pages):
    their first estimates probe the model's step. None while unticked."""
    wanted = st.checkbox("Compare full fine-tuning, LoRA and QLoRA", key=key,
                         value=bool(st.session_state.get(COMPARE_METHODS, False)),
                         help="The sidebar's scenario three ways, with its LoRA settings. A model's first LoRA "
                              "and QLoRA plans probe its training step: seconds to a minute each.")
    st.session_state[COMPARE_METHODS] = wanted
    if not wanted:
        return None
    with probe_status(context.name):  # every refusal is caught per method: it is that row's text
        return compare_methods(context.shape, context.base_values, context.lora_settings, records, context.config)


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
