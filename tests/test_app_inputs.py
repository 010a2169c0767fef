"""The dashboard's plain modules: sidebar values -> planner inputs (views.inputs),
the breakdown table and the fits verdict (views.breakdown). No Streamlit here."""

import json
from dataclasses import replace

import pytest

from planner.verdict import DeviceVerdict
from planner.catalog import CATALOG_DIR, catalog_entries
from planner.errors import PlannerInputError
from planner.estimate import estimate
from planner.loading import load_model_shape
from planner.scenario import Checkpointing, Optimizer, Task, scenario_from_values
from planner.units import GIB, MIB
from views.breakdown import PEAK_LABEL, breakdown_table, verdict_for
from views.inputs import (
    CUSTOM_GPU,
    DEFAULTS,
    GPU_PRESETS,
    SidebarValues,
    UploadedConfig,
    capacity_bytes,
    default_task,
    model_config,
    scenario_for,
)


def defaults(**overrides) -> SidebarValues:
    return replace(SidebarValues.from_state({}), **overrides)


class FakeUploadedFile:
    """What st.file_uploader puts in session state: a BytesIO-like object with a name."""

    def __init__(self, name: str, data: bytes):
        self.name, self._data = name, data

    def getvalue(self) -> bytes:
        return self._data


def test_defaults_cover_every_field_but_the_upload():
    values = SidebarValues.from_state({})
    assert values.config_upload is None
    assert set(DEFAULTS) == {name for name in vars(values) if name != "config_upload"}
    assert values.task == default_task(values.catalog_model) == "sequence-classification"


def test_from_state_reads_widget_values_and_the_uploaded_file():
    values = SidebarValues.from_state({"batch_size": 3, "config_upload": FakeUploadedFile("c.json", b"{}")})
    assert values.batch_size == 3
    assert values.config_upload == UploadedConfig("c.json", b"{}")


def test_default_task_follows_the_catalog_family():
    for name, entry in catalog_entries().items():
        assert default_task(name) == entry.default_task.value
    assert default_task("gpt2") == "causal-lm"


def test_scenario_carries_every_widget():
    scenario = scenario_for(defaults(task="causal-lm", batch_size=4, seq_len=256, optimizer="adamw_bnb_8bit",
                                     gradient_checkpointing=True, grad_accum=2, precision="bf16-mixed"))
    assert scenario.task is Task.CAUSAL_LM and scenario.tokens_per_micro_batch == 1024
    assert scenario.optimizer is Optimizer.ADAMW8BIT
    assert scenario.checkpointing is Checkpointing.EVERY_LAYER and scenario.grad_accum_steps == 2


def test_bad_scenario_value_is_a_planner_input_error():
    with pytest.raises(PlannerInputError, match="batch size"):
        scenario_for(defaults(batch_size=0))


def test_model_config_from_catalog_and_upload():
    config, name = model_config(defaults(catalog_model="gpt2"))
    assert name == "gpt2" and config == json.loads((CATALOG_DIR / "gpt2.json").read_text())
    data = (CATALOG_DIR / "opt-125m.json").read_bytes()
    uploaded = defaults(model_source="upload", config_upload=UploadedConfig("my.json", data))
    assert model_config(uploaded) == (json.loads(data), "my.json")
    assert model_config(defaults(model_source="upload")) is None


@pytest.mark.parametrize(("data", "message"), [
    (b"not json", "not valid JSON"),
    (b"[1]", "must hold a JSON object"),
    (b'{"hidden_size": 8}', "no 'model_type'"),
    (b"\xff", "not UTF-8"),
    (b" " * (1 << 20) + b"{}", "must be under"),
])
def test_bad_upload_bytes_are_one_line_errors(data, message):
    with pytest.raises(PlannerInputError, match=message) as raised:
        model_config(defaults(model_source="upload", config_upload=UploadedConfig("config.json", data)))
    assert "\n" not in str(raised.value)


def test_capacity_from_presets_and_custom():
    assert capacity_bytes(defaults(gpu_preset="T4 · 16 GB")) == 15360 * MIB == 15 * GIB
    assert capacity_bytes(defaults(gpu_preset="A100 · 80 GB")) == 80 * GIB
    assert capacity_bytes(defaults(gpu_preset=CUSTOM_GPU, gpu_custom_gib=1.5)) == 3 * GIB // 2
    assert GPU_PRESETS[CUSTOM_GPU] is None
    with pytest.raises(PlannerInputError, match="positive"):
        capacity_bytes(defaults(gpu_preset=CUSTOM_GPU, gpu_custom_gib=0.0))
    with pytest.raises(PlannerInputError, match="unknown GPU preset"):
        capacity_bytes(defaults(gpu_preset="TPU"))


def _distilbert_estimate(**overrides):
    scenario = scenario_from_values(**({"task": "sequence-classification", "batch_size": 8, "seq_len": 512} | overrides))
    return estimate(load_model_shape("distilbert-base-cased", scenario.task, scenario.num_labels), scenario)


def test_breakdown_table_rows_sum_to_the_peak():
    for overrides in ({}, {"gradient_checkpointing": True}, {"grad_accum": 4, "optimizer": "sgd"}):
        result = _distilbert_estimate(**overrides)
        table = breakdown_table(result)
        assert list(table["category"]) == ["Weights", "Gradients", "Optimizer state", "Activations",
                                           "Temporaries", PEAK_LABEL]
        sizes = dict(zip(table["category"], table["bytes"]))
        assert sizes[PEAK_LABEL] == result.peak_bytes == sum(list(table["bytes"])[:-1])
        assert sizes["Optimizer state"] == result.peak.optimizer_state
        assert table["size"].iloc[-1].endswith("GiB")


def test_breakdown_pins_the_lessons_distilbert_adamw_state():
    # Course figure (DESIGN.md): AdamW holds 131,566,188 elements for DistilBERT + 2-label head
    # (two fp32 moments per parameter plus one fp32 step per tensor, 104 tensors): every
    # tensor of the state, which is the CPU figure (on CUDA `step` stays on the host).
    table = breakdown_table(_distilbert_estimate(device="cpu"))
    state = int(table.loc[table["category"] == "Optimizer state", "bytes"].iloc[0])
    assert state == 131_566_188 * 4 == (2 * 65_783_042 + 104) * 4


def test_verdict_margin_and_headline():
    fits = DeviceVerdict(peak_bytes=3 * GIB, capacity_bytes=16 * GIB, overheads=None)  # a CPU plan
    assert fits.fits and fits.margin_bytes == 13 * GIB and fits.margin_gib == 13.0
    assert fits.headline.startswith("Fits") and "13.00 GiB of the 16.00 GiB" in fits.headline
    short = DeviceVerdict(peak_bytes=20 * GIB + GIB // 2, capacity_bytes=16 * GIB, overheads=None)
    assert not short.fits and short.margin_gib == -4.5
    assert short.headline.startswith("Does not fit") and "by 4.50 GiB" in short.headline
    assert DeviceVerdict(peak_bytes=GIB, capacity_bytes=GIB, overheads=None).fits  # exactly full still fits
    result = _distilbert_estimate(device="cpu")
    assert verdict_for(result, 15 * GIB) == DeviceVerdict(result.peak_bytes, 15 * GIB, None)
