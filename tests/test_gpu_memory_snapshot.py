"""benchmarks/gpu_memory_snapshot.py's trace replay, on a hand-made allocator trace (the
format of torch.cuda.memory._snapshot()["device_traces"]), and its refusal without a GPU."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_memory_snapshot as snapshot  # noqa: E402


def test_the_peak_is_the_running_maximum_of_allocations_less_completed_frees():
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 4096},  # reserved, not allocated
        {"action": "alloc", "addr": 0, "size": 1024, "frames": [{"filename": "model.py", "line": 3, "name": "f"}]},
        {"action": "alloc", "addr": 1024, "size": 2048, "frames": []},
        {"action": "free_requested", "addr": 0, "size": 1024},  # still allocated until completed
        {"action": "free_completed", "addr": 0, "size": 1024},
        {"action": "alloc", "addr": 0, "size": 512, "frames": []},
        {"action": "free_completed", "addr": 9999, "size": 8},  # allocated before recording: ignored
    ]
    peak, index, live = snapshot.live_at_peak(trace)
    assert (peak, index) == (3072, 2)
    assert sorted(entry["size"] for entry in live) == [1024, 2048]


def test_frames_drop_torch_dispatch_and_keep_the_innermost():
    entry = {"frames": [{"filename": "/x/site-packages/torch/_tensor.py", "line": 1, "name": "__torch_function__"},
                        {"filename": "/x/site-packages/transformers/loss/loss_utils.py", "line": 9, "name": "loss"},
                        {"filename": "<frozen runpy>", "line": 1, "name": "run"}]}
    assert snapshot._frames(entry) == ["transformers/loss/loss_utils.py:9 loss"]


def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_memory_snapshot.py"), "--only",
                           "distilbert-adamw", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}, check=False)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
    assert not list(tmp_path.iterdir())
