"""Starting and running ranks: :mod:`.world` (``dc.launch``, ``dc.LocalWorld``),
:mod:`.joining` (``dc.init`` under torchrun, ``dc.get_rank``), the processes of a local
world (:mod:`.processes`), the rank side of a local world (:mod:`.rank_process`), how a function
travels to a rank with its file and line (:mod:`.shipping`) and what a failed run says
(:mod:`.reports`).

Layer: above :mod:`diffcomm.backend` and :mod:`diffcomm.diagnostics`, below :mod:`diffcomm.ops`.
This package itself imports nothing.
"""
