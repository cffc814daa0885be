"""`python -m meshlm ...`: the `meshlm` command, for an environment whose scripts folder is not on PATH."""

import sys

from meshlm.cli import main

sys.exit(main())
