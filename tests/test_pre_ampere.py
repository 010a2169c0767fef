"""planner.pre_ampere: a plan probed on sm80's kernels says when a GPU before Ampere runs its
attention on SDPA's math path, checked against the kernels a simulated step on that GPU's
architecture takes (planner.probe.fake_cuda, which follows torch's sdp_utils.cpp)."""

import pytest

from conftest import tiny_config
from planner.device_fit import plan_verdict
from planner.estimate import estimate
from planner.gpus import GPUS
from planner.loading import model_shape_for_config
from planner.probe.fake_cuda import CudaGpu
from planner.scenario import scenario_from_values
from runners.simulate_measure import simulate_step

T4 = CudaGpu("T4", *GPUS["t4"].compute_capability)


def _verdict(name: str, precision: str, gpu_key: str):
    values = dict(task="causal-lm", batch_size=2, seq_len=64, precision=precision, device="cuda")
    scenario = scenario_from_values(**values)
    shape = model_shape_for_config(tiny_config(name), scenario.task, 2, name)
    result = estimate(shape, scenario)
    gpu = GPUS[gpu_key]
    return plan_verdict(shape, result, gpu.capacity_bytes, gpu), values


@pytest.mark.parametrize("name, precision, math_on_t4", [
    ("tiny-llama", "fp16-mixed", True),  # 4 query heads, 2 key/value heads: flash on sm80 only
    ("tiny-gpt2", "fp16-mixed", False),  # multi-head: the memory-efficient kernel on a T4
    ("tiny-llama", "fp32", False),  # no flash in fp32: the math path on sm80 too, as probed
])
def test_the_warning_follows_the_kernels_a_t4_takes(name, precision, math_on_t4):
    verdict, values = _verdict(name, precision, "t4")
    on_t4 = simulate_step(tiny_config(name), dict(values), gpu=T4)["attention_backends"]
    on_sm80 = simulate_step(tiny_config(name), dict(values), gpu="sm80")["attention_backends"]
    assert on_t4 and on_sm80
    assert ("math" in on_t4 and "math" not in on_sm80) == math_on_t4
    assert (verdict.kernel_warning is not None) == math_on_t4
    if math_on_t4:
        assert "4 query heads, 2 key/value heads" in verdict.kernel_warning
        assert verdict.to_json()["kernel_warning"] == verdict.kernel_warning


def test_no_warning_on_a_gpu_with_flash_attention():
    for gpu_key in ("a100-40gb", "l4", "h100"):
        verdict, _ = _verdict("tiny-llama", "fp16-mixed", gpu_key)
        assert verdict.kernel_warning is None, gpu_key


def test_the_plan_page_warns_on_a_t4_and_not_on_an_a100():
    """SmolLM2-135M (9 query heads, 3 key/value heads) in fp16 autocast: on the default T4 the
    Plan page shows the warning under the verdict; on an A100 it does not."""
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "app.py"), default_timeout=180).run()
    at.selectbox(key="catalog_model").set_value("smollm2-135m").run()
    at.selectbox(key="precision").set_value("fp16-mixed").run()
    assert not at.exception
    warned = [w.value for w in at.warning if w.value.startswith("Low on this GPU: on a T4")]
    assert len(warned) == 1 and "9 query heads, 3 key/value heads" in warned[0]
    a100 = next(label for label in at.selectbox(key="gpu_preset").options if label.startswith("A100"))
    at.selectbox(key="gpu_preset").set_value(a100).run()
    assert not at.exception
    assert not [w for w in at.warning if w.value.startswith("Low on this GPU")]


def test_what_fits_flags_the_16_bit_plans_on_a_t4():
    """On the default T4, SmolLM2-135M's What fits names the fp16-mixed plans the warning
    covers, and no fp32 plan (full fine-tuning only, to keep the search short)."""
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "app.py"), default_timeout=300).run()
    at.selectbox(key="catalog_model").set_value("smollm2-135m").run()
    at.session_state["fit_search_adapters"] = False
    at.switch_page("app_pages/what_fits.py").run()
    assert not at.exception
    warned = [w.value for w in at.warning if w.value.startswith("Low on this GPU, plans #")]
    assert len(warned) == 1 and "9 query heads, 3 key/value heads" in warned[0]
    named = {int(rank) for rank in warned[0].split(":")[0].removeprefix("Low on this GPU, plans ")
             .replace("#", "").split(",")}
    table = at.dataframe[0].value
    sixteen_bit = {int(rank) for rank, precision in zip(table["rank"], table["precision"]) if precision != "fp32"}
    assert named == sixteen_bit and named


def test_low_options_names_the_16_bit_grouped_query_plans_only():
    from types import SimpleNamespace

    from planner.pre_ampere import low_options

    def option(precision: str):
        scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=64, precision=precision,
                                        device="cuda")
        return SimpleNamespace(scenario=scenario)

    shape = model_shape_for_config(tiny_config("tiny-llama"), scenario_from_values(
        task="causal-lm", batch_size=1, seq_len=1).task, 2, "tiny-llama")
    options = [option("fp32"), option("fp16-mixed"), option("fp32")]
    ranks, warning = low_options(shape, options, GPUS["t4"])
    assert ranks == [2] and "4 query heads, 2 key/value heads" in warning
    assert low_options(shape, options, GPUS["a100-40gb"]) == ([], None)
