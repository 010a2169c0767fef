"""PYTORCH_CUDA_ALLOC_CONF as a scenario input (planner.scenario.CudaSegments): parsed as torch
parses the one option the allocator replay models, refused for the options it does not,
and carried to the replay behind the verdict and the fit searches, the CLI, `planner batch`,
the report and the Verify page's run request.

GPT-2's CUDA probe tables (with their allocation traces) ship with the catalog: no probe runs.
"""

import json

import pytest

from planner.cli import main as planner_main
from planner.cuda_allocator import replay
from planner.device_fit import plan_verdict, reserved_check
from planner.errors import PlannerInputError
from planner.estimate import estimate
from planner.fit import max_batch_size
from planner.gpus import gpu_spec, scenario_on
from planner.loading import load_model_shape
from planner.probe.cache import probe_table
from planner.reserved import training_events
from planner.scenario import CudaSegments, Device, Task, parse_cuda_alloc_conf, scenario_from_values
from planner.verdict import device_overheads, tensor_budget_bytes

from page_elements import markdown_tables

RTX_4090 = gpu_spec("rtx4090")
EXPANDABLE = "expandable_segments:True"


@pytest.fixture(scope="module")
def gpt2():
    return load_model_shape("gpt2", Task.CAUSAL_LM)


def _plan(**overrides):
    """A plan on the RTX 4090 (its kernels: planner.gpus.scenario_on)."""
    values = {"task": "causal-lm", "batch_size": 14, "seq_len": 1024, "device": "cuda", "precision": "bf16-mixed"}
    return scenario_on(scenario_from_values(**(values | overrides)), RTX_4090)


@pytest.mark.parametrize("text, expected", [
    (None, CudaSegments.CUDA_MALLOC), ("", CudaSegments.CUDA_MALLOC),
    ("expandable_segments:True", CudaSegments.EXPANDABLE),
    (" expandable_segments : True ", CudaSegments.EXPANDABLE),  # torch's tokenizer skips whitespace
    ("expandable_segments:False", CudaSegments.CUDA_MALLOC),
    ("backend:native,expandable_segments:True", CudaSegments.EXPANDABLE),  # native is the caching allocator
    ("expandable_segments:True,expandable_segments:False", CudaSegments.CUDA_MALLOC),  # the last one wins
])
def test_the_setting_is_read_as_torch_reads_it(text, expected):
    assert parse_cuda_alloc_conf(text) is expected


@pytest.mark.parametrize("text, says", [
    ("max_split_size_mb:128", "not modelled"),
    ("garbage_collection_threshold:0.6", "not modelled"),
    ("roundup_power2_divisions:[256:1,512:2]", "not modelled"),
    ("backend:cudaMallocAsync", "not modelled"),
    ("expandable_segments:true", "True or False"),  # torch accepts exactly True and False
    ("expandable_segments", "has no value"),
    ("expandable_sgments:True", "unknown PYTORCH_CUDA_ALLOC_CONF option"),
    ("x" * 300, "PYTORCH_CUDA_ALLOC_CONF string"),
])
def test_settings_the_replay_does_not_model_are_refused_in_one_line(text, says):
    with pytest.raises(PlannerInputError, match=says) as error:
        parse_cuda_alloc_conf(text)
    assert "\n" not in str(error.value)


def test_a_cpu_plan_refuses_the_setting():
    with pytest.raises(PlannerInputError, match="plan on --device cuda"):
        _plan(device="cpu", cuda_alloc_conf=EXPANDABLE)


def test_expandable_segments_make_a_fragmenting_plan_fit(gpt2):
    """Rule (CUDACachingAllocator.cpp, Note [Expandable Segments]): without the option each
    cudaMalloc'd segment is its own block list, so free space split across segments cannot
    serve one large request, even after the cache is released and retried; with it one
    segment per pool grows by mapping pages, so freed pages are reused whole. GPT-2 at
    14 x 1024 in bf16 autocast on an RTX 4090: the default replay runs out of memory among
    the logits-sized blocks, the expandable replay does not, and the verdict follows."""
    capacity = RTX_4090.capacity_bytes
    default = plan_verdict(gpt2, estimate(gpt2, _plan()), capacity, RTX_4090)
    expandable = plan_verdict(gpt2, estimate(gpt2, _plan(cuda_alloc_conf=EXPANDABLE)), capacity, RTX_4090)
    assert default.peak_bytes == expandable.peak_bytes  # the tensors do not change
    # ... nor does what they allocate, but for the blocks the allocator hands out: without
    # expandable segments a request may get a cached block up to 1 MiB larger (planner.verdict).
    assert default.allocated_peak_bytes >= expandable.allocated_peak_bytes >= expandable.peak_bytes
    assert default.replay_out_of_memory and not default.fits
    assert not expandable.replay_out_of_memory and expandable.fits
    assert expandable.reserved_peak_bytes <= expandable.usable_capacity_bytes < default.reserved_peak_bytes
    assert any(name == "Reserved peak" and "with expandable segments" in source
               for name, _, source in expandable.rows())

    # The replay behind the verdict is the allocator model's own, run on the same events.
    scenario = _plan(cuda_alloc_conf=EXPANDABLE)
    result = estimate(gpt2, scenario)
    workspaces = tuple(item.bytes for item in device_overheads(Device.CUDA, RTX_4090, None).allocator_items)
    prefix, step = training_events(gpt2, scenario, probe_table(gpt2, scenario),
                                   step_temporaries_bytes=result.phases[-1].temporaries, cublas_workspaces=workspaces)
    direct = replay(step, prefix=prefix, repeats=2, expandable_segments=True,
                    capacity_bytes=expandable.usable_capacity_bytes)
    assert direct.peak_reserved_bytes == expandable.reserved_peak_bytes


def test_the_fit_search_follows_the_setting(gpt2):
    capacity = RTX_4090.capacity_bytes
    budget = tensor_budget_bytes(capacity, Device.CUDA, RTX_4090)
    check = reserved_check(capacity, Device.CUDA, RTX_4090)
    by_live_tensors = max_batch_size(gpt2, _plan(batch_size=1), budget)
    default = max_batch_size(gpt2, _plan(batch_size=1), budget, check=check)
    expandable = max_batch_size(gpt2, _plan(batch_size=1, cuda_alloc_conf=EXPANDABLE), budget, check=check)
    assert default < expandable <= by_live_tensors


def test_cli_and_batch_carry_the_setting(gpt2, tmp_path, capsys):
    argv = ["estimate", "--config", "gpt2", "--task", "causal-lm", "--batch-size", "14", "--seq-len", "1024",
            "--precision", "bf16-mixed", "--gpu", "rtx4090", "--json"]
    assert planner_main(argv) == 0
    default = json.loads(capsys.readouterr().out)
    assert planner_main(argv + ["--cuda-alloc-conf", EXPANDABLE]) == 0
    expandable = json.loads(capsys.readouterr().out)
    assert default["scenario"]["cuda_alloc_conf"] == "expandable_segments:False"
    assert expandable["scenario"]["cuda_alloc_conf"] == EXPANDABLE
    assert (default["fits"], expandable["fits"]) == (False, True)
    assert expandable["reserved_peak_bytes"] < default["reserved_peak_bytes"]

    assert planner_main(argv + ["--cuda-alloc-conf", "max_split_size_mb:128"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_split_size_mb" in err

    lines = [{"id": "on", "config": "gpt2", "task": "causal-lm", "batch_size": 14, "seq_len": 1024,
              "precision": "bf16-mixed", "gpu": "rtx4090", "cuda_alloc_conf": EXPANDABLE},
             {"id": "cpu", "config": "gpt2", "task": "causal-lm", "batch_size": 1, "seq_len": 64, "device": "cpu",
              "cuda_alloc_conf": EXPANDABLE}]
    path = tmp_path / "plans.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert planner_main(["batch", str(path)]) == 0
    on, cpu = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert on["id"] == "on" and on["fits"] and on["reserved_peak_bytes"] == expandable["reserved_peak_bytes"]
    assert cpu["id"] == "cpu" and "plan on --device cuda" in cpu["error"]


def test_the_verify_request_sets_the_runs_environment_not_its_scenario():
    from views.verify_results import plan_request

    values = {"task": "causal-lm", "batch_size": 1, "seq_len": 16, "device": "cuda", "cuda_alloc_conf": EXPANDABLE}
    request = plan_request({"model_type": "gpt2"}, "tiny", values, "simulate", 2)
    assert request.cuda_alloc_conf == EXPANDABLE
    assert "cuda_alloc_conf" not in request.scenario  # a run measured on the CPU has no caching allocator


def test_the_dashboard_toggle_reaches_the_verdict_and_the_link(monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest

    from tests.test_app import APP

    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params.update({"catalog_model": "gpt2", "task": "causal-lm", "batch_size": "14", "seq_len": "1024",
                            "precision": "bf16-mixed", "gpu_preset": "RTX 4090 · 24 GB"})
    at.run()
    assert not at.exception, at.exception
    verdicts = lambda: [e.value for e in (*at.success, *at.warning, *at.error) if "fit" in e.value.lower()]
    assert at.toggle(key="expandable_segments").value is False
    assert any(text.startswith("Does not fit") for text in verdicts())
    at.toggle(key="expandable_segments").set_value(True).run()
    assert not at.exception, at.exception
    assert any(text.startswith("Fits") for text in verdicts())
    assert at.query_params["expandable_segments"] in ("true", ["true"])
    table = "\n".join(frame.to_string() for frame in markdown_tables(at))
    assert "with expandable segments" in table

    at.radio(key="device").set_value("cpu").run()  # a CPU plan has no caching allocator: no toggle, no error
    assert not at.exception and not at.error
    assert not [t for t in at.toggle if t.key == "expandable_segments"]


def test_the_report_names_the_setting_and_replays_with_it():
    from reporting.build import render_report, report_for_values

    values = {"config": "gpt2", "task": "causal-lm", "batch_size": 14, "seq_len": 1024, "precision": "bf16-mixed",
              "gpu": "RTX 4090 · 24 GB", "cuda_alloc_conf": EXPANDABLE, "search_adapters": False}
    report = report_for_values(values)
    assert report.verdict.fits and report.verdict.expandable_segments
    for fmt in ("md", "html"):
        text = render_report(report, fmt).replace("\\", "")  # Markdown escapes _ and :
        assert f"PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}" in text and "with expandable segments" in text, fmt
