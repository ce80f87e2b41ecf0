"""`kvserve generate` end to end on the real model: greedy chat answers that make sense,
reproducible sampling, stop strings, and clear errors for bad input."""
import pytest

from conftest import run_kvserve


def chat(model_path, question, *extra, n=48):
    r = run_kvserve("generate", "-m", model_path, "--chat", "--temp", "0", "-n", str(n),
                    "-p", question, *extra)
    assert r.returncode == 0, r.stderr
    return r.stdout


# SmolLM2-135M (Q4_1) answers some phrasings badly: "What is the capital of France?" gets
# "L'Étoile, la Cité, ..." from llama.cpp as from kvserve (same greedy text). These phrasings
# get sensible answers from both engines.
@pytest.mark.parametrize("question,expected", [
    ("What is the capital of France? Answer in one sentence.", ["paris"]),
    ("Tell me the capital of France.", ["paris"]),
    ("What is the capital of Japan?", ["tokyo"]),
    ("How many days are there in a week?", ["seven", "7"]),
    ("What color is the sky on a clear day?", ["blue"]),
    ("Which planet do we live on?", ["earth"]),
])
def test_greedy_factual_answers(model_path, question, expected):
    out = chat(model_path, question).lower()
    assert any(e in out for e in expected), f"{question!r} -> {out!r}"


def test_greedy_is_deterministic(model_path):
    assert chat(model_path, "Name a fruit.") == chat(model_path, "Name a fruit.")


def test_seed_reproducible_and_seed_matters(model_path):
    def sample(seed):
        r = run_kvserve("generate", "-m", model_path, "--chat", "--temp", "1.0", "--top-k", "0",
                        "--top-p", "1", "--min-p", "0", "-n", "24", "-s", str(seed),
                        "-p", "Write a short poem about the sea.")
        assert r.returncode == 0, r.stderr
        return r.stdout
    a, b, c = sample(7), sample(7), sample(8)
    assert a == b
    assert a != c


def test_stop_string_cuts_output(model_path):
    full = chat(model_path, "Count from 1 to 10, separated by commas.", n=40)
    assert "4" in full, full
    cut = chat(model_path, "Count from 1 to 10, separated by commas.", "--stop", "4", n=40)
    assert "4" not in cut
    assert full.startswith(cut.rstrip("\n")), (full, cut)


def test_max_tokens_limits_output(model_path):
    r = run_kvserve("generate", "-m", model_path, "--temp", "0", "-n", "3", "--ignore-eos",
                    "-p", "Once upon a time")
    assert r.returncode == 0, r.stderr
    assert "generated 3 tokens" in r.stderr


@pytest.mark.parametrize("args,message", [
    (["-m", "models/none.gguf", "-p", "hi"], "none.gguf"),
    (["-m", "Makefile", "-p", "hi"], "GGUF"),
    (["-p", "hi"], "need -m MODEL"),
    (["-m", "{model}", "-p", "hi", "--temp", "abc"], "--temp"),
    (["-m", "{model}", "-p", "hi", "--top-p", "1.5"], "--top-p"),
    (["-m", "{model}", "-p", "hi", "-n", "0"], "--max-tokens"),
    (["-m", "{model}", "-p", "hi", "--chat-template", "nope"], "chat template"),
    (["-m", "{model}", "-p", "hi", "--logit-bias", "999999=1"], "bias"),
    # surrogate escapes become the raw bytes 0xff 0xfe on the command line
    (["-m", "{model}", "-p", "\udcff\udcfe", "-n", "2"], "UTF-8"),
])
def test_bad_input_is_a_clear_error(model_path, args, message):
    args = [a.replace("{model}", model_path) for a in args]
    r = run_kvserve("generate", *args)
    assert r.returncode != 0
    assert message.lower() in r.stderr.lower(), r.stderr


def test_prompt_over_context_is_refused(model_path):
    r = run_kvserve("generate", "-m", model_path, "-c", "32", "-p", "word " * 100)
    assert r.returncode != 0
    assert "does not fit the context" in r.stderr


def test_precise_mode_answers_and_differs_only_in_rounding(model_path):
    out = chat(model_path, "Tell me the capital of France.", "--precise")
    assert "paris" in out.lower(), out
