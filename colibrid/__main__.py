"""python -m colibrid: run the daemon (the same as the `colibrid` command)."""

import sys

from colibrid.daemon.lifecycle import main

sys.exit(main())
