import sys

from colibrid.gateway.main import main

sys.exit(main())
