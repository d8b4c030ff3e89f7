"""``python -m diffcomm``: the command line (see :mod:`diffcomm.tools.cli`)."""

from diffcomm.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
