"""Tools for users' own gradient tests (nothing in the package imports this).

See ``diffcomm.testing.plugin`` for the pytest fixtures (shared ``LocalWorld`` per world
size).
"""
