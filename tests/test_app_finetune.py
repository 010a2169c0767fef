"""The fine-tuning method in the dashboard (issue 13): the sidebar's full / LoRA / QLoRA inputs,
their link keys (planner.finetune.FINETUNE_KEYS), the Plan page's trainable parameters and
frozen weights, the planner's refusals as one line, the Techniques page's side-by-side
comparison and the report's content.

Trainable counts are checked against PEFT's own get_nb_trainable_parameters on a model that
transformers builds with from_config (on the meta device: no weights), never against the
page's or the planner's arithmetic. Models are small (GPT-2) with CPU kernels or CUDA's
refusal, so a test probes for seconds at most.
"""

import io
import json
import warnings
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from app_pages.query_state import decode_with_rejects, encode
from planner.catalog import CATALOG_DIR
from planner.estimate import estimate
from planner.finetune import FINETUNE_KEYS
from planner.loading import load_model_shape
from planner.scenario import scenario_from_values
from planner.units import format_bytes
from reporting import build_report, render_report
from runners.history import RunHistory
from views.comparison import compare_methods, finetune_of
from views.escaping import markdown_text
from views.inputs import DEFAULTS, SidebarValues, scenario_for

APP = Path(__file__).resolve().parents[1] / "app.py"
TABLE_WIDTH_PX = 980  # a table's width in a 1,440 px window beside the sidebar (tests/test_app_pages.py)
TIMEOUT_S = 120  # a LoRA plan's first render probes the model's step (seconds on two cores)
GPT2 = {"catalog_model": "gpt2", "task": "causal-lm", "batch_size": "2", "seq_len": "128", "device": "cpu"}
# A method the estimate refuses shows the refusal in place of numbers. QLoRA is planned on every
# device now, so the tests that show a refused row make the estimate refuse QLoRA (qlora_refused).
QLORA_REFUSAL = "QLoRA cannot be planned for gpt2: refused for this test (one line)"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))


@pytest.fixture
def qlora_refused(monkeypatch):
    """The comparison's estimate refuses QLoRA in one line, as the planner refuses a method."""
    import views.comparison
    from planner.errors import PlannerInputError
    from planner.finetune import Method

    real = views.comparison.estimate

    def refusing(shape, scenario):
        if scenario.finetune.method is Method.QLORA:
            raise PlannerInputError(QLORA_REFUSAL)
        return real(shape, scenario)

    monkeypatch.setattr(views.comparison, "estimate", refusing)


def app(page: str = "plan", query: dict | None = None, **state) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    at.query_params.update(query or {})
    at.session_state["fit_search_adapters"] = False  # What fits' own LoRA search: not what is tested here
    for key, value in state.items():
        at.session_state[key] = value
    at.run()
    if page != "plan":
        at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, at.exception
    return at


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def peft_trainable(model: str, r: int = 16, targets="all-linear") -> int:
    """PEFT's own count: GPT-2 from its catalog config.json, built by transformers, wrapped by PEFT."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads((CATALOG_DIR / f"{model}.json").read_text()))
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = AutoModelForCausalLM.from_config(config)
        wrapped = get_peft_model(built, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.05, target_modules=targets,
                                                   task_type="CAUSAL_LM"))
    return wrapped.get_nb_trainable_parameters()[0]


def planned(model: str = "gpt2", **values):
    scenario = scenario_from_values(**({"task": "causal-lm", "batch_size": 2, "seq_len": 128, "device": "cpu"} | values))
    return estimate(load_model_shape(model, scenario.task, scenario.num_labels), scenario)


# --- the Plan page ----------------------------------------------------------------------------

def test_lora_in_the_sidebar_shows_peft_s_trainable_count_and_the_frozen_weights():
    at = app(query={**GPT2, "finetune": "lora"})
    assert not at.error, [e.value for e in at.error]
    expected = planned(finetune="lora")
    assert metric(at, "Trainable parameters") == f"{peft_trainable('gpt2'):,}" == "2,359,296"
    assert metric(at, "Frozen weights") == format_bytes(expected.frozen_weight_bytes)
    assert metric(at, "Peak") == format_bytes(expected.peak_bytes)
    assert "Fine-tuning: LoRA r 16, alpha 32, dropout 0.05, targets all-linear." in [c.value for c in at.caption]
    # The sidebar's rank reaches the planner: half the rank, half the adapters (PEFT's count again).
    at.number_input(key="lora_r").set_value(8).run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert metric(at, "Trainable parameters") == f"{peft_trainable('gpt2', r=8):,}" == "1,179,648"
    # Full fine-tuning hides the LoRA inputs and the adapter figures.
    at.radio(key="finetune").set_value("full").run()
    assert not at.error and "Trainable parameters" not in [m.label for m in at.metric]
    assert "lora_r" not in [w.key for w in at.number_input]


def test_lora_targets_named_in_the_sidebar_reach_peft():
    at = app(query={**GPT2, "finetune": "lora", "lora_targets": "c_attn"})
    assert not at.error, [e.value for e in at.error]
    assert at.text_input(key="lora_targets").value == "c_attn"
    assert metric(at, "Trainable parameters") == f"{peft_trainable('gpt2', targets=['c_attn']):,}"


@pytest.mark.parametrize("widget, value, message", [
    ("lora_r", 0, "LoRA rank 0 must be a whole number of at least 1"),
    ("lora_targets", "q_proj,v_proj", "LoRA cannot wrap this model: Target modules"),
    ("lora_targets", "c_attn; drop", "LoRA targets 'c_attn; drop' are not module names"),
])
def test_bad_lora_input_is_the_planner_s_one_line_and_the_page_recovers(widget, value, message):
    at = app(query={**GPT2, "finetune": "lora"})
    good = metric(at, "Trainable parameters")
    (at.number_input if widget == "lora_r" else at.text_input)(key=widget).set_value(value).run()
    assert not at.exception
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and errors[0].startswith(markdown_text(message)), errors
    assert "\n" not in errors[0]
    (at.number_input if widget == "lora_r" else at.text_input)(key=widget).set_value(
        DEFAULTS[widget]).run()
    assert not at.error and metric(at, "Trainable parameters") == good


def test_qlora_on_cuda_shows_the_planner_s_peak_and_peft_s_trainable_count():
    at = app(query={**GPT2, "device": "cuda", "finetune": "qlora"})
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert metric(at, "Peak") == format_bytes(planned(device="cuda", finetune="qlora").peak_bytes)
    assert metric(at, "Trainable parameters") == f"{peft_trainable('gpt2'):,}"
    assert at.selectbox(key="quant_type").value == "nf4" and at.toggle(key="double_quant").value is True
    at.radio(key="finetune").set_value("full").run()
    assert not at.error and metric(at, "Peak") == format_bytes(planned(device="cuda").peak_bytes)


def test_lora_on_several_gpus_is_refused_in_one_line():
    at = app(query={**GPT2, "finetune": "lora", "gpu_count": "2"})
    assert [e.value for e in at.error] == ["lora across several GPUs is not planned yet: set the number of GPUs "
                                           "to 1, or fine-tune in full"]


# --- the link -----------------------------------------------------------------------------------

LINKED = {"finetune": "qlora", "lora_r": "8", "lora_alpha": "24.0", "lora_dropout": "0.1", "lora_targets": "c_attn,c_proj",
          "quant_type": "fp4", "double_quant": "false"}


def test_the_finetune_keys_round_trip_through_the_link():
    assert set(LINKED) == set(FINETUNE_KEYS)
    at = app(query={**GPT2, "device": "cuda", "gpu_count": "2", **LINKED})  # several GPUs: refused at once, no probe
    state = {key: at.session_state[key] for key in FINETUNE_KEYS}
    assert state == {"finetune": "qlora", "lora_r": 8, "lora_alpha": 24.0, "lora_dropout": 0.1,
                     "lora_targets": "c_attn,c_proj", "quant_type": "fp4", "double_quant": False}
    assert at.number_input(key="lora_alpha").value == 24.0 and at.toggle(key="double_quant").value is False
    written = {key: at.query_params[key] for key in FINETUNE_KEYS}
    assert {key: value[-1] if isinstance(value, list) else value for key, value in written.items()} == LINKED
    # The planner reads the same names (`planner batch` keys), so the link is the CLI's plan.
    sidebar = SidebarValues.from_state({key: at.session_state[key] for key in DEFAULTS if key in at.session_state})
    assert scenario_for(sidebar).finetune == scenario_from_values(task="causal-lm", batch_size=1, seq_len=1,
                                                                  **LINKED).finetune


def test_the_link_carries_only_what_the_method_reads():
    values = {**DEFAULTS, "finetune": "full", "lora_r": 8, "quant_type": "fp4"}
    assert not set(encode(values)) & set(FINETUNE_KEYS)
    values["finetune"] = "lora"
    assert encode(values) == {"finetune": "lora", "lora_r": "8"}  # alpha follows r: absent
    values["finetune"] = "qlora"
    assert encode(values) == {"finetune": "qlora", "lora_r": "8", "quant_type": "fp4"}
    assert decode_with_rejects(encode(values))[0] == {"finetune": "qlora", "lora_r": 8, "quant_type": "fp4"}


@pytest.mark.parametrize("key, text", [("finetune", "prefix"), ("lora_r", "0"), ("lora_r", "1e3"), ("lora_alpha", "0"),
                                       ("lora_alpha", "nan"), ("lora_dropout", "1"), ("lora_dropout", "-0.1"),
                                       ("lora_targets", "q_proj v_proj"), ("lora_targets", "x" * 600),
                                       ("quant_type", "int8"), ("double_quant", "maybe")])
def test_a_bad_finetune_value_in_a_link_is_dropped_and_named(key, text):
    values, rejected = decode_with_rejects({key: text})
    assert values == {} and set(rejected) == {key}


# --- Techniques: full, LoRA and QLoRA side by side ----------------------------------------------

def method_rows(at: AppTest):
    [table] = [d.value for d in at.dataframe if "method" in d.value.columns]
    return table.set_index("method")


def test_techniques_compare_full_lora_and_qlora_only_when_asked(qlora_refused):
    at = app("techniques", query={**GPT2, "device": "cuda"})
    assert not [d for d in at.dataframe if "method" in d.value.columns]  # nothing probed until asked
    at.checkbox(key="techniques_compare_methods").check().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    table = method_rows(at)
    assert list(table.index) == ["Full fine-tuning", "LoRA", "QLoRA"]
    full, lora = planned(device="cuda"), planned(device="cuda", finetune="lora")
    for label, result in (("Full fine-tuning", full), ("LoRA", lora)):
        row = table.loc[label]
        assert [int(row[c]) for c in ("weights (bytes)", "gradients (bytes)", "optimizer state (bytes)",
                                      "activations (bytes)", "peak (bytes)")] == [
            result.weights_bytes, result.gradients_bytes, result.optimizer_state_bytes, result.activations_bytes,
            result.peak_bytes]
    assert int(table.loc["LoRA", "trainable parameters"]) == peft_trainable("gpt2")
    assert int(table.loc["Full fine-tuning", "trainable parameters"]) == full.num_parameters
    assert int(table.loc["LoRA", "frozen weights (bytes)"]) == lora.frozen_weight_bytes
    # Refused: its reason in place of numbers.
    assert table.loc["QLoRA", "peak"] == QLORA_REFUSAL
    assert table.loc[["QLoRA"], ["weights (bytes)", "peak (bytes)", "trainable parameters"]].isna().all().all()
    assert f"qlora: {markdown_text(QLORA_REFUSAL)}" in [c.value for c in at.caption]
    # Every shown column has a width and together they fit the page beside the sidebar.
    [shown] = [d for d in at.dataframe if "method" in d.value.columns]
    columns, order = json.loads(shown.proto.columns), list(shown.proto.column_order)
    assert order and all(name in table.reset_index().columns for name in order)
    assert sum(columns[name]["width"] for name in order) <= TABLE_WIDTH_PX


def test_the_method_comparison_shows_the_measured_peak_of_exactly_that_plan():
    shape = load_model_shape("gpt2", planned().scenario.task, 2)
    base = {"task": "causal-lm", "batch_size": 2, "seq_len": 128, "optimizer": "adamw", "precision": "fp32",
            "gradient_checkpointing": False, "grad_accum": 1, "attn": "sdpa", "device": "cpu", "num_labels": 2}
    settings = {k: DEFAULTS[k] for k in FINETUNE_KEYS if k != "finetune"}
    rows = compare_methods(shape, base, settings)
    config = json.loads((CATALOG_DIR / "gpt2.json").read_text())
    history = RunHistory()
    lora = rows[1]
    run = history.start_run("gpt2", "simulate", {**lora.values, "engine": "accelerate", "model_config": config},
                            lora.estimate.to_json())
    history.finish_run(run, "ok", measurement={"peak_bytes": 987_654_321})
    other_rank = history.start_run("gpt2", "simulate", {**lora.values, "lora_r": 8, "engine": "accelerate",
                                                        "model_config": config}, lora.estimate.to_json())
    history.finish_run(other_rank, "ok", measurement={"peak_bytes": 1})  # another plan: not matched
    at = app("techniques", query=GPT2, compare_methods=True)
    table = method_rows(at)
    assert int(table.loc["LoRA", "measured peak (bytes)"]) == 987_654_321
    assert table.loc["LoRA", "measured by"] == "simulate"
    assert table.loc["Full fine-tuning", "measured peak"] == "no run"  # a LoRA run is not a full one
    # ...and the full-fine-tuning technique rows above do not take the LoRA run either.
    assert at.dataframe[0].value["measured peak"].iloc[0] == "no run"


# --- the report -----------------------------------------------------------------------------------

def test_the_report_names_the_method_its_settings_and_the_comparison():
    # On CUDA at PEFT's default rank, whose GPT-2 tables ship (CPU LoRA and QLoRA classes do
    # not: five probes, 48 s of this test on 2 cores from an empty cache), and an alpha of the
    # user's own (not in the probe's key), so the report must carry the user's settings.
    query = {**GPT2, "device": "cuda", "finetune": "lora", "lora_r": "16", "lora_alpha": "48"}
    at = app("report", query=query, compare_methods=True)
    assert not at.error, [e.value for e in at.error]
    preview = at.markdown[-1].value
    trainable = peft_trainable("gpt2", r=16)
    result = planned(device="cuda", finetune="lora", lora_r=16, lora_alpha=48)
    assert markdown_text("Fine-tuning: LoRA r 16, alpha 48, dropout 0.05, targets all-linear") in preview
    assert markdown_text(f"Trainable parameters: {trainable:,} (") in preview
    assert markdown_text(f"frozen weights: {format_bytes(result.frozen_weight_bytes)} "
                         f"({result.frozen_weight_bytes:,} bytes)") in preview
    assert "## Full fine-tuning, LoRA and QLoRA" in preview
    assert f"| {peft_trainable('gpt2', r=16)} |" in preview  # the LoRA row's trainable count, raw


def test_the_report_s_json_and_csv_carry_the_method_and_the_comparison(qlora_refused):
    shape = load_model_shape("gpt2", planned().scenario.task, 2)
    # PEFT's default rank: What fits' LoRA classes for GPT-2 ship (scripts/build_probe_tables.py --adapters).
    values = {"task": "causal-lm", "batch_size": 2, "seq_len": 128, "device": "cuda", "finetune": "lora",
              "lora_r": 16}
    settings = {k: DEFAULTS[k] for k in FINETUNE_KEYS if k != "finetune"} | {"lora_r": 16}
    base = {k: v for k, v in values.items() if k not in FINETUNE_KEYS}
    methods = compare_methods(shape, base, settings)
    report = build_report(shape, values, 16 * 2**30, "16 GiB", search_adapters=False, methods=methods)
    data = json.loads(render_report(report, "json"))
    plan = data["plan"]["estimate"]
    assert plan["scenario"]["finetune"] == "lora" and plan["scenario"]["lora_r"] == 16
    assert plan["trainable_parameters"] == peft_trainable("gpt2", r=16)
    assert plan["frozen_weight_bytes"] == planned(device="cuda", finetune="lora", lora_r=16).frozen_weight_bytes
    assert [m["method"] for m in data["methods"]] == ["full", "lora", "qlora"]
    assert data["methods"][1]["estimate"]["trainable_parameters"] == peft_trainable("gpt2", r=16)
    assert data["methods"][2]["error"] == QLORA_REFUSAL and data["methods"][2]["estimate"] is None
    # The technique rows fine-tune in full, as on the Techniques page.
    assert all(t["scenario"].get("finetune") is None for t in data["techniques"])
    csv = pd.read_csv(io.StringIO(render_report(report, "csv")))
    methods_csv = csv[csv["section"] == "methods"].set_index("method")
    assert list(methods_csv.index) == ["Full fine-tuning", "LoRA", "QLoRA"]
    assert int(methods_csv.loc["LoRA", "trainable parameters"]) == peft_trainable("gpt2", r=16)
    assert methods_csv.loc["QLoRA", "peak"] == QLORA_REFUSAL
    html = render_report(report, "html")
    assert "<h2>Full fine-tuning, LoRA and QLoRA</h2>" in html and "Fine-tuning: LoRA r 16, alpha 32" in html
    # Without the comparison the section is absent, not empty.
    assert "Full fine-tuning, LoRA and QLoRA" not in render_report(
        build_report(shape, values, 16 * 2**30, "16 GiB", search_adapters=False), "md")


# --- Verify and What fits take the method too ---------------------------------------------------

def test_verify_this_plan_queues_the_sidebar_s_lora_plan(monkeypatch):
    from app_pages import run_queue

    queued = []

    def fake(request, timeout_s, on_progress, history, cancel=None):
        queued.append(request)
        return {"status": "ok", "mode": "simulate", "reason": None, "measured": None,
                "estimated": {"peak_bytes": 1, "peak_breakdown_bytes": {}}}

    queue = run_queue.RunQueue(runner=fake)
    run_queue.set_queue(queue)
    try:
        at = app("verify", query={**GPT2, "finetune": "lora", "lora_r": "8"})
        at.selectbox(key="verify_mode").set_value("simulate").run()
        at.button(key="verify_plan").click().run()
        assert queue.wait_idle(10)
    finally:
        run_queue.set_queue(None)
    [request] = queued
    assert request.scenario["finetune"] == "lora" and request.scenario["lora_r"] == 8
    assert request.parsed_scenario().finetune == planned(finetune="lora", lora_r=8).scenario.finetune
    assert metric(at, "Estimated peak a run is compared with") == format_bytes(
        planned(finetune="lora", lora_r=8).peak_bytes)


def test_apply_this_plan_writes_a_lora_plan_s_method_into_the_sidebar():
    from types import SimpleNamespace

    from app_pages.fit_view import option_label, plan_state
    from planner.strategy import Strategy

    scenario = scenario_from_values(task="causal-lm", batch_size=4, seq_len=128, device="cpu", finetune="qlora",
                                    lora_r=8, lora_targets="c_attn", quant_type="fp4")
    option = SimpleNamespace(scenario=scenario, strategy=Strategy.SINGLE)
    state = plan_state(option)
    assert {k: state[k] for k in FINETUNE_KEYS} == {"finetune": "qlora", "lora_r": 8, "lora_alpha": None,
                                                     "lora_dropout": 0.05, "lora_targets": "c_attn",
                                                     "quant_type": "fp4", "double_quant": True}
    assert option_label(1, option).startswith("#1: qlora r8, adamw")
    full = plan_state(SimpleNamespace(scenario=scenario_from_values(task="causal-lm", batch_size=4, seq_len=128),
                                      strategy=Strategy.SINGLE))
    assert full["finetune"] == "full" and "lora_r" not in full


def test_the_report_command_takes_lora_on_one_gpu_and_refuses_it_on_several(tmp_path, capsys):
    from reporting.cli import main

    out = tmp_path / "plan.md"
    assert main(["--config", "gpt2", "--task", "causal-lm", "--batch-size", "2", "--seq-len", "128",
                 "--finetune", "lora", "--gpu-count", "2", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "reporting: error: lora across several GPUs is not planned yet: drop --gpu-count"]
    assert not out.exists()


def test_a_first_lora_plan_shows_the_probe_s_progress_then_closes_it():
    # A rank and targets no other test plans: this model's step is probed here, once.
    at = app(query={**GPT2, "finetune": "lora", "lora_r": "4", "lora_targets": "c_attn,c_fc"})
    assert not at.error, [e.value for e in at.error]
    [status] = at.status
    assert status.label == "Probed the model's own training step" and status.state == "complete"
    assert any("probe 1 of 3" in m.value for m in status.markdown)
    at.run()  # served from the probe's cache now: no box
    assert not at.status and metric(at, "Trainable parameters") == f"{peft_trainable('gpt2', 4, ['c_attn', 'c_fc']):,}"
