"""The storage wing: namespaces and their rows, and where they are kept.

``store`` (the in-memory namespaces over a backend's matrices), ``filters`` (the payload index),
``writes`` (a write resolved and applied), ``durable`` (the one interface of a durable store and
the one way to commit), ``sqlite`` (``--data-dir``), ``pgstore`` (the PostgreSQL schema and
change log), ``fleet`` (the PostgreSQL store and its follower thread), ``datadir`` (one data dir,
one sidecar). It imports backends, never serving nor the top level."""
