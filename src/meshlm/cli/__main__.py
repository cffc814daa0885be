"""`python -m meshlm.cli ...` (what torchrun runs on every rank): the `meshlm` command."""

import sys

from meshlm.cli import main

sys.exit(main())
