"""User-facing tools: the command line (:mod:`.cli`, ``python -m diffcomm``; its
``check`` and ``bench`` subcommands in :mod:`.commands`) and the benchmarks behind
``bench`` (:mod:`.bench`, :mod:`.bench_coalesced`). Nothing in the package imports them.
This package itself imports nothing.
"""
