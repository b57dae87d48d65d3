"""`python -m kiln.cli ...` (how kiln's launcher starts each worker process)."""

import sys

from kiln.cli.dispatch import main

sys.exit(main())
