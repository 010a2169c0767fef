"""The dashboard's plain modules: sidebar values -> planner inputs (views.inputs),
the breakdown table and the fits verdict (views.breakdown). No Streamlit here."""

import hashlib
import json
from dataclasses import replace

import pytest

from planner.catalog import CATALOG_DIR, catalog_entries
from planner.errors import PlannerInputError
from planner.estimate import estimate
from planner.loading import load_model_shape
from planner.scenario import Checkpointing, Optimizer, Task, scenario_from_values
from planner.units import GIB, MIB
from planner.verdict import DeviceVerdict
from runners.config_store import is_config_hash, load_config, store_dir
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
    preset_caption,
    remember_upload,
    scenario_for,
    upload_label,
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
    # Named by the model (opt-125m.json has no _name_or_path: its architecture), and the upload's short hash.
    assert model_config(uploaded) == (json.loads(data), f"OPTForCausalLM · {hashlib.sha256(data).hexdigest()[:12]}")
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
    shape = load_model_shape("distilbert-base-cased", result.scenario.task, result.scenario.num_labels)
    assert verdict_for(shape, result, 15 * GIB) == DeviceVerdict(result.peak_bytes, 15 * GIB, None)


# --- Uploads kept by hash, hub ids (issue 14) -----------------------------------------------

@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def test_an_upload_is_stored_by_hash_and_a_link_restores_it(data_dir):
    data = (CATALOG_DIR / "llama-2-7b.json").read_bytes()  # has a _name_or_path
    digest = remember_upload(FakeUploadedFile("config.json", data))
    assert digest == hashlib.sha256(data).hexdigest() and is_config_hash(digest)
    assert (data_dir / "configs" / f"{digest}.json").read_bytes() == data == load_config(digest)
    assert store_dir() == data_dir / "configs"
    # A link carries the hash alone: the same config and label, no file uploaded.
    config, name = model_config(defaults(model_source="upload", config_hash=digest))
    assert config == json.loads(data)
    assert name == f"{json.loads(data)['_name_or_path']} · {digest[:12]}" == upload_label(config, digest)
    assert remember_upload(FakeUploadedFile("config.json", data)) == digest  # stored once
    assert remember_upload(None) == "" and remember_upload(FakeUploadedFile("x.json", b"not json")) == ""
    assert not [p for p in (data_dir / "configs").iterdir() if p.name != f"{digest}.json"]  # no bad file kept


def test_a_hash_not_stored_here_is_a_clear_one_line_error(data_dir):
    missing = "ab" * 32
    with pytest.raises(PlannerInputError, match="no uploaded config abababababab… is stored on this machine") as raised:
        model_config(defaults(model_source="upload", config_hash=missing))
    assert "\n" not in str(raised.value)
    for bad in ("../../etc/passwd", "AB" * 32, "ab" * 31, "ab" * 32 + "/x", ""):
        if bad:
            with pytest.raises(PlannerInputError, match="64 hexadecimal digits"):
                load_config(bad)
    assert not data_dir.exists()  # nothing looked up, nothing created


def test_a_damaged_stored_config_says_so(data_dir):
    data = (CATALOG_DIR / "gpt2.json").read_bytes()
    digest = remember_upload(FakeUploadedFile("config.json", data))
    (data_dir / "configs" / f"{digest}.json").write_bytes(data + b" ")
    with pytest.raises(PlannerInputError, match="damaged"):
        model_config(defaults(model_source="upload", config_hash=digest))


def test_a_hub_id_is_fetched_through_the_page_s_fetcher():
    config = json.loads((CATALOG_DIR / "gpt2.json").read_text())
    asked = []
    fetch = lambda model_id: asked.append(model_id) or config  # noqa: E731
    assert model_config(defaults(model_source="hub", hub_model_id=" openai/gpt2 "), fetch) == (config, "openai/gpt2")
    assert asked == ["openai/gpt2"]
    assert model_config(defaults(model_source="hub", hub_model_id=""), fetch) is None  # waiting for an id
    with pytest.raises(PlannerInputError, match="not a hub model id"):
        model_config(defaults(model_source="hub", hub_model_id="../x"), fetch)
    assert asked == ["openai/gpt2"]


def test_every_preset_is_a_gpu_row_with_its_capacity_and_how_it_was_obtained():
    from planner.gpus import GPUS
    from views.inputs import GPU_PRESET_KEYS
    for preset, key in GPU_PRESET_KEYS.items():
        if key is None:
            assert preset == CUSTOM_GPU and preset_caption(preset) == ""
            continue
        assert GPU_PRESETS[preset] == GPUS[key].capacity_bytes
        assert f"{GPUS[key].capacity_bytes:,} bytes" in preset_caption(preset)
    assert "datasheet figure" in preset_caption("RTX 4060 Ti · 16 GB")
    assert "rocm-smi" in preset_caption("MI300X · 192 GB (ROCm)")
    assert "nvidia-smi" in preset_caption("RTX 3060 · 12 GB")
    wanted = {"rtx4060", "rtx3060", "rtx4060ti-16gb", "rtx4080", "rtx3090", "rtx4090", "v100-16gb", "v100-32gb",
              "a6000", "l40s", "a100-40gb", "a100-80gb", "h100", "h200", "mi300x"}
    assert wanted <= set(GPU_PRESET_KEYS.values())
