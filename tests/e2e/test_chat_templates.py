"""Mistral's prompt formats named with --chat-template on the default model: a conversation the
format takes is answered, and one its template refuses (a system message where Mistral 7B
v0.2's original template has none, roles out of order) is a 400 naming `messages`, with the
server still answering afterwards. The prompts themselves are compared with the templates'
renderings by the unit tests (tests/golden/chat)."""
import openai
import pytest

from conftest import KvServer

SYS = {"role": "system", "content": "You are terse."}
U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "Paris."}
U2 = {"role": "user", "content": "And of Italy?"}

# template name -> conversations it refuses
REFUSED = {
    "mistral-legacy": [[SYS, U1], [U1, U2]],
    "mistral-v1": [[U1, U2], [A1, U1]],
    "mistral-v3": [[U1, U2]],
    "mistral-v7": [],
    "mistral-v7-tekken": [[U1, U2], [SYS, U1, A1, SYS, U2]],
}


@pytest.fixture(scope="module", params=sorted(REFUSED))
def named(request):
    s = KvServer(["-c", "1024", "--chat-template", request.param]).start()
    yield request.param, s, s.client()
    s.terminate()


def test_mistral_formats_answer_and_refuse(named):
    name, server, client = named
    ok = [U1, A1, U2] if name == "mistral-legacy" else [SYS, U1, A1, U2]
    r = client.chat.completions.create(model=server.model_id, messages=ok, max_tokens=4,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length"), (name, r)
    assert r.usage.prompt_tokens > 10
    for messages in REFUSED[name]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model_id, messages=messages,
                                           max_tokens=4)
        assert e.value.status_code == 400
        assert e.value.param == "messages", (name, e.value)
        assert name in str(e.value), (name, e.value)
    r = client.chat.completions.create(model=server.model_id, messages=[U1], max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
