"""benchmarks/lora_accuracy.py's table without running a step: the committed Markdown is what
`table` builds from the committed CSV (numbers read back as numbers), and a row over the bar
or with checkpointing is called out below the table."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Loaded from its file: putting benchmarks/ on sys.path would let its modules shadow others.
_SPEC = importlib.util.spec_from_file_location("lora_accuracy", ROOT / "benchmarks" / "lora_accuracy.py")
lora_accuracy = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(lora_accuracy)
RESULTS = ROOT / "benchmarks" / "results"


def test_the_committed_table_is_built_from_the_committed_csv():
    rows = lora_accuracy.read_csv(RESULTS / "lora_accuracy.csv")
    assert isinstance(rows[0]["measured_peak_bytes"], int) and isinstance(rows[0]["error_pct"], float)
    assert "\n".join(lora_accuracy.table(rows)) + "\n" == (RESULTS / "lora_accuracy.md").read_text()


def test_rows_over_the_bar_and_the_known_gap_are_called_out():
    rows = lora_accuracy.read_csv(RESULTS / "lora_accuracy.csv")
    plain = [r for r in rows if r["engine"] == "accelerate" and "gradient_checkpointing=True" not in r["technique"]][:2]
    assert lora_accuracy.CHECKPOINTING_NOTE not in lora_accuracy.table(plain)
    assert lora_accuracy.table(plain)[-1].startswith("| ")  # nothing below the rows
    over = dict(plain[0], error_pct=-2.5)
    lines = lora_accuracy.table([over, plain[1]])
    assert lines[-1].startswith("Over 2%:") and "(-2.50%)" in lines[-1]
    assert "1 of 2 within 2%" in lines[4]
    checkpointed = [r for r in rows if "gradient_checkpointing=True" in r["technique"]]
    assert lora_accuracy.CHECKPOINTING_NOTE in lora_accuracy.table(plain + checkpointed[:1])
