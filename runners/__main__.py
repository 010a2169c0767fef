"""`python -m runners verify|history`: see runners/cli.py."""

import sys

from runners.cli import main

sys.exit(main())
