"""Carry the shipped probe tables that a probe-format change leaves as they were to the new
format, and name the catalog models whose tables must be probed again.

CPU format 4 and CUDA format 6 changed one thing: the tracker's multi-gradient hooks keep no
gradient (planner.probe.memtracker, `count_only_multi_grad_hook`). torch's hook kept a module
input's gradient until the module's other inputs had theirs, which changes a table only where a
module is called with inputs that require a gradient and come from distinct autograd nodes
(their gradients arrive at different times: BERT's `BertOutput(hidden_states, input_tensor)`, a
mixture-of-experts' routed tokens and routing weights). Inputs from one node get their gradients
together, the hook ran at once and kept nothing longer than the node itself did.

For each shipped file, one forward and backward of its catalog model (the probe's reduced model on
fake tensors, under every task, attention and adapter setting its shipped classes use) is run with
ModTracker's own rule for which inputs get the hook (torch.distributed._tools.mod_tracker,
`_fw_pre_hook`: the positional inputs, flattened, that require a gradient). A file whose model has
no such module has its CPU and CUDA class keys moved to the current formats as they are; the
others are listed (probe them again: scripts/reprobe_shipped.py). tests/test_probe_cache.py probes
carried classes again and compares. Optimizer-step entries keep their own format
(planner.probe.cache.STEP_PROBE_FORMAT: the step has no module forward).

    python scripts/carry_shipped_tables.py [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from torch.autograd.graph import _get_grad_fn_or_grad_acc  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from planner.probe import cache  # noqa: E402
from reprobe_shipped import current_key, is_class_key, models_by_digest, scenario_for_key  # noqa: E402


def modules_with_inputs_from_distinct_nodes(shape, scenario) -> list[str]:
    """Class names of the modules one training step calls with inputs that require a gradient
    and come from more than one autograd node (module doc)."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensorMode

    from planner.probe.build import build_model, synthetic_batch
    from planner.probe.fake_mode import fake_batch, simulation
    from planner.probe.run import layout_for, reduced_config
    from planner.shapes_from_config import load_transformers_config

    config_dict = json.loads(shape.source_config)
    config = load_transformers_config(config_dict, scenario.task, scenario.num_labels)
    reduced = reduced_config(config, layout_for(config, scenario.task), cache.window_exceeded(shape, scenario))
    scenario = dataclasses.replace(scenario, batch_size=2, seq_len=8)
    found: list[str] = []

    def check_inputs(module, inputs):
        flat, _ = tree_flatten(inputs)
        nodes = {id(_get_grad_fn_or_grad_acc(t)) for t in flat if isinstance(t, torch.Tensor) and t.requires_grad}
        if len(nodes) > 1:
            found.append(type(module).__name__)

    fake = FakeTensorMode()
    with fake, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(config_dict, scenario, config=reduced)
    batch = fake_batch(fake, synthetic_batch(config_dict, scenario))
    handle = torch.nn.modules.module.register_module_forward_pre_hook(check_inputs)
    try:
        with simulation(fake), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(**batch).loss.backward()
    finally:
        handle.remove()
    return sorted(set(found))


def carried(key: str, entry: dict) -> tuple[str, dict]:
    """The entry under the current format: its file key and the key it holds (a table's own)."""
    new_key = current_key(key)
    if isinstance(entry, dict) and entry.get("key") == key:
        entry = {**entry, "key": new_key}
    return new_key, entry


def main() -> int:
    os.environ["PLANNER_DATA_DIR"] = tempfile.mkdtemp(prefix="planner-carry-")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="list, write nothing")
    args = parser.parse_args()
    by_digest = models_by_digest()
    to_probe = []
    for path in sorted(cache.SHIPPED_DIR.glob("*.json")):
        tables = cache._read(path)
        stale = [key for key in tables if is_class_key(key) and current_key(key) != key]
        if not stale:
            continue
        shapes = by_digest.get(path.stem)
        if shapes is None:
            print(f"{path.name}: no catalog model: left as it is", flush=True)
            continue
        settings = {}
        for key in stale:
            found = scenario_for_key(key, shapes)
            if found is None:
                settings[key] = None  # no catalog scenario reads it back: cannot tell
            else:
                settings.setdefault((found[1].task, found[1].attention, found[1].finetune.method), found)
        found = set()
        for setting in settings.values():
            if setting is None:
                found.add("(a key no catalog scenario reads back)")
                continue
            shape, scenario = setting
            try:
                found.update(modules_with_inputs_from_distinct_nodes(shape, scenario))
            except Exception as error:  # cannot tell: probe it again
                found.add(f"(not run: {type(error).__name__}: {str(error).splitlines()[0][:80]})")
        name = shapes[0][0]
        if found:
            to_probe.append(name)
            print(f"{name} ({path.name}): {len(stale)} classes to probe again: {', '.join(sorted(found))}", flush=True)
            continue
        print(f"{name} ({path.name}): {len(stale)} classes carried ({len(settings)} settings run)", flush=True)
        if not args.dry_run:
            cache.write_tables(dict(carried(key, entry) if key in stale else (key, entry)
                                    for key, entry in tables.items()), path)
    print(f"to probe again: {' '.join(to_probe) if to_probe else 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
