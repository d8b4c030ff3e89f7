"""Entry point of a LocalWorld rank process: ``python -m diffcomm._worker ...``."""

import signal
import sys

# First thing, before importing torch (seconds on a loaded machine): a Ctrl-C typed in the
# caller's terminal reaches every rank, and the caller alone owns the ranks' lifetime —
# without this, each rank would print its own KeyboardInterrupt traceback.
signal.signal(signal.SIGINT, signal.SIG_IGN)

from diffcomm.world import _worker_main  # noqa: E402

if __name__ == "__main__":
    rank, world, backend, port, fd, timeout, parent = sys.argv[1:8]
    _worker_main(int(rank), int(world), backend, int(port), int(fd), float(timeout), int(parent))
