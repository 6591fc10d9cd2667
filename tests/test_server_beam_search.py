"""vLLM's ``use_beam_search`` on ``/v1/completions`` (server/beam_search.py), against the embedded model.

Oracles: the search rules on hand-made candidate lists (end tokens set aside, the best ``n`` kept, vLLM's
length-penalised ranking); on the server, the same search replayed through plain one-token requests (each
step's 2 * n most likely tokens from the route's own ``logprobs``), which must give the same beams and
scores; and the shape vLLM's own test checks (a batch of equal prompts: equal beams per prompt, distinct
beams within one).
"""

from __future__ import annotations

import math
import time

import httpx
import pytest

from forwardpass.assets import default_llm_path
from forwardpass.engine.frontend.outputs import Logprob
from forwardpass.server.beam_search import MAX_WIDTH, Beam, BeamParams, best, extend, ranking_score
from tests.helpers.server import ServerProcess

pytestmark = pytest.mark.timeout(300)
MODEL = "test-model"
EOS = {2}


def cands(**lps: float) -> dict[int, Logprob]:
    return {int(k[1:]): Logprob(v) for k, v in lps.items()}


def test_a_step_sets_end_tokens_aside_and_keeps_the_best():
    finished: list[Beam] = []
    step = cands(t5=-0.1, t2=-0.5, t7=-1.0, t9=-3.0)
    beams = extend([Beam([])], [step], 2, EOS, BeamParams(2, 4), finished)
    assert [(b.tokens, b.score) for b in beams] == [([5], -0.1), ([7], -1.0)]
    assert [next(iter(b.logprobs[0])) for b in beams] == [5, 7]  # the chosen token's entry first
    assert [(f.tokens, f.score, f.finish_reason, f.stop_reason) for f in finished] == [([], -0.5, "stop", 2)]
    finished = []
    extend([Beam([])], [step], 2, EOS, BeamParams(2, 4, include_stop_str_in_output=True), finished)
    assert finished[0].tokens == [2]
    finished = []
    kept = extend([Beam([])], [step], 2, EOS, BeamParams(2, 4, ignore_eos=True), finished)
    assert [b.tokens for b in kept] == [[5], [2]] and not finished
    # two beams: candidates of both compete on the summed logprob
    two = extend([Beam([5], -0.1), Beam([7], -1.0)], [cands(t3=-2.0, t4=-2.5), cands(t3=-0.2, t8=-0.3)], 2,
                 EOS, BeamParams(2, 4), [])
    assert [(b.tokens, round(b.score, 6)) for b in two] == [([7, 3], -1.2), ([7, 8], -1.3)]


def test_ranking_divides_by_length_to_the_penalty():
    short, long = Beam([5], -1.2), Beam([5, 6, 7], -2.0)  # prompt of 1: lengths 2 and 4
    assert ranking_score(long, 1, 1.0, EOS) == pytest.approx(-0.5)
    for penalty, winner in ((1.0, [5, 6, 7]), (0.0, [5])):
        assert best([short, long], 1, BeamParams(1, 4, length_penalty=penalty), EOS)[0].tokens == winner
    # a kept end token does not count towards the length
    assert ranking_score(Beam([5, 2], -1.0, finish_reason="stop", stop_reason=2), 1, 1.0, EOS) == -0.5


@pytest.fixture(scope="module")
def http():
    with ServerProcess(default_llm_path(), "--num-kv-blocks", "256", startup_timeout=240) as srv, \
            httpx.Client(base_url=srv.url, timeout=240) as c:
        yield c


def completion(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, "temperature": 0.0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def next_tokens(http: httpx.Client, ids: list[int], k: int) -> dict[int, float]:
    """The k most likely next tokens after ``ids`` and their logprobs, from a plain one-token request."""
    top = completion(http, prompt=ids, max_tokens=1, logprobs=k, return_tokens_as_token_ids=True)
    return {int(t.removeprefix("token_id:")): v
            for t, v in top["choices"][0]["logprobs"]["top_logprobs"][0].items()}


def test_beams_match_the_search_replayed_through_plain_requests(http):
    prompt = http.post("/tokenize", json={"model": MODEL, "prompt": "It is a truth"}).json()["tokens"]
    width, steps = 2, 3
    beams: list[tuple[float, list[int]]] = [(0.0, [])]
    for _ in range(steps):
        grown = [(s + lp, toks + [t]) for s, toks in beams for t, lp in next_tokens(http, prompt + toks,
                                                                                     2 * width).items()]
        beams = sorted(grown, key=lambda c: -c[0])[:width]
    got = completion(http, prompt=prompt, n=width, max_tokens=steps, use_beam_search=True, ignore_eos=True,
                     logprobs=1, return_token_ids=True)
    assert [c["token_ids"] for c in got["choices"]] == [toks for _, toks in beams]
    for c, (score, _) in zip(got["choices"], beams):
        assert math.fsum(c["logprobs"]["token_logprobs"]) == pytest.approx(score, abs=1e-3)
        assert c["finish_reason"] == "length"
    usage = {k: got["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert usage == {"prompt_tokens": len(prompt), "completion_tokens": width * steps,
                     "total_tokens": len(prompt) + width * steps}


def test_vllm_batch_shape(http):
    # vLLM's test_batch_completions: two equal prompts, two beams each
    for prompts in (["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2):
        texts = [c["text"] for c in completion(http, prompt=prompts, n=2, max_tokens=5,
                                               use_beam_search=True)["choices"]]
        assert len(texts) == 4 and texts[0] != texts[1] and texts[:2] == texts[2:], texts
    echoed = completion(http, prompt="Hello", n=2, max_tokens=2, use_beam_search=True, echo=True)["choices"]
    assert all(c["text"].startswith("Hello") for c in echoed)


@pytest.mark.parametrize(("extra", "param"), [
    ({"stream": True}, "stream"), ({"echo": True, "logprobs": 1}, "echo"),
    ({"logprobs": 1, "logprob_token_ids": [3]}, "logprob_token_ids"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"), ({"n": MAX_WIDTH + 1}, "n")])
def test_what_beam_search_cannot_answer_is_a_400(http, extra, param):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                           "use_beam_search": True, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    msg = [{"role": "user", "content": "Hi"}]
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msg, "max_tokens": 2,
                                                   "use_beam_search": True})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "use_beam_search", chat.text


def test_a_client_gone_stops_the_search(http):
    # a non-streaming answer sends nothing before it is done: a short read timeout is the client leaving
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "n": 4,
                                           "max_tokens": 1000, "ignore_eos": True, "use_beam_search": True},
                  timeout=httpx.Timeout(10, read=0.5))
    deadline, idle_since = time.monotonic() + 5, None
    while idle_since is None or time.monotonic() - idle_since < 1.0:  # idle, and staying idle: no next step
        info = http.get("/debug/engine").json()
        busy = info["num_requests"] or info["num_unfinished_front_end"]
        idle_since = None if busy else (idle_since or time.monotonic())
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    assert info["num_free_blocks"] == info["num_blocks"] and info["invariants_ok"]
