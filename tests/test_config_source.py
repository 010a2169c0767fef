"""Where configs come from: uploads are checked before anything is built, and hub look-ups
fail fast with a clear message when the hub cannot be reached."""

import json
import socket
import threading
import time

import pytest

from planner.config_source import MAX_CONFIG_BYTES, config_from_bytes, config_from_hub, resolve_config
from planner.config_task import ConfigTask, config_task
from planner.errors import PlannerInputError
from planner.scenario import Task


def test_upload_of_a_real_config_parses(tiny_configs_dir):
    config = config_from_bytes((tiny_configs_dir / "tiny-gpt2.json").read_bytes())
    assert config["model_type"] == "gpt2"


@pytest.mark.parametrize("data,message", [
    (b"\xff\xfe\x00", "not UTF-8"),
    (b"{\"model_type\": ", "not valid JSON"),
    (b"[]", "JSON object"),
    (b"{\"hidden_size\": 4}", "no 'model_type'"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    (json.dumps({"model_type": "gpt2", "x": json.loads("[" * 40 + "]" * 40)}).encode(), "nested deeper"),
    (b" " * (MAX_CONFIG_BYTES + 1), "must be under"),
])
def test_bad_uploads_get_one_line_errors(data, message):
    with pytest.raises(PlannerInputError) as error:
        config_from_bytes(data)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_directory_with_config_json_is_accepted(tmp_path, tiny_configs_dir):
    (tmp_path / "config.json").write_text((tiny_configs_dir / "tiny-llama.json").read_text())
    config, name = resolve_config(str(tmp_path))
    assert config["model_type"] == "llama" and name == tmp_path.name  # the folder names the model


def test_hub_id_needs_explicit_permission():
    with pytest.raises(PlannerInputError, match="--hub"):
        resolve_config("meta-llama/Llama-2-7b-hf")


def test_unreachable_hub_is_a_clear_error():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(PlannerInputError, match="cannot reach the Hugging Face hub"):
        config_from_hub("owner/model", timeout_s=2, hub_url=f"http://127.0.0.1:{port}")


def test_silent_hub_times_out_instead_of_hanging():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(PlannerInputError, match="cannot reach"):
            config_from_hub("owner/model", timeout_s=1, hub_url=f"http://127.0.0.1:{server.getsockname()[1]}")
    finally:
        server.close()
    assert time.monotonic() - started < 5


def test_a_file_called_config_json_is_named_by_its_model(tmp_path, tiny_configs_dir):
    # The JSON `model` field names the model, never just "config.json".
    folder = tmp_path / "My-Model"
    folder.mkdir()
    data = json.loads((tiny_configs_dir / "tiny-llama.json").read_text())
    (folder / "config.json").write_text(json.dumps(data))
    assert resolve_config(str(folder / "config.json"))[1] == "My-Model"
    (folder / "config.json").write_text(json.dumps(dict(data, _name_or_path="org/tiny-llama")))
    assert resolve_config(str(folder / "config.json"))[1] == "org/tiny-llama"
    (tmp_path / "tiny.json").write_text(json.dumps(data))
    assert resolve_config(str(tmp_path / "tiny.json"))[1] == "tiny.json"


@pytest.mark.parametrize("architectures,expected", [
    (["MistralForCausalLM"], ConfigTask(Task.CAUSAL_LM, "MistralForCausalLM")),
    (["GPT2LMHeadModel"], ConfigTask(Task.CAUSAL_LM, "GPT2LMHeadModel")),
    (["BertForMaskedLM"], ConfigTask(Task.MASKED_LM, "BertForMaskedLM")),
    (["ElectraForPreTraining", "RobertaForSequenceClassification"],
     ConfigTask(Task.SEQUENCE_CLASSIFICATION, "RobertaForSequenceClassification")),
    (["ElectraForPreTraining"], None),
    ("LlamaForCausalLM", None),  # not a list: not what save_pretrained writes
    ([7], None),
])
def test_task_from_the_configs_architectures(architectures, expected):
    assert config_task({"model_type": "x", "architectures": architectures}) == expected
    assert config_task({"model_type": "x"}) is None
