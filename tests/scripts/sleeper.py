"""Records its pid, then sleeps; exits with the code given in argv[2] when told to fail.

Usage: sleeper.py PID_DIR [FAIL_RANK EXIT_CODE]
Used to check that meshrun forwards signals, stops peers of a failed process, and returns
the job's exit code. With SLEEPER_HANDLE=1 it handles SIGINT, SIGTERM and SIGHUP first: it
says so and exits 0.
"""
import os
import signal
import sys
import time

pid_dir = sys.argv[1]
rank = os.environ.get("MESHRUN_PROCESS_ID") or os.environ.get("RANK", "0")


def handled(signum, _frame):
    # One write of the whole line: both ranks share the pipe, and print's separate write of
    # the newline lets the other rank's line land between the two.
    os.write(1, f"rank {rank} handled {signal.Signals(signum).name}\n".encode())
    sys.exit(0)


if os.environ.get("SLEEPER_HANDLE") == "1":
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handled)
with open(os.path.join(pid_dir, f"pid.{rank}"), "w") as f:
    f.write(str(os.getpid()))
if len(sys.argv) > 3 and rank == sys.argv[2]:
    time.sleep(0.5)
    sys.exit(int(sys.argv[3]))
time.sleep(120)
