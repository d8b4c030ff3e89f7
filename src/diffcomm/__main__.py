"""``python -m diffcomm``: the command line (see :mod:`diffcomm.cli`)."""

from diffcomm.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
