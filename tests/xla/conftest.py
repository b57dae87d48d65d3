"""XLA tests run in the XLA environment (scripts/xla-env.sh) on PJRT's CPU client; elsewhere every
test here skips (each file starts with importorskip("torch_xla")). The main suite runs them there
through tests/xla/test_xla_env.py."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
