"""Kalos clients: the asyncio :class:`RecallPool` and the blocking :class:`RecallClient`."""

from .blocking import RecallClient
from .pool import PoolStatistics, RecallPool
from .results import Hit, Hits, Records, Written

__all__ = ["RecallPool", "RecallClient", "PoolStatistics", "Hit", "Hits", "Records", "Written"]
