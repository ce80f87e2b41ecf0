"""langchain-openai, unmodified, against kvserve: with_structured_output(Model) returns the
Pydantic object with method="json_schema" (response_format) and "function_calling" (a named
tool call); embed_documents sends its passages a thousand to a request. Skipped, visibly,
where langchain-openai is not installed (`make setup` installs it). The tests run against a
server of their own: their chats would otherwise leave cached blocks of the default system
prompt in the shared server, which later tests assume cold."""
import pytest

from conftest import SANITIZED

langchain_openai = pytest.importorskip("langchain_openai")
pydantic = pytest.importorskip("pydantic")


class Person(pydantic.BaseModel):
    """A person."""
    name: str = pydantic.Field(max_length=30, description="the person's name")
    age: int = pydantic.Field(ge=0, le=120)
    city: str = pydantic.Field(max_length=30)


@pytest.fixture(scope="module")
def server(model_path):
    from conftest import KvServer
    s = KvServer(["-c", "2048"]).start()
    yield s
    s.terminate()


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(server, method):
    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="x",
                                      model=server.model_id, temperature=0, max_tokens=120,
                                      timeout=120, max_retries=0)
    out = llm.with_structured_output(Person, method=method).invoke(
        "Invent a person who lives in a city.")
    assert isinstance(out, Person)
    assert out.name and 0 <= out.age <= 120


def test_tool_calls_through_bind_tools(server):
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="x",
                                      model=server.model_id, temperature=0, max_tokens=120,
                                      timeout=120, max_retries=0)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert isinstance(msg.tool_calls[0]["args"]["city"], str)


def test_embed_documents_sends_thousands_of_passages(server):
    """A RAG frontend ingesting documents: embed_documents on 2,000 passages sends them 1,000
    to a request (its chunk_size), far more than --max-queue's 64, and every vector is the
    passage's own. check_embedding_ctx_length=False sends the texts as they are (the length check
    would fetch a tiktoken encoding)."""
    emb = langchain_openai.OpenAIEmbeddings(base_url=server.url + "/v1", api_key="x",
                                            model=server.model_id, max_retries=0,
                                            check_embedding_ctx_length=False)
    n = 1200 if SANITIZED else 2000  # two requests either way; the sanitizers are 5x slower
    passages = [f"note {i}" for i in range(n)]
    vecs = emb.embed_documents(passages)
    assert len(vecs) == n and all(len(v) == 576 for v in vecs)
    for i in (0, 999, 1000, n - 1):
        assert vecs[i] == pytest.approx(emb.embed_query(passages[i]), abs=1e-5)
