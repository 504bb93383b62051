"""The sidecar's embedding model (``kalos serve --embed DIR``) as LangChain's ``Embeddings``:
:class:`KalosEmbeddings`. What a worker passes where a framework wants an embedding object, so
that no worker loads a model: the texts go to the sidecar, which embeds the pending texts of every
worker together (docs/text.md).

* LangChain: ``KalosVectorStore(name=...)`` without an ``embedding`` uses one over its own
  connections; any other LangChain component takes ``KalosEmbeddings(name=...)``.
* LangGraph: ``KalosStore(index={"dims": D, "embed": "kalos"})`` (or an instance of this class).
* LlamaIndex: :class:`kalos.integrations.llamaindex.KalosEmbedding` (its own base class).

Sync methods use one blocking ``RecallClient``, async ones the running loop's ``RecallPool``
(``_core.Connections``), opened on first use.
"""

from __future__ import annotations

from langchain_core.embeddings import Embeddings

from kalos.clients.blocking import RecallClient
from kalos.clients.pool import RecallPool

from ._core import Connections

#: ``index={"embed": EMBED_NAME}`` names the sidecar's model in LangGraph's index config.
EMBED_NAME = "kalos"


class KalosEmbeddings(Embeddings):
    """LangChain ``Embeddings`` computed by the sidecar ``name``'s model (``--embed``).

    ``timeout``: seconds per request (None: no limit); ``connect_timeout``: seconds to wait for the
    sidecar when opening; ``pool`` / ``client``: an open RecallPool / RecallClient to use (the
    caller closes it); ``pool_size``: slots of each pool it opens; ``connections``: a store's own
    (the stores pass theirs, so a store and its embeddings share one client and one pool per loop).
    Raises ConfigError when the sidecar serves no model, InvalidRequest for a bad text (empty,
    NUL, over 16 KiB of UTF-8), and Kalos's transport errors."""

    def __init__(
        self,
        name: str = "default",
        *,
        timeout: float | None = 10.0,
        connect_timeout: float = 10.0,
        pool: RecallPool | None = None,
        client: RecallClient | None = None,
        pool_size: int = 4,
        connections: Connections | None = None,
    ) -> None:
        self.name = name
        self._owns = connections is None
        self._conns = connections or Connections(
            name, timeout=timeout, connect_timeout=connect_timeout, pool_size=pool_size, client=client, pool=pool
        )

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._conns.embed(texts)

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return await self._conns.aembed(texts)

    async def aembed_query(self, text: str) -> list[float]:
        return (await self.aembed_documents([text]))[0]

    def close(self) -> None:
        """Close the client it opened (a store's connections are the store's to close)."""
        if self._owns:
            self._conns.close()

    async def aclose(self) -> None:
        """Close what it opened, the running loop's pool included."""
        if self._owns:
            await self._conns.aclose()


__all__ = ["EMBED_NAME", "KalosEmbeddings"]
