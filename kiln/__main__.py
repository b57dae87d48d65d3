"""`python -m kiln ...`: the `kiln` command."""

import sys

from kiln.cli.dispatch import main

sys.exit(main())
