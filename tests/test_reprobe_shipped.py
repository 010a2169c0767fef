"""scripts/reprobe_shipped.py reads each shipped CUDA class back from its key: for every
shipped CUDA table, the scenario it reads gives the same key again (cache.technique_key), so
that re-probing after a format change rebuilds exactly the classes that were shipped."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import reprobe_shipped  # noqa: E402

from planner.probe import cache  # noqa: E402


def test_every_shipped_cuda_key_is_read_back_as_its_scenario():
    by_digest = reprobe_shipped.models_by_digest()
    checked = 0
    for path in sorted(cache.SHIPPED_DIR.glob("*.json")):
        for key in cache._read(path):
            if "|cuda-kernels=" not in key:
                continue
            assert path.stem in by_digest, f"{path.name}: no catalog model"
            assert any(cache.technique_key(shape, reprobe_shipped.scenario_of(key, shape)) == key
                       for _, shape in by_digest[path.stem]), key
            checked += 1
    assert checked >= 1000
