"""2-process worker: runs `kiln fit CONFIG` for each CONFIG in turn inside one job (one launch is
cheaper than one per run). A run may end the process itself (toy.KillAt)."""

import sys

from kiln.cli import main

for config in sys.argv[1:]:
    code = main(["fit", config])
    if code:
        sys.exit(code)
