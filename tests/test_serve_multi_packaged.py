"""One server for every modality, on the real packaged models, by the names ``forwardpass models`` prints:
``forwardpass serve smollm2 tiny.en all-minilm-l6-v2`` answers a chat (the openai client), a transcription of
an espeak-ng clip and an embedding, each equal to what a single-model server of that model answers."""

from __future__ import annotations

import shutil
import subprocess

import openai
import pytest

from forwardpass.registry import packaged_path
from tests.helpers.multi_server import multi_server, start_all, stop_all
from tests.helpers.server import ServerProcess

for name in ("smollm2", "tiny.en", "all-minilm-l6-v2"):
    if packaged_path(name) is None:  # the test extra installs two; .ci/run fetches smollm2
        pytest.skip(f"the packaged model {name} is not here", allow_module_level=True)
ESPEAK = shutil.which("espeak-ng")
pytestmark = pytest.mark.skipif(ESPEAK is None, reason="needs espeak-ng to speak the clip")


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("speech") / "clip.wav"
    subprocess.run([str(ESPEAK), "-w", str(path), "the quick brown fox jumps over the lazy dog"], check=True)
    return path.read_bytes()


@pytest.fixture(scope="module")
def servers():
    """The three-model server and the three single-model servers (tiny.en batches 8 windows in both: the
    several-models default for a speech model), started together."""
    every = {"multi": multi_server(["smollm2", "tiny.en", "all-minilm-l6-v2"]),
             "smollm2": ServerProcess("smollm2"),  # type: ignore[arg-type]  # a name, as the CLI takes it
             "tiny.en": ServerProcess("tiny.en", "--max-num-seqs", "8"),  # type: ignore[arg-type]
             "all-minilm-l6-v2": ServerProcess("all-minilm-l6-v2")}  # type: ignore[arg-type]
    start_all(list(every.values()))
    yield {name: openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=180)
           for name, srv in every.items()}
    stop_all(list(every.values()))


def test_one_server_answers_chat_speech_and_embeddings_as_single_model_servers(servers, clip):
    multi = servers["multi"]
    listed = {m.id: m.model_extra for m in multi.models.list().data}
    assert {name: m["kind"] for name, m in listed.items()} == {
        "smollm2": "generate", "tiny.en": "transcribe", "all-minilm-l6-v2": "embed"}
    assert listed["smollm2"]["loaded"] and not listed["tiny.en"]["loaded"]  # the default loads first

    messages = [{"role": "user", "content": "Name three colours."}]

    def chat(client: openai.OpenAI, model: str) -> str:
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
        return r.choices[0].message.content or ""

    want_chat = chat(servers["smollm2"], "test-model")
    assert want_chat and chat(multi, "smollm2") == want_chat

    def transcribe(client: openai.OpenAI, model: str) -> str:
        return client.audio.transcriptions.create(model=model, file=("clip.wav", clip)).text

    want_text = transcribe(servers["tiny.en"], "test-model")
    assert "lazy dog" in want_text.lower() and transcribe(multi, "tiny.en") == want_text

    texts = ["a forward pass reads every weight once", "the cat sat on the mat"]

    def embed(client: openai.OpenAI, model: str) -> list[list[float]]:
        return [d.embedding for d in client.embeddings.create(model=model, input=texts).data]

    want_vectors = embed(servers["all-minilm-l6-v2"], "test-model")
    assert len(want_vectors[0]) == 384 and embed(multi, "all-minilm-l6-v2") == want_vectors

    listed = {m.id: m.model_extra for m in multi.models.list().data}
    assert all(m["loaded"] for m in listed.values())  # every model is loaded once asked for (no limit given)
    # and the first still answers as a single-model server does when asked again: both now reuse the prompt's
    # cached prefix, whose last logits need not round as a whole prefill's did (on an AVX-512 Xeon one greedy
    # token of this answer flips between the two)
    assert chat(multi, "smollm2") == chat(servers["smollm2"], "test-model")
