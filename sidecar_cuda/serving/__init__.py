"""The serving wing: what one pass of the sidecar's loop does with the slots.

``objects`` (the one owner of posix_ipc on this side: the segment, the semaphores, the lease file),
``slotio`` and the compiled ``_cserve`` (the byte work: scan, gather, answer), ``batching`` (a slot
becomes a typed request; the pure plan of a batch), ``pipeline`` (a batch to the backend and its
answers back), ``launch`` (the pure launch policy), ``general`` (writes and the other operations),
``answers`` (the one writer of answers), ``waits`` (reads held for a position), ``leases`` (the
reaper), ``expiry`` (the sweeper), ``stats`` and ``notify``. It imports storage and backends, never
the top level (``server``, ``config``)."""
