"""Bad input, tried systematically (hypothesis): config files, scenario values, `planner batch`
lines and `planner estimate` flags. Every input gets either a valid estimate or a
PlannerInputError (CLI: one line on stderr, exit status 2; batch: one JSON line per input
line, `{"error": "..."}` for a bad one) and never another exception or a hang.

Each example runs under a wall-clock alarm (HANG_S) so a hang fails the test rather than
the suite; hypothesis deadlines flag slow inputs. Shapes are only built for mutations of the
tiny test configs (small models), so the file stays fast. How many inputs were tried is
printed in the terminal summary (conftest.pytest_terminal_summary reads TRIED).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import cli
from planner.config_source import MAX_CONFIG_BYTES, config_from_bytes
from planner.errors import PlannerInputError
from planner.estimate import Estimate
from planner.loading import model_shape_for_config
from planner.scenario import Task
from tests.conftest import CONFIGS, tiny_config

TRIED: collections.Counter = collections.Counter()  # kind of input -> how many were tried
HANG_S = 20  # no single input may take longer than this (a first shape build takes ~1 s)

# Deadlines are generous: a scenario with a new label count builds a new shape (about 1 s, more
# while other tests load the CPU); no_hang is the hard bound.
FAST = settings(max_examples=300, deadline=timedelta(seconds=10), derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BUILDS = settings(max_examples=60, deadline=timedelta(seconds=15), derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextlib.contextmanager
def no_hang(seconds: float = HANG_S):
    """Raise TimeoutError in this (main) thread if the block runs longer than `seconds`."""
    def alarm(signum, frame):
        raise TimeoutError(f"input took over {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def one_line_error(error: PlannerInputError) -> None:
    text = str(error)
    assert text and "\n" not in text and "Traceback" not in text, text


def check_estimate(result: Estimate) -> None:
    """A valid estimate: positive integer bytes, and the peak is its own breakdown's sum."""
    data = result.to_json()
    assert isinstance(data["peak_bytes"], int) and data["peak_bytes"] > 0
    assert sum(data["peak_breakdown_bytes"].values()) == data["peak_bytes"]
    for key in ("weights_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes"):
        assert isinstance(data[key], int) and data[key] >= 0, key


# --- strategies -------------------------------------------------------------------------------

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**40), max_value=10**40),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=20)

# Values that break a size field: missing, zero, negative, huge, fractional, the wrong type.
bad_sizes = st.one_of(st.sampled_from([0, -1, -(2**63), 2**31, 2**63, 10**30, 1.5, 1e308, "12", "", None, [], {},
                                       True, [64], {"value": 64}]),
                      st.integers(min_value=-(10**6), max_value=0), st.integers(min_value=(1 << 20) + 1))
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions",
             "dim", "n_layers", "n_heads", "hidden_dim", "head_dim")
TINY = sorted(p.stem for p in CONFIGS.glob("*.json"))


@st.composite
def mutated_tiny_configs(draw) -> dict:
    """A tiny test config with keys dropped, size fields broken, or fields of the wrong type."""
    config = dict(tiny_config(draw(st.sampled_from(TINY))))
    keys = sorted(config)
    for key in draw(st.lists(st.sampled_from(keys), max_size=3, unique=True)):
        config.pop(key, None)
    for key in draw(st.lists(st.sampled_from(SIZE_KEYS), max_size=2, unique=True)):
        config[key] = draw(bad_sizes)
    if draw(st.booleans()):
        config[draw(st.sampled_from(keys))] = draw(json_values)
    if draw(st.integers(0, 9)) == 0:
        config["model_type"] = draw(st.one_of(st.text(max_size=12), json_scalars))
    return config


def nested(depth: int) -> bytes:
    return b'{"model_type": "gpt2", "x": ' + b"[" * depth + b"]" * depth + b"}"


config_bytes = st.one_of(
    st.binary(max_size=2000),  # not JSON, not UTF-8
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    json_values.map(lambda v: json.dumps(v).encode()),  # JSON, but rarely an object with model_type
    mutated_tiny_configs().map(lambda c: json.dumps(c).encode()),
    st.integers(1, 200_000).map(nested),  # deep nesting
    st.integers(4300, 20_000).map(lambda n: b'{"model_type": "gpt2", "n_embd": ' + b"7" * n + b"}"),
    st.integers(MAX_CONFIG_BYTES - 50, MAX_CONFIG_BYTES + 4096).map(  # around the size limit
        lambda n: b'{"model_type": "gpt2", "pad": "' + b"a" * max(n - 36, 0) + b'"}'),
)

TASKS = [t.value for t in Task]
scenario_scalars = st.one_of(
    st.sampled_from([0, -1, 1, 2, 10**9, 10**30, 2**63, 1.0, 0.5, -3.0, math.inf, math.nan, "8", "²", "٣", "+4",
                     " 16 ", "-2", "1e3", "", None, True, False, [], {}, "0" * 5000, "9" * 5000]),
    st.integers(), st.floats(), st.text(max_size=12))
scenario_values = st.fixed_dictionaries(
    {"task": st.one_of(st.sampled_from(TASKS), st.text(max_size=12), json_scalars),
     "batch_size": scenario_scalars, "seq_len": scenario_scalars},
    optional={"optimizer": st.one_of(st.sampled_from(["adamw", "sgd", "adafactor", "adamw_torch", "paged_adamw_8bit",
                                                       "lion", "ADAMW", ""]), json_scalars),
              "precision": st.one_of(st.sampled_from(["fp32", "bf16", "fp16", "mixed", "fp8"]), json_scalars),
              "gradient_checkpointing": st.one_of(st.sampled_from([True, False, "yes", "maybe", 2]), json_scalars),
              "grad_accum": scenario_scalars, "num_labels": scenario_scalars,
              "attn": st.one_of(st.sampled_from(["sdpa", "eager", "flash", ""]), json_scalars),
              "device": st.one_of(st.sampled_from(["cuda", "cpu", "tpu"]), json_scalars),
              "engine": st.one_of(st.sampled_from(["accelerate", "trainer", "deepspeed"]), json_scalars),
              "id": json_values, "colour": json_scalars})


# --- config files -----------------------------------------------------------------------------

@FAST
@given(data=config_bytes)
def test_config_bytes_parse_or_one_line_error(data):
    TRIED["config files"] += 1
    with no_hang():
        try:
            config = config_from_bytes(data, "fuzzed.json")
        except PlannerInputError as error:
            one_line_error(error)
            return
    assert isinstance(config, dict) and isinstance(config["model_type"], str)


@BUILDS
@given(config=mutated_tiny_configs(), task=st.sampled_from(list(Task)))
def test_mutated_configs_build_a_shape_or_one_line_error(config, task):
    TRIED["configs built"] += 1
    with no_hang():
        try:
            parsed = config_from_bytes(json.dumps(config).encode(), "fuzzed.json")
            shape = model_shape_for_config(parsed, task, 2, "fuzzed")
        except PlannerInputError as error:
            one_line_error(error)
            return
    assert shape.num_parameters > 0


def test_config_files_on_disk_too_big_or_missing(tmp_path):
    from planner.config_source import resolve_config

    huge = tmp_path / "huge.json"
    huge.write_bytes(b" " * (MAX_CONFIG_BYTES + 1))
    for source in (str(huge), str(tmp_path / "missing.json"), str(tmp_path), "a" * 5000 + ".json", "owner/model",
                   "~no_such_user_xyz/config.json", "\x00.json"):
        TRIED["config files"] += 1
        with pytest.raises(PlannerInputError) as caught:
            resolve_config(source)  # hub off unless asked: "owner/model" is refused, not fetched
        one_line_error(caught.value)


# --- scenario values --------------------------------------------------------------------------

@FAST
@given(values=scenario_values, config=st.sampled_from(["gpt2", "distilbert-base-uncased", "", "no-such-model",
                                                       "owner/name", 7, None]))
def test_scenario_values_estimate_or_one_line_error(values, config):
    TRIED["scenario values"] += 1
    with no_hang():
        try:
            result = cli.estimate_from_values({**values, "config": config})
        except PlannerInputError as error:
            one_line_error(error)
            return
    check_estimate(result)
    assert result.scenario.batch_size >= 1 and result.scenario.seq_len >= 1


# --- planner batch and estimate ---------------------------------------------------------------

batch_lines = st.one_of(
    st.text(max_size=80).filter(lambda t: "\n" not in t and "\r" not in t),
    json_values.map(json.dumps),
    scenario_values.map(lambda v: json.dumps({**v, "config": "gpt2"}, allow_nan=True)),
    st.integers(1, 50_000).map(lambda n: "[" * n + "]" * n),
    st.just('{"config": "gpt2", "task": "causal-lm", "batch_size": ' + "9" * 5000 + ', "seq_len": 8}'),
)


@settings(max_examples=60, deadline=timedelta(seconds=15), derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(lines=st.lists(batch_lines, min_size=1, max_size=6))
def test_batch_lines_each_get_one_json_answer(lines, tmp_path, capsys):
    TRIED["batch lines"] += len(lines)
    path = tmp_path / "fuzz.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    capsys.readouterr()
    with no_hang():
        status = cli.main(["batch", str(path)])
    out = capsys.readouterr().out.splitlines()
    assert status == 0
    kept = [line for line in path.read_text(encoding="utf-8", errors="replace").split("\n") if line.strip()]
    assert len(out) == len(kept)
    for answer in map(json.loads, out):
        if "error" in answer:
            assert answer["error"] and "\n" not in answer["error"]
        else:
            assert isinstance(answer["peak_bytes"], int) and answer["peak_bytes"] > 0


flag_values = st.one_of(st.sampled_from(["0", "-1", "1", "8", "1e3", "99999999999999999999", "", "x", "²", "nan"]),
                        st.text(max_size=8).filter(lambda t: "\x00" not in t))


@settings(max_examples=120, deadline=timedelta(seconds=10), derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(batch=flag_values, seq=flag_values, accum=flag_values,
       config=st.sampled_from(["gpt2", "nope", "owner/name", "x.json"]),
       task=st.sampled_from(TASKS + ["regression"]))
def test_estimate_flags_give_a_table_or_one_line_exit_2(batch, seq, accum, config, task, capsys):
    TRIED["estimate command lines"] += 1
    capsys.readouterr()
    with no_hang():
        status = cli.main(["estimate", "--config", config, "--task", task, "--batch-size", batch,
                           "--seq-len", seq, "--grad-accum", accum, "--json"])
    out, err = capsys.readouterr()
    if status == 0:
        assert json.loads(out)["peak_bytes"] > 0 and not err
    else:
        assert status == cli.EXIT_BAD_INPUT
        assert err.startswith("planner: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv", [
    ["estimate", "--config", "gpt2", "--task", "causal-lm", "--batch-size", "²", "--seq-len", "8"],
    ["estimate", "--config", "a" * 5000 + ".json", "--task", "causal-lm", "--batch-size", "1", "--seq-len", "8"],
    ["estimate", "--config", "gpt2", "--task", "sequence-classification", "--num-labels", "1000000000000",
     "--batch-size", "1", "--seq-len", "8"],
])
def test_real_process_exit_status_2_one_line(argv):
    TRIED["estimate command lines"] += 1
    done = subprocess.run([sys.executable, "-m", "planner", *argv], capture_output=True, text=True, timeout=60,
                          cwd=CONFIGS.parents[1])
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("planner: error: "), done.stderr
