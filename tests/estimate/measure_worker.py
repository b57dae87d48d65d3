"""The measured peaks of the estimate's multi-process cases, in one world (torchrun --nproc_per_node=N
measure_worker.py OUT MODEL:STRATEGY [...]): each rank measures its own peak of a 2-step fit of each case
(measure.py), the least of FITS fits, and writes them to OUT/peaks-RANK.json; the estimate's row is the
largest rank's."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from tests.estimate.measure import measured_peak  # noqa: E402
from tests.estimate.test_estimate_measured import config  # noqa: E402

#: fits measured per case, the smallest peak kept: now and then one rank's peak of a case is higher by a
#: tensor or two (in 16 worlds under load, once 384 KiB more at tp 2: the tiny Llama's logits and a rank's half of them;
#: once, in CI-like load, enough to make loss/sequence parallel's saving negative). The likely cause is a
#: storage released late by a thread that is not the training thread (a collective's work on gloo's
#: thread), so that it overlaps later tensors; not traced further. A late release only adds, so the least
#: of the fits is the peak the fit itself needs.
FITS = 3


def main(out: str, cases: list[str]) -> None:
    peaks: dict[str, int] = {}
    for case in cases:
        model, _, strategy = case.partition(":")
        peaks[case] = min(
            measured_peak(config(os.path.join(out, "runs", f"{case}-{fit}"), model, strategy))  # one output_dir each
            for fit in range(FITS)
        )
    with open(os.path.join(out, f"peaks-{os.environ['RANK']}.json"), "w") as fh:
        json.dump(peaks, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
