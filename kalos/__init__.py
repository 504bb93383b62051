"""Kalos: exact top-k recall served from a GPU sidecar over POSIX shared memory.

``from kalos import RecallPool`` is the short form of ``from clients import RecallPool``.
"""

from broker import *  # noqa: F401,F403
from broker import __all__ as _broker_all
from clients import Hit, Hits, PoolStatistics, RecallClient, RecallPool

__version__ = "0.1.0"
__all__ = [*_broker_all, "RecallPool", "RecallClient", "PoolStatistics", "Hit", "Hits"]
