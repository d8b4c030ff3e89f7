"""The differentiable ops: the op base and its registry, argument validation, the
asynchronous engine, and the op families.

* :mod:`.base` (``CommOp`` / ``ListOp``: forward, backward, jvp, vmap, fast apply and the
  compile twin derived from one block per op), :mod:`.registry` (every op, its dual and its
  serial reference), :mod:`.validation` and :mod:`.packing` (checks before any
  communication; coalesced lists packed per dtype), :mod:`.engine` (``async_op=True``);
* the families' public homes: :mod:`.collectives`, :mod:`.coalesced`, :mod:`.p2p` (over its
  :mod:`.wire` protocol and :mod:`.send_queue`), each importing the ops of its family by
  name, and the op modules themselves (:mod:`.all_reduce`, :mod:`.all_gather`, ... with
  their serial :mod:`.references`).

Layer: above :mod:`diffcomm.runtime`, :mod:`diffcomm.backend` and :mod:`diffcomm.diagnostics`;
below :mod:`diffcomm.parallel`, :mod:`diffcomm.pipeline`, :mod:`diffcomm.testing` and
:mod:`diffcomm.tools` (the import-linter contract in ``pyproject.toml``). The public names
are re-exported by :mod:`diffcomm`; this package itself imports nothing.
"""
