"""Randomized: the probe against simulated steps on scenarios drawn afresh every run (family,
depth, task, batch, sequence, optimizer, precision, checkpointing, accumulation,
attention). The seed is printed, so a failure names a reproducible case; the draw is run
in four parts so the suite's workers share it.
"""

import os
import random

from probe_comparison import assert_close, compare, deep, own_probe_cache  # noqa: F401 (the fixture)

RANDOM_SCENARIOS = int(os.environ.get("PROBE_RANDOM_SCENARIOS", "40"))
PARTS = 4
SEED = int(os.environ.get("PROBE_SEED", str(random.SystemRandom().randrange(2**32))))
FAMILIES = [("tiny-llama", "causal-lm"), ("tiny-gpt2", "causal-lm"), ("tiny-opt", "causal-lm"),
            ("tiny-neox", "causal-lm"), ("tiny-phi", "causal-lm"), ("tiny-distilbert", "sequence-classification"),
            ("tiny-distilbert", "masked-lm"), ("tiny-distilbert", "token-classification"),
            ("tiny-llama", "token-classification")]


def _random_scenarios(seed: int, count: int) -> list[tuple[str, int, dict]]:
    rng = random.Random(seed)
    drawn = []
    for _ in range(count):
        name, task = rng.choice(FAMILIES)
        values = dict(task=task, batch_size=rng.randint(1, 6), seq_len=rng.randint(2, 96),
                      optimizer=rng.choice(["adamw", "sgd", "adafactor", "hf-adafactor", "adamw8bit"]),
                      precision=rng.choice(["fp32", "bf16-mixed", "bf16", "fp16-mixed"]),
                      gradient_checkpointing=rng.random() < 0.4, grad_accum=rng.choice([1, 1, 2, 3]),
                      attn=rng.choice(["sdpa", "eager"]))
        drawn.append((name, rng.randint(1, 6), values))
    return drawn


def _check_part(part: int) -> None:
    """Scenarios part, part + PARTS, ... of one seed's draw: all PARTS parts run all of them."""
    print(f"\nprobe random scenarios: seed {SEED}, part {part + 1} of {PARTS} (rerun with PROBE_SEED={SEED})")
    drawn = list(enumerate(_random_scenarios(SEED, RANDOM_SCENARIOS)))[part::PARTS]
    failures = []
    for number, (name, layers, values) in drawn:
        label = f"#{number} {name} x{layers} {values}"
        try:
            estimated, measured = compare(deep(name, layers), values)
            assert_close(estimated, measured, label)
        except AssertionError as error:
            failures.append(str(error).splitlines()[0])
    assert not failures, f"seed {SEED}: {len(failures)} of {len(drawn)} off:\n" + "\n".join(failures)


# One class per part: pytest-xdist's loadscope schedules classes apart, so the parts run on
# both workers (scripts/test.sh).
class TestRandomScenariosPart1:
    def test_random_scenarios_match_simulated_steps(self):
        _check_part(0)


class TestRandomScenariosPart2:
    def test_random_scenarios_match_simulated_steps(self):
        _check_part(1)


class TestRandomScenariosPart3:
    def test_random_scenarios_match_simulated_steps(self):
        _check_part(2)


class TestRandomScenariosPart4:
    def test_random_scenarios_match_simulated_steps(self):
        _check_part(3)
