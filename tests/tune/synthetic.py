"""A program whose metric depends on the launch configuration in a known way (for the tuner's
tests). Each instance reads what the launcher gave it:

* ``score: 10 * OMP_NUM_THREADS (+5 under Intel OpenMP, seen as KMP_BLOCKTIME)`` per instance,
  so with ``--aggregate sum`` the best on 2 cores is 2 instances x 1 core, Intel OpenMP (30);
* 1 instance x 1 core with GNU OpenMP exits 3; 1 x 2 with GNU OpenMP prints no score;
* ``--sleep-single S``: sleep S seconds when there is one instance (a wall-time objective);
* ``--hang``: print ``hanging`` and sleep forever, ignoring SIGTERM (a timeout).
"""
import os
import signal
import sys
import time

threads = int(os.environ.get("OMP_NUM_THREADS", "0"))
ninstances = int(os.environ.get("XLAUNCH_NINSTANCES", "0"))
intel = "KMP_BLOCKTIME" in os.environ
if "--hang" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("hanging", flush=True)
    while True:
        time.sleep(60)
if "--sleep-single" in sys.argv:
    if ninstances == 1:
        time.sleep(float(sys.argv[sys.argv.index("--sleep-single") + 1]))
    sys.exit(0)
if ninstances == 1 and threads == 1 and not intel:
    print("failing on purpose", file=sys.stderr)
    sys.exit(3)
if ninstances == 1 and threads == 2 and not intel:
    print("no score today")
    sys.exit(0)
print("score: 1 (warm-up, not the last match)")
print(f"score: {10 * threads + (5 if intel else 0)}")
