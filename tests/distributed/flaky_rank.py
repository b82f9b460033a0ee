"""A rank program for launch_local's tests: ``flaky_rank.py FOLDER MODE``.

MODE ``once``: rank 1 fails the first time it runs in FOLDER (it leaves a file there), then succeeds.
MODE ``always``: rank 1 always fails.  MODE ``hang``: every rank sleeps past any test's timeout.
Ranks that get through print ``rank r of R: all_sum -> S``.
"""

import os
import sys
import time
from pathlib import Path

import mlx.core as mx

folder, mode = Path(sys.argv[1]), sys.argv[2]
group = mx.distributed.init()
if mode == "hang":
    (folder / f"hanging_{group.rank()}").write_text(str(os.getpid()))
    time.sleep(600)
if group.rank() == 1 and (mode == "always" or not (folder / "failed_once").exists()):
    (folder / "failed_once").write_text("")
    os._exit(3)  # at once: a normal exit first tears down the ring, and may be killed (-15) by then
total = mx.distributed.all_sum(mx.array([group.rank() + 1.0]), group=group)
print(f"rank {group.rank()} of {group.size()}: all_sum -> {total.item()}", flush=True)
