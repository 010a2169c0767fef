"""Bad input, tried systematically (hypothesis): config files, configs built from each
architecture's own keys with hostile values, scenario values, `planner batch` lines (the
issue-15 reproductions among them), `planner estimate` and `fit` flags, `runners` flags and
dashboard links. Every input gets either a valid estimate or a
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
from planner.batch import MAX_ERROR_CHARS
from planner.config_source import MAX_CONFIG_BYTES, config_from_bytes
from planner.errors import PlannerInputError
from planner.estimate import Estimate
from planner.loading import model_shape_for_config
from planner.scenario import Task
from tests.conftest import CONFIGS, tiny_config
from views.inputs import DEFAULTS as SIDEBAR_DEFAULTS

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


def strict_json(line: str):
    """json.loads, refusing NaN and Infinity as a strict JSON reader does."""
    def refuse(name):
        raise AssertionError(f"{name} in the output is not JSON: {line[:200]}")
    return json.loads(line, parse_constant=refuse)


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

# The issue-15 reproductions as config files beside the batch file (written by the test).
ISSUE_CONFIGS = {
    "t5-deep.json": {"model_type": "t5", "num_layers": 100_000, "d_model": 64, "num_heads": 2},
    "bart-deep.json": {"model_type": "bart", "encoder_layers": 100_000, "d_model": 64},
    "gpt2-positions.json": {"model_type": "gpt2", "n_positions": 10**12, "n_embd": 64, "n_head": 2, "n_layer": 2},
    "t5-wide.json": {"model_type": "t5", "d_ff": 10**12, "d_model": 64, "num_heads": 2, "num_layers": 2},
    "kv-heads.json": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3,
                      "num_hidden_layers": 2, "intermediate_size": 128},
    "mamba.json": {"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2},
    "rwkv.json": {"model_type": "rwkv", "hidden_size": 64, "num_hidden_layers": 2},
    "rotary.json": {**tiny_config("tiny-llama"), "partial_rotary_factor": "abc"},
    "dropout.json": {**tiny_config("tiny-gpt2"), "resid_pdrop": 5.0},
}
ISSUE_LINES = [json.dumps({"config": name, "task": "causal-lm", "batch_size": 1, "seq_len": 8})
               for name in ISSUE_CONFIGS] + [
    '{"id": NaN, "config": "gpt2", "task": "causal-lm", "batch_size": 1, "seq_len": 8}',
    json.dumps({"config": "x" * 300_000, "task": "causal-lm", "batch_size": 1, "seq_len": 8}),
    json.dumps({"id": "i" * 10_000, "config": "gpt2", "task": "causal-lm", "batch_size": 1, "seq_len": 8}),
]

batch_lines = st.one_of(
    st.sampled_from(ISSUE_LINES),
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
    for name, config in ISSUE_CONFIGS.items():
        (tmp_path / name).write_text(json.dumps(config), encoding="utf-8")
    path = tmp_path / "fuzz.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    capsys.readouterr()
    with no_hang():
        status = cli.main(["batch", str(path)])
    out = capsys.readouterr().out.splitlines()
    assert status == 0
    kept = [line for line in path.read_text(encoding="utf-8", errors="replace").split("\n") if line.strip()]
    assert len(out) == len(kept)
    for answer in map(strict_json, out):
        if "error" in answer:
            assert answer["error"] and "\n" not in answer["error"] and len(answer["error"]) <= MAX_ERROR_CHARS
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


# --- configs from each architecture's own keys (issue 15) ----------------------------------------

# Families the planner plans, and two it refuses (no attention heads): their config classes'
# own fields are the keys mutated, so a size under any architecture's name is tried.
ARCHITECTURES = ("gpt2", "llama", "t5", "bart", "bert", "mixtral", "qwen2_moe", "gpt_neox", "opt", "phi",
                 "distilbert", "mamba", "rwkv")
hostile_values = st.sampled_from([1, 8, 0.1, 0, -1, 3, 100_000, 10**12, 2**63, 10**30, 1.5, 5.0, -0.1, math.nan, math.inf,
                                  1e308, "abc", "", None, True, [], {}, [10**12], {"a": 10**12}])


def architecture_base(model_type: str) -> dict:
    """The config class's own defaults, every layer count cut to 2 and every other size to
    the largest power of two up to 64 (heads keep dividing widths; vocabularies and token ids
    are kept, as ids must stay inside the vocabulary; per-layer lists dropped), so a build
    takes milliseconds on the meta device."""
    from transformers import AutoConfig

    from planner.build_guard import _LAYER_COUNT, _NOT_A_SIZE

    base = {}
    for key, value in AutoConfig.for_model(model_type).to_dict().items():
        if isinstance(value, (dict, list)) or key in ("architectures", "dtype"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or _NOT_A_SIZE.search(key) \
                or "vocab" in key:
            base[key] = value
        else:
            base[key] = min(value, 2) if _LAYER_COUNT.search(key) else 1 << (min(value, 64).bit_length() - 1)
    return base


@st.composite
def architecture_configs(draw) -> dict:
    model_type = draw(st.sampled_from(ARCHITECTURES))
    config = architecture_base(model_type)
    keys = sorted(k for k, v in config.items() if isinstance(v, (int, float)) and k != "model_type")
    for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True)):
        config[key] = draw(hostile_values)
    return {**config, "model_type": model_type}


@settings(max_examples=40, deadline=timedelta(seconds=20), derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(config=architecture_configs(), task=st.sampled_from(list(Task)))
def test_architecture_keys_with_hostile_values_build_or_refuse_in_one_line(config, task):
    TRIED["architecture configs built"] += 1
    with no_hang(10):  # issue 15: any config answered or refused within 10 s
        try:
            shape = model_shape_for_config(json.loads(json.dumps(config)), task, 2, "fuzzed")
        except PlannerInputError as error:
            one_line_error(error)
            return
    assert 0 < shape.num_parameters <= 10**13 and shape.num_layers <= 512


# --- dashboard links ------------------------------------------------------------------------------

link_values = st.one_of(st.sampled_from(["²", "٣", "9" * 5000, "1e308", "1e-308", "nan", "inf", "-0", "10^20",
                                         str(10**20), "0x10", " 8 ", "+8", "", "true"]),
                        st.text(max_size=30), st.integers().map(str), st.floats().map(str))


@FAST
@given(params=st.dictionaries(st.one_of(st.sampled_from(sorted(SIDEBAR_DEFAULTS)),
                                        st.text(max_size=8)),
                              st.one_of(link_values, st.lists(link_values, max_size=3)), max_size=8))
def test_link_values_parse_within_bounds_or_are_named_as_dropped(params):
    from app_pages.query_state import decode_with_rejects
    from views.inputs import MAXIMA

    TRIED["dashboard links"] += 1
    values, rejected = decode_with_rejects(params)
    assert set(values).isdisjoint(rejected) and set(values) | set(rejected) <= set(SIDEBAR_DEFAULTS)
    for key, value in values.items():
        # LoRA alpha's default is None (it follows the rank, 2 x r); a link gives it a number.
        expected = float if SIDEBAR_DEFAULTS[key] is None else type(SIDEBAR_DEFAULTS[key])
        assert type(value) is expected, (key, value)
        if key in MAXIMA:
            assert 0 < value <= MAXIMA[key], (key, value)


# --- fit and runners command lines ----------------------------------------------------------------

number_flags = st.one_of(st.sampled_from(["0", "-1", "1", "24", "1e300", "1e-300", "nan", "inf", "²", str(10**12),
                                          str(10**30), "9" * 5000, "0.5", ""]), st.text(max_size=6))


@settings(max_examples=60, deadline=timedelta(seconds=10), derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(gib=number_flags, batch=number_flags, seq=number_flags, utilisation=number_flags,
       target=st.sampled_from(["--effective-batch", "--batch-size"]))
def test_fit_flags_give_a_ranking_or_one_line_exit_2(gib, batch, seq, utilisation, target, capsys):
    TRIED["fit command lines"] += 1
    capsys.readouterr()
    with no_hang():
        status = cli.main(["fit", "--config", str(CONFIGS / "tiny-gpt2.json"), "--gpu-memory-gib", gib, target, batch,
                           "--seq-len", seq, "--utilisation", utilisation, "--json"])
    out, err = capsys.readouterr()
    if status == 0:
        assert isinstance(json.loads(out), list) and not err
    else:
        assert status == cli.EXIT_BAD_INPUT and err.startswith("planner: error: ") and err.count("\n") == 1, err


@settings(max_examples=30, deadline=timedelta(seconds=10), derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(limit=number_flags, seed=number_flags)
def test_runners_flags_list_or_refuse_in_one_line(limit, seed, capsys, tmp_path, monkeypatch):
    """`history --limit` and `verify --seed`: a seed that passes reaches the run as given
    (the run itself is stood in for: only what is refused before it starts is tested)."""
    import runners.verify
    from runners.cli import main as runners_main

    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(runners.verify, "verify",
                        lambda request, timeout_s, on_progress: {"status": "ok", "seed": request.seed})
    TRIED["runners command lines"] += 2
    capsys.readouterr()
    for argv in (["history", "--limit", limit, "--json"],
                 ["verify", "--config", str(CONFIGS / "tiny-gpt2.json"), "--task", "causal-lm", "--batch-size", "1",
                  "--seq-len", "8", "--seed", seed, "--json"]):
        with no_hang():
            status = runners_main(argv)
        out, err = capsys.readouterr()
        if status == 0:
            answer = json.loads(out.splitlines()[-1])
            assert isinstance(answer, list) or 0 <= answer["seed"] < 2**32, answer
        else:
            assert status == 2 and err.startswith("runners: error: ") and err.count("\n") == 1, err
