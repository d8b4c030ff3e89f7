"""What diffcomm knows about the communication it ran: the table of :mod:`.raw_ops`, the
comms :mod:`.logger` (op, bytes, time, bandwidth), the comm-off :mod:`.switches`, the
flight :mod:`.recorder` (each rank's recent ops), the :mod:`.responder` (the thread that
answers the other ranks' questions through the store, and the asking after a timeout)
and the cross-rank :mod:`.diagnosis` built from the records.

Layer: below :mod:`diffcomm.backend` (whose one entry point, ``dispatch``, applies the
switches, the logger and the recorder to every raw op); above :mod:`diffcomm.accelerator`
and the core modules. This package itself imports nothing.
"""
