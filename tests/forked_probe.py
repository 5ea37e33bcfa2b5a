"""A command for tests/test_forked.py: ``python -m tests.forked_probe CASE`` does what
CASE names, so that a fork of the command server can be held against a fresh
interpreter."""

import atexit
import sys
import threading
import time

atexit.register(lambda: print("atexit ran", flush=True))
case = sys.argv[1]
print(f"as {__name__} with {sys.argv[1:]}, stdin {sys.stdin.read()!r}")
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
