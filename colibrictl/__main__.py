"""`python -m colibrictl` runs the same command as the `colibrictl` console script."""

import sys

from colibrictl.cli import main

sys.exit(main())
