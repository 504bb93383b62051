"""Kalos clients: the asyncio :class:`RecallPool` and the blocking :class:`RecallClient`."""

from clients.blocking import RecallClient
from clients.pool import PoolStatistics, RecallPool
from clients.results import Hit, Hits, Records

__all__ = ["RecallPool", "RecallClient", "PoolStatistics", "Hit", "Hits", "Records"]
