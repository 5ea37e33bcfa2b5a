"""A command for tests/test_forked.py: ``python -m tests.forked_probe CASE PID`` does
what CASE names (PID: the test's process), so that a fork of the command server can be
held against a fresh interpreter."""

import atexit
import os
import sys
import threading
import time

atexit.register(lambda: print("atexit ran", flush=True))
case, test_pid = sys.argv[1], int(sys.argv[2])
print("fresh" if os.getppid() == test_pid else "forked")  # started by the test, or not
print(f"as {__name__} with {sys.argv[1:2]}, stdin {sys.stdin.read()!r}")
print("to stderr", file=sys.stderr)
if case == "thread":  # a non-daemon thread the interpreter waits for at exit
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
elif case == "code":
    sys.exit(3)
elif case == "message":
    sys.exit("a message of sys.exit")
elif case == "raise":
    raise ValueError("uncaught")
elif case == "sleep":
    time.sleep(120)
