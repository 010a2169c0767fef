"""The CLI as DESIGN.md specifies it: JSON keys, tables in binary units, JSONL batches,
and one-line errors with exit status 2 for every kind of bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main

ROOT = Path(__file__).resolve().parents[1]
BASE = ["estimate", "--config", "gpt2", "--task", "causal-lm", "--batch-size", "2", "--seq-len", "128"]


def _run(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_has_integer_byte_counts(capsys):
    code, out, _ = _run(BASE + ["--optimizer", "adamw", "--precision", "bf16-mixed", "--gradient-checkpointing",
                                "--grad-accum", "4", "--attn", "eager", "--device", "cpu", "--json"], capsys)
    assert code == 0
    result = json.loads(out)
    for key in ("weights_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes", "peak_bytes"):
        assert isinstance(result[key], int) and result[key] > 0
    assert result["num_parameters"] == 124_439_808
    assert result["peak_bytes"] >= result["weights_bytes"] + result["optimizer_state_bytes"]
    assert result["scenario"]["grad_accum"] == 4 and result["scenario"]["gradient_checkpointing"] is True


def test_table_uses_labelled_binary_units(capsys):
    code, out, _ = _run(BASE, capsys)
    assert code == 0
    assert "MiB" in out and "PEAK" in out and "124,439,808 parameters" in out


def test_training_arguments_aliases_equal_their_targets(capsys):
    pairs = [("adamw_torch", "adamw"), ("adamw_torch_fused", "adamw-fused"), ("adamw_bnb_8bit", "adamw8bit"),
             ("paged_adamw_8bit", "paged-adamw8bit"), ("sgd", "sgd"), ("adafactor", "hf-adafactor")]
    for alias, target in pairs:
        states = []
        for name in (alias, target):
            code, out, _ = _run(BASE + ["--optimizer", name, "--device", "cpu", "--json"], capsys)
            states.append(json.loads(out)["optimizer_state_bytes"])
        assert states[0] == states[1], alias


def test_batch_reads_jsonl_in_order_with_ids_and_per_line_errors(tmp_path, capsys, tiny_configs_dir):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "mine.json").write_text((tiny_configs_dir / "tiny-llama.json").read_text())
    lines = [
        {"id": "a", "config": "gpt2", "task": "causal-lm", "batch_size": 1, "seq_len": 64},
        {"id": "b", "config": "configs/mine.json", "task": "causal-lm", "batch_size": 2, "seq_len": 32,
         "optimizer": "adam8bit", "precision": "bf16", "gradient_checkpointing": True, "grad_accum": 2,
         "attn": "eager", "device": "cpu"},
        {"id": "c", "config": "gpt2", "task": "causal-lm", "batch_size": -1, "seq_len": 64},
    ]
    text = "\n".join(json.dumps(line) for line in lines) + "\n{not json\n"
    (tmp_path / "scenarios.jsonl").write_text(text)
    code, out, _ = _run(["batch", str(tmp_path / "scenarios.jsonl")], capsys)
    assert code == 0
    results = [json.loads(line) for line in out.splitlines()]
    assert [r.get("id") for r in results] == ["a", "b", "c", None]
    assert results[0]["num_parameters"] == 124_439_808
    assert results[1]["architecture"] == "LlamaForCausalLM" and results[1]["scenario"]["precision"] == "bf16"
    assert "batch size" in results[2]["error"]
    assert "not valid JSON" in results[3]["error"]


def _bad_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(text)
    return str(path)


BAD_INPUTS = {
    "unknown catalog name": (["--config", "no-such-model"], "neither a catalog model"),
    "malformed JSON": (["--config", "{bad"], "not valid JSON"),
    "non-JSON config": (["--config", "binary"], "not valid JSON"),
    "not an object": (["--config", "[1, 2]"], "JSON object"),
    "unknown architecture": (["--config", '{"model_type": "no-such-arch"}'], "not known to transformers"),
    "negative size": (["--config", '{"model_type": "gpt2", "n_layer": -3}'], "positive integer"),
    "unknown optimizer": (["--optimizer", "lion"], "unknown optimizer"),
    "zero batch": (["--batch-size", "0"], "batch size must be a positive integer"),
    "text batch": (["--batch-size", "eight"], "batch size must be a positive integer"),
    "negative sequence": (["--seq-len", "-5"], "sequence length must be a positive integer"),
    "sequence too long": (["--seq-len", "4096"], "exceeds gpt2's 1,024 positions"),
    "task without head": (["--task", "masked-lm"], "no masked-lm head"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_status_2(case, tmp_path, capsys):
    overrides, expected = BAD_INPUTS[case]
    args = {"--config": "gpt2", "--task": "causal-lm", "--batch-size": "2", "--seq-len": "128"}
    for flag, value in zip(overrides[::2], overrides[1::2]):
        if flag == "--config" and value not in ("no-such-model",):
            value = _bad_config(tmp_path, "\x00\xff binary" if value == "binary" else value)
        args[flag] = value
    argv = ["estimate"] + [item for pair in args.items() for item in pair]
    code, out, err = _run(argv, capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("planner: error: ")
    assert expected in err


def test_subprocess_error_has_no_traceback():
    completed = subprocess.run([sys.executable, "-m", "planner", "estimate", "--config", "gpt2", "--task", "causal-lm",
                                "--batch-size", "1", "--seq-len", "5000"], cwd=ROOT, capture_output=True, text=True)
    assert completed.returncode == 2
    assert "Traceback" not in completed.stderr
    assert completed.stderr.strip().count("\n") == 0


def test_catalog_lists_every_model(capsys):
    code, out, _ = _run(["catalog", "--json"], capsys)
    names = [entry["name"] for entry in json.loads(out)]
    assert code == 0 and "distilbert-base-cased" in names and "llama-2-70b" in names


def test_the_verdict_says_which_cudnn_its_attention_kernels_assume(capsys):
    """`--cudnn-version`: on an H100 cuDNN 9.19 takes the attention (its workspace replayed),
    the default 9.10.2 flash (its scratch replayed): both say which."""
    llama = str(ROOT / "tests" / "configs" / "tiny-llama.json")
    args = ["estimate", "--config", llama, "--task", "causal-lm", "--batch-size", "2", "--seq-len", "64",
            "--precision", "bf16-mixed", "--device", "cuda", "--gpu", "h100", "--json"]
    readings = {}
    for extra in ([], ["--cudnn-version", "91900"]):
        code, out, err = _run(args + extra, capsys)
        assert code == 0, err
        result = json.loads(out)
        readings[result["cudnn_version"]] = result["reserved_peak_bytes"]
    assert set(readings) == {91002, 91900} and all(isinstance(v, int) for v in readings.values())
