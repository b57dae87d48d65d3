import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Tests never need more than the 2 cores of the CI machine; fewer threads keeps timings stable.
os.environ.setdefault("OMP_NUM_THREADS", "2")
