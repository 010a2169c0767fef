"""The CUDA Adafactor rows of the randomized CUDA benchmark, estimated again by the planner as
it is now, against the simulated steps it stored (benchmarks/results/random_differential_cuda.csv).

The reduction workspace (planner/cuda_reduction.py, planner/adafactor_cuda.py) changes CUDA
Adafactor plans only; a simulated step (fake tensors) has no kernel workspace, so these rows now
read above it by that workspace (the GPU has it: benchmarks/results/gpu_check.md). Writes
benchmarks/results/random_differential_cuda_adafactor.csv (about 2 min with cached probes):

    .venv/bin/python benchmarks/reestimate_cuda_adafactor.py
"""
import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from planner.cli import estimate_from_values  # noqa: E402
rows = list(csv.DictReader(open(ROOT / 'benchmarks/results/random_differential_cuda.csv')))
out = []
for r in rows:
    t = r['technique']
    if 'adafactor' not in t or 'device=cuda' not in t:
        continue
    values = dict(kv.split('=', 1) for kv in t.split(', '))
    values['gradient_checkpointing'] = values['gradient_checkpointing'] == 'True'
    values['grad_accum'] = int(values['grad_accum'])
    values.update(config=r['model'], task=r['task'], batch_size=int(r['batch']), seq_len=int(r['seq']))
    started = time.time()
    est = estimate_from_values(values)
    measured = int(r['measured_peak_bytes'])
    old, new = int(r['estimated_peak_bytes']), est.peak_bytes
    out.append((r['model'], r['batch'], r['seq'], t, old, new, measured, (old - measured) / measured * 100,
                (new - measured) / measured * 100, est.peak_phase.value, r['measured_phase']))
    print(f"{r['model']} {r['batch']}x{r['seq']} {t}: {out[-1][7]:+.4f}% -> {out[-1][8]:+.4f}% "
          f"({new - old:+,} B) {time.time() - started:.1f} s", flush=True)
w = csv.writer(open(ROOT / 'benchmarks/results/random_differential_cuda_adafactor.csv', 'w', newline=''))
w.writerow(['model', 'batch', 'seq', 'technique', 'estimate_before', 'estimate_now', 'measured_simulated',
            'error_before_pct', 'error_now_pct', 'estimated_phase_now', 'measured_phase'])
w.writerows(out)
