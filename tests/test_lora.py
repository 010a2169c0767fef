"""LoRA planned against LoRA measured: the probe runs the PEFT-wrapped model's own step
(frozen linears saving their inputs, the adapters' dropout and A-path, checkpointing
through PEFT), and the estimate must match a full-depth measured step of the model as
`get_peft_model` builds it (real CPU tensors, or fake ones, which count alike), in both
loops. States are exact (tests/test_adapters.py); the bar is the probe's, 0.1% of the peak."""

import json

import pytest

from probe_comparison import assert_close, compare, deep, own_probe_cache  # noqa: F401 (the fixture)
from planner.cli import main
from planner.estimate import estimate
from planner.loading import model_shape_for_config
from planner.scenario import scenario_from_values
from runners.request import Mode

# More combinations (optimizers, accumulation, every family) belong to the randomized benchmark.
CASES = [
    ("tiny-llama", "causal-lm", {"gradient_checkpointing": True, "lora_targets": "q_proj,v_proj"}, Mode.CPU),
    ("tiny-llama", "causal-lm", {"engine": "trainer", "precision": "bf16-mixed"}, Mode.CPU),
    # Pure bf16: PEFT keeps the adapters in fp32 on the bf16 base (extended: conftest.py; pure bf16
    # LoRA on CUDA kernels is in the suite below).
    pytest.param("tiny-neox", "causal-lm", {"lora_dropout": 0.0, "gradient_checkpointing": True, "precision": "bf16"},
                 Mode.SIMULATE, marks=pytest.mark.extended),
    # PEFT trains the classifier head in full (modules_to_save), a deep copy of it.
    ("tiny-distilbert", "sequence-classification", {"lora_targets": "q_lin,v_lin"}, Mode.SIMULATE),
    # The Trainer with checkpointing once measured two fp32 (b, s, h) tensors more than planned: torch
    # MemTracker's gradient hooks kept the previous micro-batch's embedding output (a leaf that
    # requires a gradient under checkpointing) and its gradient alive (planner.probe.memtracker).
    ("tiny-gpt2", "causal-lm", {"engine": "trainer", "gradient_checkpointing": True}, Mode.CPU),
]


@pytest.mark.parametrize("name,task,overrides,mode", CASES,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'defaults'}-{m.value}"
                              for n, _, o, m in (c.values if hasattr(c, "values") else c for c in CASES)])
def test_lora_probe_matches_the_measured_peft_step(name, task, overrides, mode):
    values = {"task": task, "batch_size": 3, "seq_len": 40, "finetune": "lora", "lora_r": 8, **overrides}
    estimated, measured = compare(deep(name, 5), values, mode)
    assert_close(estimated, measured, name)
    assert estimated.optimizer_state_bytes == measured["optimizer_state_bytes"]


@pytest.mark.parametrize("name,overrides", [
    pytest.param("tiny-llama", {"precision": "bf16-mixed"}, marks=pytest.mark.extended),
    ("tiny-neox", {"precision": "bf16", "gradient_checkpointing": True, "optimizer": "adafactor"}),
])
def test_lora_on_cuda_is_probed_with_cuda_kernels_as_a_full_depth_fake_cuda_step_measures(name, overrides):
    """The probe of the reduced model, extrapolated to 5 blocks, against the full 5-block step
    under the same CUDA kernels (planner.probe.fake_cuda, sm80). Weights and optimizer state
    are the estimate's CUDA figures (512-byte blocks; AdamW's step counters on the host) and
    the simulation's exact CPU sizes, so what is compared is everything above them, phase by
    phase: gradients, activations and temporaries, the optimizer step's included."""
    from planner.probe.cache import CUDA_PROBE_ARCH
    from runners.simulate_measure import simulate_step

    config = deep(name, 5)
    values = {"task": "causal-lm", "batch_size": 3, "seq_len": 40, "finetune": "lora", "lora_r": 8,
              "device": "cuda", **overrides}
    scenario = scenario_from_values(**values)
    estimated = estimate(model_shape_for_config(config, scenario.task, scenario.num_labels, "tiny"), scenario)
    measured = simulate_step(config, values, gpu=CUDA_PROBE_ARCH)
    above_states = measured["weights_bytes"] + measured["optimizer_state_bytes"]
    for phase in estimated.phases:
        got = phase.total - estimated.weights_bytes - estimated.optimizer_state_bytes
        want = measured["phase_peak_bytes"][phase.phase.value] - above_states
        assert got == want, f"{name} {phase.phase.value}: {got:,} B above the states, measured {want:,} B"
    assert estimated.peak_phase.value == measured["peak_phase"]
    assert any("CUDA kernels" in note for note in estimated.notes)


def _cli(capsys, *arguments: str) -> tuple[int, str, str]:
    # In process: the CLI's own entry point (tests/test_cli.py runs `python -m planner` itself).
    status = main(["estimate", *arguments])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_cli_plans_lora_with_its_trainable_count_and_frozen_base(capsys):
    status, out, err = _cli(capsys, "--config", "pythia-160m", "--task", "causal-lm", "--batch-size", "2",
                            "--seq-len", "64", "--device", "cpu", "--finetune", "lora", "--lora-targets",
                            "query_key_value", "--json")
    assert status == 0, err
    result = json.loads(out)
    # 12 blocks x r (768 in + 2,304 out): the fused query_key_value projection.
    assert result["trainable_parameters"] == 12 * 16 * (768 + 2304)
    assert result["gradients_bytes"] == 4 * result["trainable_parameters"]
    assert result["frozen_weight_bytes"] == 4 * result["num_parameters"]
    assert result["scenario"]["finetune"] == "lora" and result["scenario"]["lora_alpha"] == 32


@pytest.mark.parametrize("arguments,words", [
    (("--lora-r", "0"), "rank"),
    (("--lora-alpha", "-1"), "alpha"),
    (("--lora-targets", "q_proj"), "not found"),
])
def test_bad_lora_input_is_one_line_and_exit_2(capsys, arguments, words):
    status, _, err = _cli(capsys, "--config", "pythia-160m", "--task", "causal-lm", "--batch-size", "2",
                          "--seq-len", "64", "--device", "cpu", "--finetune", "lora", *arguments)
    assert status == 2
    lines = [line for line in err.splitlines() if line.startswith("planner: error")]
    assert len(lines) == 1 and words in lines[0], err


def _embedding_output_after_a_step(tracker_class):
    """A weak reference to the embedding output of one LoRA step with checkpointing, taken after
    the step's backward (and, with a tracker, what its caller does then), and the tracker."""
    import gc
    import weakref

    from conftest import tiny_config
    from planner.probe.build import build_model, synthetic_batch

    config = tiny_config("tiny-gpt2")
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=16, device="cpu", finetune="lora",
                                    gradient_checkpointing=True)
    model = build_model(config, scenario)
    kept = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, output: kept.append(weakref.ref(output)))
    batch = synthetic_batch(config, scenario)
    tracker = tracker_class() if tracker_class is not None else None
    if tracker is not None:
        tracker.__enter__()
    model(**batch).loss.backward()
    if hasattr(tracker, "release_grad_hooks"):
        tracker.release_grad_hooks()  # what the verification runs do when a backward ends
    gc.collect()
    [output] = kept
    return output, tracker


def test_the_tracker_frees_the_checkpointed_embedding_output_as_a_run_without_it_does():
    """With checkpointing, enable_input_require_grads makes the embedding output a leaf that
    requires a gradient. A run without a tracker frees it (and its .grad) when backward ends.
    torch's MemTracker keeps it alive through the gradient hooks its module tracker drops the
    handles of (a cycle through autograd nodes), so the next micro-batch's peak counted it;
    TrainableMemTracker releases them (planner.probe.memtracker)."""
    from planner.probe.memtracker import TrainableMemTracker

    untracked, _ = _embedding_output_after_a_step(None)
    assert untracked() is None
    ours, tracker = _embedding_output_after_a_step(TrainableMemTracker)
    assert ours() is None
    tracker.__exit__(None, None, None)
    # The cause: the same tracker keeping the hooks, as torch 2.13's MemTracker does, keeps the
    # output and its gradient (if this starts failing, torch frees the cycle itself and the
    # release may go).
    class KeepingTheHooks(TrainableMemTracker):
        def release_grad_hooks(self) -> None:
            pass

    kept, tracker = _embedding_output_after_a_step(KeepingTheHooks)
    assert kept() is not None and kept().grad is not None
    tracker.__exit__(None, None, None)
