"""The size a config would build, checked before anything is built.

Every path that turns a config into a model (shape building on the meta device, the probe,
verification runs) loads it through planner.shapes_from_config.load_transformers_config,
which calls `check_build_size` on the loaded PretrainedConfig. The check reads every field
the config class holds for its architecture (`to_dict()`: each `__init__` argument and
derived attribute under its stored name, attribute_map aliases resolved, sub-configs
nested), not a list of names, so a size under any architecture's own key is bounded:

- every integer size (widths, vocabularies, positions, experts, buckets...) is at most
  MAX_DIMENSION, and none times the model width may exceed MAX_MATRIX_ELEMENTS (one
  such matrix alone would dwarf any real model's largest);
- all counts of layers, blocks or depth (named so by the architecture) together are at
  most MAX_LAYERS: module construction is per layer, so this is what bounds a
  meta-device build's time and memory;
- every dropout-like probability is a number in [0, 1].

The exact parameter count is taken from the meta-device build, which these bounds keep
short (planner.shapes_from_config).

A count that creates modules without being named as layers, blocks or depth (ALBERT's
`inner_group_num` x `num_hidden_groups`; an expert count, where an architecture keeps one
module per expert) passes the names; `module_budget` stops such a build as it runs, at
MAX_MODULES submodules (ALBERT with 4,096 inner groups otherwise builds for 40 s).
"""

from __future__ import annotations

import contextlib
import math
import re
import threading

from planner.errors import PlannerInputError

# All layer counts together (encoder and decoder): the deepest published transformers have
# under 200. Module construction is per layer: 512 T5 blocks build on the meta device in
# about 2 s on one shared core, so estimate answers in under 10 s (tests/test_build_guard.py).
MAX_LAYERS = 512
MAX_DIMENSION = 1 << 27  # above any real width (65,536: T5-11B's d_ff), vocabulary (256K), context (10M), n-gram table (20M)
MAX_PARAMETERS = 10**13  # ten trillion: several times the largest published model
# One size times the width: a trillion elements, over a hundred times the largest single
# table published (a 256K vocabulary x 16K width, or 10M positions x 5K width, is 5e10 at most).
MAX_MATRIX_ELEMENTS = 10**12

# Submodules one build may register: Llama-2-70B registers 1,046, T5 with the 512 blocks
# MAX_LAYERS allows 11,282 (2.7 s on a shared core); at 0.25-0.7 ms each, 20,000 is 5-14 s.
MAX_MODULES = 20_000

# A field whose name ends so counts layers, blocks or depth: `num_layers`, `encoder_layers`,
# `n_layer`, `num_decoder_layers`, `num_hidden_layers`, `depth`, `num_blocks`.
_LAYER_COUNT = re.compile(r"(^|_)(layers?|blocks?|depths?)$")
# Not sizes, whatever their value: token ids name vocabulary entries, a rotary theta is a
# frequency base (an int in some configs), the label maps and version are bookkeeping.
_NOT_A_SIZE = re.compile(r"(^|_)(ids?|theta)$|^(id2label|label2id|transformers_version)$")
_PROBABILITY = re.compile(r"dropout|pdrop|layerdrop|drop_prob|drop_rate")


def _fields(values: dict, prefix: str = ""):
    """(dotted name, last name component, value, whether it is a list item) for every leaf
    of a config dict."""
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _fields(value, f"{name}.")
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, dict):
                    yield from _fields(item, f"{name}.")
                else:
                    yield name, str(key), item, True
        else:
            yield name, str(key), value, False


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_build_size(config) -> None:
    """PlannerInputError (one line) when `config`, a PretrainedConfig, would build a model
    beyond any real one, or holds a probability outside [0, 1]."""
    values = config.to_dict()
    # A field is stored under the class's own name; say the standard alias the user may have written too.
    aliases = {stored: alias for alias, stored in (getattr(config, "attribute_map", None) or {}).items()}
    width = getattr(config, "hidden_size", None)  # every config maps its width to this name
    width = width if _is_int(width) and 0 < width <= MAX_DIMENSION else 1
    total_layers = 0
    for name, key, value, listed in _fields(values):
        label = f"'{name}'" + (f" (alias '{aliases[name]}')" if name in aliases else "")
        if _PROBABILITY.search(key) and not _NOT_A_SIZE.search(key):
            _check_probability(label, value)
            continue
        if not _is_int(value) or _NOT_A_SIZE.search(key):
            continue
        if _LAYER_COUNT.search(key):
            if value > MAX_LAYERS:
                raise PlannerInputError(
                    f"config field {label} = {value:,} layers is beyond any real model (at most {MAX_LAYERS:,} "
                    "here): use the model's real config.json")
            # A list under a layer name holds per-layer flags or indices, not more layers.
            total_layers += 0 if listed else max(value, 0)
        elif value > MAX_DIMENSION:
            raise PlannerInputError(
                f"config field {label} = {value:,} is beyond any real model (at most {MAX_DIMENSION:,} here): "
                "use the model's real config.json")
        elif value * width > MAX_MATRIX_ELEMENTS:
            raise PlannerInputError(
                f"config field {label} = {value:,} times the width {width:,} is above {MAX_MATRIX_ELEMENTS:,} "
                "elements, beyond any real model: use the model's real config.json")
    if total_layers > MAX_LAYERS:
        raise PlannerInputError(
            f"config describes {total_layers:,} layers in all, beyond any real model (at most "
            f"{MAX_LAYERS:,} here): use the model's real config.json")


def _check_probability(label: str, value) -> None:
    if value is None or isinstance(value, bool):  # None: no dropout; a bool is a switch (ESM's token_dropout)
        return
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if number is None or not (math.isfinite(number) and 0 <= number <= 1):
        raise PlannerInputError(
            f"config field {label} = {value!r} must be a probability between 0 and 1: set it to a value in [0, 1]")


@contextlib.contextmanager
def module_budget(limit: int = MAX_MODULES):
    """Stop a model build on this thread with a one-line PlannerInputError once it has
    registered `limit` submodules (other threads' builds, the dashboard's other sessions,
    are not counted)."""
    import torch

    thread, count = threading.get_ident(), 0

    def count_one(module, name, submodule):
        nonlocal count
        if threading.get_ident() != thread:
            return
        count += 1
        if count > limit:
            raise PlannerInputError(f"config builds more than {limit:,} modules, beyond any real model "
                                    "(a group, expert or block count too large): use the model's real config.json")

    handle = torch.nn.modules.module.register_module_module_registration_hook(count_one)
    try:
        yield
    finally:
        handle.remove()
