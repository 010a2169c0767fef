"""`python -m reporting ... --out FILE`: see reporting/cli.py."""

import sys

try:
    from reporting.cli import main
except KeyboardInterrupt:  # Ctrl-C while torch and transformers load: no traceback either
    sys.exit(130)  # 128 + SIGINT, as planner.cli.EXIT_INTERRUPTED

sys.exit(main())
