"""Records its pid, then sleeps; exits with the code given in argv[2] when told to fail.

Usage: sleeper.py PID_DIR [FAIL_RANK EXIT_CODE]
Used to check that meshrun forwards signals, stops peers of a failed process, and returns
the job's exit code.
"""
import os
import sys
import time

pid_dir = sys.argv[1]
rank = os.environ.get("MESHRUN_PROCESS_ID") or os.environ.get("RANK", "0")
with open(os.path.join(pid_dir, f"pid.{rank}"), "w") as f:
    f.write(str(os.getpid()))
if len(sys.argv) > 3 and rank == sys.argv[2]:
    time.sleep(0.5)
    sys.exit(int(sys.argv[3]))
time.sleep(120)
