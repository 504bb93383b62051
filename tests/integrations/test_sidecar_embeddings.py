"""The frameworks' embedding objects on the sidecar's model (``--embed``, a model built on the
spot): LangChain's own EmbeddingsIntegrationTests on KalosEmbeddings, unmodified; the vectors equal
the model's in-process output; a LangChain store without an ``Embeddings`` object, a LangGraph
store with ``index={"embed": "kalos"}`` and LlamaIndex's ``KalosEmbedding`` recall what they
stored, exactly, with no model in the test process."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")
pytest.importorskip("tokenizers")

from conftest import TEST_BACKEND, unique_name
from langchain_tests.integration_tests import EmbeddingsIntegrationTests

from kalos.integrations.embeddings import KalosEmbeddings
from kalos.sidecar_cuda.embedding import TextEncoder
from kalos.testing.sidecar import running_sidecar
from kalos.testing.tinymodel import WORDS, build_tiny_model

DIM = 32
SIDECAR: dict[str, str] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"), dim=DIM, seed=21)


@pytest.fixture(scope="module", autouse=True)
def embed_sidecar(model_dir) -> Iterator[str]:
    name = unique_name("emb")
    args = [
        "--ephemeral",
        "--dim",
        str(DIM),
        "--metric",
        "cosine",
        "--embed",
        str(model_dir),
        "--backend",
        TEST_BACKEND,
    ]
    with running_sidecar(args, name, timeout=60):
        SIDECAR["name"] = name
        yield name


def tol() -> float:
    return 2e-2 if TEST_BACKEND == "cuda" else 1e-6


def texts(rng: np.random.Generator, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, int(rng.integers(2, 20)))) for _ in range(n)]


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:The test <Function.*is marked with '@pytest.mark.asyncio' but it is not an async")
class TestKalosEmbeddingsStandardSuite(EmbeddingsIntegrationTests):
    """LangChain's EmbeddingsIntegrationTests, unmodified, on the sidecar's model."""

    @property
    def embeddings_class(self) -> type[KalosEmbeddings]:
        return KalosEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {"name": SIDECAR["name"]}


@pytest.mark.asyncio
async def test_kalos_embeddings_are_the_models_own(embed_sidecar, model_dir, rng):
    batch = texts(rng, 30)
    want = TextEncoder(model_dir).encode(batch)
    emb = KalosEmbeddings(embed_sidecar)
    try:
        assert np.abs(np.array(emb.embed_documents(batch)) - want).max() <= tol()
        assert np.abs(np.array(await emb.aembed_documents(batch)) - want).max() <= tol()
        assert np.abs(np.array(emb.embed_query(batch[3])) - want[3]).max() <= tol()
        assert emb.embed_documents([]) == []
    finally:
        emb.close()
        await emb.aclose()


@pytest.mark.asyncio
async def test_a_langchain_store_without_embeddings_uses_the_sidecars_model(embed_sidecar, model_dir, rng):
    from kalos.integrations.langchain import KalosVectorStore

    docs = texts(rng, 40)
    store = KalosVectorStore(name=embed_sidecar, namespace=unique_name("lc")[:40])
    try:
        assert isinstance(store.embeddings, KalosEmbeddings)
        ids = store.add_texts(docs, [{"i": i} for i in range(len(docs))])
        enc = TextEncoder(model_dir)
        rows = enc.encode(docs).astype(np.float64)
        for q in texts(rng, 5) + docs[:3]:
            got = store.similarity_search_with_score(q, k=4)
            scores = rows @ enc.encode([q])[0].astype(np.float64)
            best = np.sort(scores)[::-1]
            assert [round(s, 3) for _, s in got] == pytest.approx([round(x, 3) for x in best[:4]], abs=max(tol(), 2e-3))
            for doc, s in got:
                assert (
                    abs(scores[doc.metadata["i"]] - s) <= max(tol(), 1e-5)
                    and doc.page_content == docs[doc.metadata["i"]]
                )
        agot = await store.asimilarity_search(docs[7], k=1)
        assert agot[0].page_content == docs[7]
        assert len(ids) == len(docs)
    finally:
        await store.adelete()
        await store.aclose()


@pytest.mark.asyncio
async def test_a_langgraph_store_indexes_with_the_sidecars_model(embed_sidecar, rng):
    pytest.importorskip("langgraph")
    from kalos.integrations.langgraph import KalosStore

    ns = unique_name("lg")[:30]
    store = KalosStore(embed_sidecar, namespace=ns, index={"dims": DIM, "embed": "kalos", "fields": ["text"]})
    try:
        assert isinstance(store.embeddings, KalosEmbeddings)
        docs = texts(rng, 20)
        for i, d in enumerate(docs):
            await store.aput(("memories", "u1"), f"m{i}", {"text": d})
        for i in (0, 5, 13):
            got = await store.asearch(("memories", "u1"), query=docs[i], limit=1)
            assert got[0].key == f"m{i}" and got[0].score == pytest.approx(1.0, abs=max(tol(), 1e-5))
        got = store.search(("memories", "u1"), query=docs[2], limit=1)
        assert got[0].key == "m2"
    finally:
        for i in range(20):
            await store.adelete(("memories", "u1"), f"m{i}")
        await store.aclose()


@pytest.mark.asyncio
async def test_llamaindex_embedding_is_the_sidecars_model(embed_sidecar, model_dir, rng):
    pytest.importorskip("llama_index.core")
    from kalos.integrations.llamaindex import KalosEmbedding

    emb = KalosEmbedding(embed_sidecar)
    try:
        batch = texts(rng, 12)
        want = TextEncoder(model_dir).encode(batch)
        assert np.abs(np.array(emb.get_text_embedding_batch(batch)) - want).max() <= tol()
        assert np.abs(np.array(emb.get_query_embedding(batch[0])) - want[0]).max() <= tol()
        assert np.abs(np.array(await emb.aget_text_embedding_batch(batch)) - want).max() <= tol()
        assert np.abs(np.array(await emb.aget_query_embedding(batch[1])) - want[1]).max() <= tol()
    finally:
        emb.close()
        await emb.aclose()
