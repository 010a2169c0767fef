"""Probe tables by (config, technique class, library versions): in memory, on disk, shipped.

A technique class is what changes the ops of the step: task and labels, precision,
checkpointing, attention implementation, training loop, whether the sequence reaches
a sliding window, and batch 1 (code special-cases it). Batch, sequence, depth and
accumulation are not in it otherwise (the table is a function of them) and neither is the optimizer (its state and step are exact without a
probe). Shipped tables live in planner/catalog/probes/, one file per config; computed ones
in $PLANNER_DATA_DIR/probes or ~/.cache/training-memory-planner/probes. A table is found
only under the versions of torch, transformers and accelerate it was probed with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import threading
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path

from planner.config_identity import config_table_digest
from planner.finetune import Method
from planner.model_shape import ModelShape
from planner.probe.table import ProbeTable, poly_value
from planner.scenario import Checkpointing, Device, Engine, Precision, Scenario, Task

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "catalog" / "probes"
# Bumped whenever what a probe records or how it is solved changes: older tables are not read.
PROBE_FORMAT = 4
# CUDA-kernel classes moved on alone: format 4 keeps the sizes CUDA's memory-efficient attention
# rounds up (a ceil32(s) log-sum-exp, masks padded to ceil8(s) columns; planner.probe.table),
# which format 3 held at their probe-size values (32, or no table at all). Format 5 takes CUDA's
# path where a fake kernel does not: input-buffer gradient sums in place as a real run makes
# them (planner.probe.accumulation), and the storages cuBLAS and column reductions make marked
# for the allocator's replay (planner.probe.recorder, planner.reserved).
# CPU format 4 and CUDA format 6: the tracker's multi-gradient hooks keep no gradient
# (planner.probe.memtracker); only models with a module whose inputs come from distinct autograd
# nodes changed (scripts/carry_shipped_tables.py carried the others' shipped tables over).
# CUDA format 7: each fused attention backward marked for its kernels' scratch
# (planner.attention_scratch), and column reductions of transposed tensors marked as CUDA's
# reduction kernel sees them (planner.probe.recorder: Qwen3's per-head norms' weight gradients).
# CUDA format 8: each embedding backward marked with its sizes for the scratch CUDA's sort-and-
# segment kernel makes (planner.embedding_scratch).
CUDA_PROBE_FORMAT = 8
# The optimizer step's probe has its own: it runs no module forward, which format 4 changed.
STEP_PROBE_FORMAT = 3
_MEMORY: dict[tuple[str, str], ProbeTable | str] = {}  # a str is why the probe cannot run
# Per thread: progress sinks (each dashboard session probes on its own script thread and shows
# only its own probe's lines), and whether probing is held back (stored_only).
_progress = threading.local()
# One probe at a time in a process. torch's ModTracker (under MemTracker) hooks every module
# through global hooks (torch.nn.modules.module.register_module_forward_pre_hook and friends),
# so two probes on two threads (two dashboard sessions, or a rerun started while the abandoned
# run still probes) see each other's modules: measured, a KeyError on a weakref to the other
# model's Linear, "The Module hierarchy tracking is wrong", or "different operations at
# different sizes", each then remembered as the model's reason not to probe.
_PROBE_LOCK = threading.RLock()


@functools.cache
def library_versions() -> str:
    return ",".join(f"{name}={package_version(name)}" for name in ("torch", "transformers", "accelerate"))


@functools.cache
def package_version(name: str) -> str:
    """An installed package's version, read once: importlib.metadata scans the installed
    distributions on every call (0.36 ms here), and an adapter plan's key names PEFT's and
    bitsandbytes' versions (thousands of keys in one fit search)."""
    return metadata.version(name)


def config_digest(shape: ModelShape) -> str:
    """The table file's name: the config's digest without the keys that only name the
    checkpoint (planner.config_identity), so a renamed copy of a model reads its tables."""
    return config_table_digest(shape.source_config)


def window_exceeded(shape: ModelShape, scenario: Scenario) -> bool:
    return shape.sliding_window is not None and scenario.seq_len >= shape.sliding_window


def _finetune_parts(scenario: Scenario) -> list[str]:
    """What of the fine-tuning method changes the step's tensors (none for full fine-tuning,
    so its keys stay as they were): the adapters' rank and targets, whether their dropout
    runs (p = 0 is an Identity in PEFT), the 4-bit base, and PEFT's version."""
    method = scenario.finetune
    if not method.uses_adapters:
        return []
    parts = [(f"{method.method.value}:r={method.lora_r}:dropout={'on' if method.lora_dropout > 0 else 'off'}"
              f":targets={method.targets_text}"), f"peft={package_version('peft')}"]
    if method.method is Method.QLORA:
        # Dequantising a double-quantised weight first dequantises its absmax (a temporary);
        # the kernels differ by type (LoRA's keys stay as they were).
        parts.append(f"4bit={method.quant_type}:double-quant={'on' if method.double_quant else 'off'}"
                     f":bitsandbytes={package_version('bitsandbytes')}")
    return parts


# CUDA plans are probed with the kernels of the plan's GPU (planner.probe.fake_cuda), one
# architecture standing for each class of GPUs on which torch 2.13's SDPA selection
# (sdp_utils.cpp, as fake_cuda transcribes it) reads the same for every call:
# - sm80: Ampere and later (8.0 to 12.1) but for the two below, and a GPU not known. Flash
#   attention, memory-efficient and math read only `major >= 8` and the 8.0-12.1 ranges there;
#   cuDNN attention would read sm90 and sm10x, but torch's own cuDNN (9.10.2) is not preferred
#   (check_prefer_cudnn_attention), so SDPA never reaches it (math accepts every call first).
# - sm86: 8.6 to 8.9 and 12.x (A10, L4, RTX 3090 / 4090), where flash refuses a backward with a
#   head dimension over 192 (check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120).
#   Only a call with such a head can tell them from sm80, so sm80's table stands for them
#   unless it recorded one (probe_table).
# - sm75: 7.0 to 7.5 (V100, T4): no flash attention (check_flash_attention_hardware_support),
#   and the memory-efficient kernel, whose filters read only `major >= 7` and `major >= 8`
#   there, refuses grouped-query attention in torch 2.13, which then takes the math path and
#   keeps every layer's attention matrix (benchmarks/results/pre_ampere_attention.md).
# - any other capability is a class of its own, probed on its own kernels.
CUDA_PROBE_ARCH = "sm80"  # what a CUDA plan takes when its GPU is not known
SM86, SM75 = "sm86", "sm75"
_SM86_LIKE = ((8, 6), (8, 9)), ((12, 0), (12, 1))
FLASH_HEAD_DIM_SM86 = 192  # above it flash refuses a backward on sm86-like GPUs


def kernel_class(capability: tuple[int, int] | None) -> str:
    """The architecture whose kernels stand for a GPU of `capability` (the comment above)."""
    if capability is None:
        return CUDA_PROBE_ARCH
    if any(low <= capability <= high for low, high in _SM86_LIKE):
        return SM86
    if (8, 0) <= capability <= (12, 1):
        return CUDA_PROBE_ARCH
    if (7, 0) <= capability < (8, 0):
        return SM75
    major, minor = capability
    return f"sm{major}{minor}"


def class_capability(arch: str) -> tuple[int, int] | None:
    """A compute capability whose kernel_class is `arch` (None for sm80's: a GPU not known)."""
    return None if arch == CUDA_PROBE_ARCH else (int(arch[2:-1]), int(arch[-1]))


_CLASS_GPUS = {CUDA_PROBE_ARCH: "Ampere and later, and a GPU not named", SM86: "A10, L4, RTX 30 and 40 series",
               SM75: "T4 and V100: no flash attention"}


def kernels_label(scenario: Scenario) -> str:
    """Whose kernels a CUDA plan is probed with, in words (the estimate's note)."""
    arch = probe_gpu(scenario)
    gpus = _CLASS_GPUS.get(arch, f"compute capability {arch[2:-1]}.{arch[-1]}")
    return f"{arch}'s CUDA kernels ({gpus})"


def probe_gpu(scenario: Scenario) -> str | None:
    """The GPU architecture whose kernels a probe of `scenario` takes; None, the CPU's."""
    return kernel_class(scenario.compute_capability) if scenario.device is Device.CUDA else None


FP16_AUTOCAST = "autocast=fp16"  # a CUDA fp16-mixed class probed under autocast (technique_key)


def technique_key(shape: ModelShape, scenario: Scenario) -> str:
    labels = scenario.num_labels if scenario.task.uses_labels else 0
    parts = [scenario.task.value, f"labels={labels}", scenario.precision.value,
             "checkpointing" if scenario.checkpointing is Checkpointing.EVERY_LAYER else "no-checkpointing",
             scenario.attention.value, scenario.engine.value,
             "window-reached" if window_exceeded(shape, scenario) else "within-window",
             *(["batch-1"] if scenario.batch_size == 1 else []),  # other keys stay as they were
             # A sequence-to-sequence table is a function of b and s at one target length.
             *([f"target={scenario.target_len}"] if scenario.task is Task.SEQ2SEQ_LM else []),
             *_finetune_parts(scenario),
             # With adapters and checkpointing the embedding output is a leaf that requires a
             # gradient: tables recorded before the tracker let go of its gradient hooks counted the
             # previous micro-batch's leaf and gradient (planner.probe.memtracker) and are not read.
             *(["grad-hooks=released"] if scenario.finetune.uses_adapters
               and scenario.checkpointing is Checkpointing.EVERY_LAYER else []),
             # accelerate runs fp16-mixed as fp32 on a CPU: CUDA tables recorded before the probe
             # autocast it as on a GPU (planner.probe.build.autocast_as_on_cuda) held fp32's
             # activations, and are not read.
             *([FP16_AUTOCAST] if scenario.device is Device.CUDA and scenario.precision is Precision.FP16_MIXED
               else []),
             *([f"cuda-kernels={probe_gpu(scenario)}"] if scenario.device is Device.CUDA else []),
             f"probe-format={CUDA_PROBE_FORMAT if scenario.device is Device.CUDA else PROBE_FORMAT}",
             library_versions()]
    return "|".join(parts)


UNSUPPORTED = "unsupported"  # a stored entry holding the reason a class cannot be probed
# A stored entry naming another key of the same file whose table is this class's too: a class
# probed on another architecture's kernels that recorded the very same step (the shipping
# script checks it, scripts/ship_kernel_classes.py), stored once.
SAME_AS = "same_as"


def _user_dir() -> Path:
    base = os.environ.get("PLANNER_DATA_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "training-memory-planner") / "probes"


# Parsed table files by path, with the (mtime, size) they were parsed at: a shipped file holds
# every class of a model (up to 4.6 MB), and each class looked up that is not yet in _MEMORY
# re-parsed it whole (a fit search or `planner batch` asks for dozens).
_PARSED: dict[Path, tuple[tuple[int, int], dict]] = {}


def _read(path: Path) -> dict:
    """The file's tables (empty when absent or unreadable); shared between callers: never mutate."""
    try:
        status = path.stat()
        version = (status.st_mtime_ns, status.st_size)
        parsed = _PARSED.get(path)
        if parsed is not None and parsed[0] == version:
            return parsed[1]
        tables = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    _PARSED[path] = (version, tables)
    return tables


@contextlib.contextmanager
def probe_progress(sink: Callable[[str], None]) -> Iterator[None]:
    """Send probe progress lines to `sink` while inside (the CLI prints them, the dashboard shows them)."""
    sinks = _sinks()
    sinks.append(sink)
    try:
        yield
    finally:
        sinks.remove(sink)


class NotProbedYet(Exception):
    """Raised inside `stored_only()` where an answer needs a probe that has not run yet."""


@contextlib.contextmanager
def stored_only() -> Iterator[None]:
    """Inside (this thread only): answer from tables in memory, shipped or cached, and raise
    NotProbedYet where one would have to be probed. A page draws what is known at once and
    offers the rest (a new model's techniques chart: seconds of probing per technique)."""
    previous = getattr(_progress, "stored_only", False)
    _progress.stored_only = True
    try:
        yield
    finally:
        _progress.stored_only = previous


def _sinks() -> list[Callable[[str], None]]:
    if not hasattr(_progress, "sinks"):
        _progress.sinks = []
    return _progress.sinks


def _report(message: str) -> None:
    for sink in list(_sinks()):
        sink(message)


def _compute(shape: ModelShape, scenario: Scenario, key: str) -> ProbeTable:
    from planner.probe.run import BlocksNotFound, full_depth, layout_for
    from planner.shapes_from_config import load_transformers_config

    config_dict = json.loads(shape.source_config)
    config = load_transformers_config(config_dict, scenario.task, scenario.num_labels)
    layout = layout_for(config, scenario.task)
    _report(f"probing {shape.name} ({key.rsplit('|', 1)[0]}): the model's own step on fake tensors")
    try:
        return _compute_at(shape, scenario, key, config_dict, config, layout)
    except BlocksNotFound as error:
        # No ModuleList holds the blocks one by one (ALBERT shares one layer group): every
        # block is run, and nothing needs to repeat.
        _report(f"{error}: probing all {layout.num_layers} blocks")
        return _compute_at(shape, scenario, key, config_dict, config, full_depth(layout.num_layers))


def _compute_at(shape: ModelShape, scenario: Scenario, key: str, config_dict: dict, config, layout) -> ProbeTable:
    from planner.probe.run import ProbeUnsupported, record_probes
    from planner.probe.solve import solve

    exceeded = window_exceeded(shape, scenario)
    gpu = probe_gpu(scenario)
    # fp32 weights, gradients, init, slack (QLoRA: the fp32 copy it is quantised from, saved and loaded)
    needed = 4 * 4 * _reduced_parameters(shape, len(layout.probed))
    if scenario.finetune.method is Method.QLORA and gpu is None:
        # On the CPU, QLoRA is probed as a user runs it: transformers quantises real weights as
        # it loads them (planner.probe.build.quantized_lora), on real tensors if they fit. CUDA
        # plans take the same quantiser on fake tensors (planner.probe.fake_quantized), with
        # bitsandbytes' CUDA matmul.
        if needed > _available_ram_bytes() // 2:
            raise ProbeUnsupported(f"QLoRA is probed on real tensors (a 4-bit base is quantised from real "
                                   f"weights) and {shape.name}'s reduced copy needs about {needed / 2**30:.1f} GiB")
        _report(f"QLoRA's base is quantised from real weights: probing {shape.name} on small real tensors")
        return solve(record_probes(config_dict, config, scenario, layout, exceeded, _report, real=True), layout, key,
                     on_real_tensors=True)
    try:
        return solve(record_probes(config_dict, config, scenario, layout, exceeded, _report, gpu=gpu), layout, key)
    except ProbeUnsupported:
        raise
    except Exception as error:
        if gpu is not None:  # CUDA's kernels are taken on fake tensors only
            raise ProbeUnsupported(f"fake tensors cannot run the model's step with CUDA's kernels "
                                   f"({type(error).__name__}: {str(error).splitlines()[0][:80]})") from None
        # The model's code reads tensor values (a nonzero() in its loss) or has no fake kernel
        # for this case (a mixture of experts' fp32 grouped matmul): real tensors, if they fit.
        if needed > _available_ram_bytes() // 2:
            raise ProbeUnsupported(f"fake tensors cannot run the model's step ({type(error).__name__}: "
                                   f"{str(error).splitlines()[0][:80]}) and its reduced copy needs about "
                                   f"{needed / 2**30:.1f} GiB to probe on real tensors") from None
        _report(f"fake tensors cannot run {shape.name}'s step ({type(error).__name__}): "
                "probing on small real tensors")
        recordings = record_probes(config_dict, config, scenario, layout, exceeded, _report, real=True)
        return solve(recordings, layout, key, on_real_tensors=True)


def _reduced_parameters(shape: ModelShape, blocks: int) -> int:
    per_block = shape.stats.block_elements // max(shape.num_layers, 1)
    return shape.stats.num_elements - shape.stats.block_elements + per_block * blocks


def _available_ram_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def is_ready(shape: ModelShape, scenario: Scenario) -> bool:
    """True when this scenario's table is in memory or stored: no probe will run."""
    if shape.source_config is None:
        return True
    if probe_gpu(scenario) == SM86:
        if not is_ready(shape, dataclasses.replace(scenario, compute_capability=(8, 0))):
            return False
        if _ampere_standing_in(shape, scenario) is not None:  # read, not probed
            return True
    digest, key = config_digest(shape), technique_key(shape, scenario)
    return (digest, key) in _MEMORY or any(key in _read(path) for path in
                                           (SHIPPED_DIR / f"{digest}.json", _user_dir() / f"{digest}.json"))


def _ampere_standing_in(shape: ModelShape, scenario: Scenario) -> ProbeTable | str | None:
    """sm80's table (or why it cannot be probed) where it stands for an sm86-like plan: SDPA
    then chose alike on every call (kernel_class). None where the plan needs its own."""
    if probe_gpu(scenario) != SM86:
        return None
    ampere = probe_table(shape, dataclasses.replace(scenario, compute_capability=(8, 0)))
    return ampere if isinstance(ampere, str) or not flash_head_over_sm86_limit(ampere) else None


def flash_head_over_sm86_limit(table: ProbeTable) -> bool:
    """Whether sm80's `table` recorded a flash backward with a head dimension sm86-like GPUs'
    flash refuses (kernel_class); True when it cannot tell (no trace)."""
    from planner.attention_scratch import FLASH

    if table.trace is None:
        return True
    return any(backend == FLASH and poly_value(dims[5], 1, 1) > FLASH_HEAD_DIM_SM86
               for _, backend, _, dims, _ in table.trace.attention_backwards)


def _stored_or_computed(shape: ModelShape, key: str, decode: Callable[[dict], object],
                        compute: Callable[[], object], encode: Callable[[object], dict]):
    """Memory, then the shipped file, then the user's cache, else `compute()` (stored for next
    time); a failure is remembered as the one-line reason, returned as a string."""
    if shape.source_config is None:
        return "the model was not built from a config"
    digest = config_digest(shape)
    found = _known(digest, key, decode)
    if found is not None:
        return found
    if getattr(_progress, "stored_only", False):
        raise NotProbedYet(key)
    if not _PROBE_LOCK.acquire(blocking=False):
        _report("another probe is running in this process: waiting for it to finish")
        _PROBE_LOCK.acquire()
    try:
        found = _known(digest, key, decode)  # the probe waited for may have been this one
        if found is not None:
            return found
        from planner.probe.run import ProbeUnsupported

        try:
            found = compute()
        except ProbeUnsupported as error:
            found = str(error)
        except Exception as error:  # the model's own code failed on fake tensors
            found = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        _MEMORY[(digest, key)] = found
        if not isinstance(found, str):
            _store_entry(key, encode(found), _user_dir() / f"{digest}.json")
        return found
    finally:
        _PROBE_LOCK.release()


def _known(digest: str, key: str, decode: Callable[[dict], object]):
    """The table (or reason) already in memory, shipped or in the user's cache; None if none."""
    found = _MEMORY.get((digest, key))
    if found is not None:
        return found
    for path in (SHIPPED_DIR / f"{digest}.json", _user_dir() / f"{digest}.json"):
        stored = _read(path).get(key)
        if stored is not None and SAME_AS in stored:
            stored = _read(path).get(stored[SAME_AS])
        if stored is not None:
            # A shipped class the probe cannot run keeps its reason (scripts/build_probe_tables.py).
            _MEMORY[(digest, key)] = stored[UNSUPPORTED] if UNSUPPORTED in stored else decode(stored)
            return _MEMORY[(digest, key)]
    return None


def probe_table(shape: ModelShape, scenario: Scenario) -> ProbeTable | str:
    """The table for this scenario's technique class, probing once if none is stored;
    a string says why the model cannot be probed (the caller falls back and says so)."""
    standing_in = _ampere_standing_in(shape, scenario)
    if standing_in is not None:
        return standing_in
    key = technique_key(shape, scenario)
    return _stored_or_computed(shape, key, ProbeTable.from_json, lambda: _compute(shape, scenario, key),
                               ProbeTable.to_json)


def current_format(key: str) -> int:
    """The probe format a stored key of its kind is read under now: an optimizer step's, a
    CUDA-kernel class's or a CPU class's (technique_key, step_key)."""
    if key.startswith("optimizer-step|"):
        return STEP_PROBE_FORMAT
    return CUDA_PROBE_FORMAT if "|cuda-kernels=" in key else PROBE_FORMAT


def step_key(shape: ModelShape, scenario: Scenario) -> str:
    labels = scenario.num_labels if scenario.task.uses_labels else 0
    # "trainer-groups": the Trainer's step is probed with its own parameter groups (since
    # probe format 3; earlier entries for the Trainer are not read).
    engine = scenario.engine.value + ("+trainer-groups" if scenario.engine is Engine.TRAINER else "")
    return "|".join(["optimizer-step", scenario.task.value, f"labels={labels}", scenario.optimizer.value,
                     scenario.precision.value, engine, *_finetune_parts(scenario), f"probe-format={STEP_PROBE_FORMAT}",
                     library_versions()])


def probed_step_temporaries(shape: ModelShape, scenario: Scenario) -> int | str:
    """The optimizer step's temporaries (bytes) from planner.probe.step, or why not."""
    def compute() -> int:
        from planner.probe.step import step_temporaries

        _report(f"probing {shape.name}'s {scenario.optimizer.value} step on fake tensors")
        return step_temporaries(shape, scenario)

    return _stored_or_computed(shape, step_key(shape, scenario), lambda stored: int(stored["step_temporaries_bytes"]),
                               compute, lambda value: {"step_temporaries_bytes": value})


def store_unsupported(key: str, reason: str, path: Path) -> None:
    """Record that a class cannot be probed, and why (only the shipping script does: a
    failure for want of memory belongs to one machine)."""
    _store_entry(key, {UNSUPPORTED: reason}, path)


def store(table: ProbeTable, path: Path) -> None:
    """Add `table` to the file of its config."""
    _store_entry(table.key, table.to_json(), path)


def store_same_as(key: str, same_as: str, path: Path) -> None:
    """Record that class `key`'s table is the one stored under `same_as` (SAME_AS)."""
    _store_entry(key, {SAME_AS: same_as}, path)


def store_step(shape: ModelShape, scenario: Scenario, step_bytes: int, path: Path) -> None:
    _store_entry(step_key(shape, scenario), {"step_temporaries_bytes": step_bytes}, path)


def _store_entry(key: str, entry: dict, path: Path) -> None:
    """Written whole, then renamed: never half a file."""
    try:
        tables = {**_read(path), key: entry}  # a copy: what _read returns is shared
        write_tables(tables, path)
    except OSError:
        pass  # an unwritable cache costs a re-probe next time, never the answer


def write_tables(tables: dict, path: Path) -> None:
    """A config's whole file, written then renamed: never half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(tables, separators=(",", ":")))
    temporary.replace(path)
