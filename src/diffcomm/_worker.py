"""Entry point of a LocalWorld rank process: ``python -m diffcomm._worker ...``."""

import sys

from diffcomm.world import _worker_main

if __name__ == "__main__":
    rank, world, backend, port, fd, timeout, parent = sys.argv[1:8]
    _worker_main(int(rank), int(world), backend, int(port), int(fd), float(timeout), int(parent))
