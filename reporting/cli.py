"""Command line: `python -m reporting <the planner's scenario flags> --out FILE` writes the
report (the plan, its technique comparison, what fits, the runs) as FILE.html, FILE.md,
FILE.csv or FILE.json; the suffix picks the format.

The scenario flags are the planner's own (planner.cli.add_scenario_flags), so a report
takes exactly what `python -m planner estimate` takes; errors are one line on stderr with
exit status 2, as the planner's are (planner.cli.run_guarded).
"""

from __future__ import annotations

import argparse

from planner.cli import OneLineParser, add_scenario_flags, help_hint, run_guarded
from planner.errors import PlannerInputError
from planner.finetune import Method
from planner.strategy import MULTI_DEVICE_STRATEGIES, Strategy
from reporting.build import write_report


class _Parser(OneLineParser):
    def error(self, message: str) -> None:  # the planner's parser names `python -m planner` in its hint
        raise PlannerInputError(f"{message} ({help_hint(self.prog, 'reporting')})")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="reporting", description="Write the plan, its technique comparison and runs as a file.")
    add_scenario_flags(parser)
    parser.add_argument("--out", required=True, help="FILE.html, FILE.md, FILE.csv or FILE.json")
    parser.add_argument("--gpu", help="GPU preset name or capacity in GiB, for the fits / does not fit verdict")
    parser.add_argument("--gpu-count", default="1", help="number of GPUs")
    parser.add_argument("--strategy", default=Strategy.DDP.value, choices=[s.value for s in MULTI_DEVICE_STRATEGIES],
                        help="what each GPU holds when --gpu-count > 1 (default ddp): the plan is per GPU under it")
    parser.add_argument("--run-steps", default=None,
                        help="optimizer steps the Multiple GPUs section's local SGD comparison counts over "
                             "(default 1000; with --gpu-count above 1)")
    parser.add_argument("--local-sgd-steps", default=None,
                        help="a local SGD period K to add to the comparison's K = 1, 2, 4, 8, 16, 32")
    return parser


def _write(args: argparse.Namespace) -> int:
    if args.finetune != Method.FULL.value and args.gpu_count not in (None, "1"):
        raise PlannerInputError(f"{args.finetune} across several GPUs is not planned yet: drop --gpu-count")
    print(write_report(vars(args), args.out))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_guarded("reporting", lambda: _write(build_parser().parse_args(argv)))
