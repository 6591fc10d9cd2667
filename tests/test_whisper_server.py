"""``POST /v1/audio/transcriptions`` on a server started with a random-weight Whisper checkpoint: the
OpenAI client's upload gives the same transcript as the offline long-form transcription, every response
format (json, text, verbose_json with segments, srt, vtt), and a 4xx
naming the field for each bad input."""

from __future__ import annotations

import io
import wave

import httpx
import numpy as np
import openai
import pytest

from forwardpass import LLM
from forwardpass.transcription import transcribe
from tests.helpers.server import ServerProcess
from tests.helpers.whisper_checkpoints import make_clip, make_whisper_checkpoint

pytest.importorskip("transformers")


def wav_bytes(samples: np.ndarray, rate: int = 16_000, channels: int = 1) -> bytes:
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    if channels == 2:
        pcm = np.stack([pcm, pcm], axis=1)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_whisper_checkpoint(tmp_path_factory.mktemp("whisper_srv"), 80, 100, seed=3)


@pytest.fixture(scope="module")
def server(ckpt):
    with ServerProcess(ckpt, "--max-num-seqs", "4", "--num-kv-blocks", "64") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _post(http, data: bytes, **form):
    return http.post(
        "/v1/audio/transcriptions",
        files={"file": ("clip.wav", data, "audio/wav")},
        data={"model": "test-model", **form},
    )


def _assert_error(r: httpx.Response, status: int, param: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err


def test_openai_client_transcribes_like_the_engine(server, ckpt):
    clip = make_clip(1.5, 11)
    # the offline long-form transcription of the same 16-bit samples, with the server's defaults
    pcm = np.frombuffer(wav_bytes(clip)[44:], dtype="<i2")
    llm = LLM(str(ckpt), max_num_seqs=2, num_kv_blocks=64)
    want = transcribe(llm, pcm, 16_000)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    got = client.audio.transcriptions.create(model="test-model", file=("clip.wav", wav_bytes(clip)))
    assert got.text == want.text
    verbose = client.audio.transcriptions.create(
        model="test-model",
        file=("clip.wav", wav_bytes(clip)),
        response_format="verbose_json",
        timestamp_granularities=["segment"],
    )
    assert [(s.start, s.end, s.text) for s in verbose.segments] == [
        (s.start, s.end, s.text) for s in want.segments
    ]
    llm.engine.check_invariants()


def test_response_formats(http):
    data = wav_bytes(make_clip(0.8, 5, rate=22_050), 22_050, channels=2)
    body = _post(http, data).json()
    assert set(body) >= {"text"}
    text = _post(http, data, response_format="text")
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
    assert text.text == body["text"]
    verbose = _post(http, data, response_format="verbose_json").json()
    assert verbose["text"] == body["text"] and verbose["language"] == "en"
    assert verbose["duration"] == pytest.approx(0.8, abs=1e-3)
    segments = verbose["segments"]
    assert all(0.0 <= s["start"] <= s["end"] <= 0.8 + 1e-3 for s in segments)
    assert "".join(s["text"] for s in segments).strip() == body["text"]
    srt = _post(http, data, response_format="srt")
    assert srt.status_code == 200 and srt.text.count(" --> ") == len(segments)
    vtt = _post(http, data, response_format="vtt")
    assert (
        vtt.status_code == 200
        and vtt.text.startswith("WEBVTT")
        and vtt.headers["content-type"].startswith("text/vtt")
    )
    prompted = _post(http, data, prompt="one two three")
    assert prompted.status_code == 200, prompted.text


def test_bad_inputs_name_the_field(http):
    good = wav_bytes(make_clip(0.5, 1))
    _assert_error(_post(http, good, response_format="xml"), 400, "response_format")
    _assert_error(
        _post(http, good, **{"timestamp_granularities[]": "word", "response_format": "verbose_json"}),
        400,
        "timestamp_granularities",
    )
    _assert_error(
        _post(http, good, **{"timestamp_granularities[]": "segment"}), 400, "timestamp_granularities"
    )
    _assert_error(_post(http, good, language="xx"), 400, "language")
    _assert_error(_post(http, good, temperature="7"), 400, "temperature")
    _assert_error(_post(http, b"this is not a wav file"), 400, "file")
    _assert_error(_post(http, b""), 400, "file")
    _assert_error(_post(http, good, model="other-model"), 404, "model")
    no_file = http.post("/v1/audio/transcriptions", data={"model": "test-model"})
    _assert_error(no_file, 400, "file")
    assert http.get("/debug/engine").status_code == 200


def test_data_parallel_server_transcribes_like_one_engine(ckpt, http):
    """``--data-parallel-size 2``: each replica gets the audio features (``encoder_input``) as one engine
    does, so both transcribe the clip as the single-engine server."""
    clip = wav_bytes(make_clip(1.0, 7))
    want = _post(http, clip)
    assert want.status_code == 200, want.text
    flags = ("--max-num-seqs", "4", "--num-kv-blocks", "64", "--data-parallel-size", "2")
    with (
        ServerProcess(ckpt, *flags, "--engine-backend", "thread") as dp,
        httpx.Client(base_url=dp.url, timeout=120) as c,
    ):
        replies = [_post(c, clip) for _ in range(2)]  # one after the other: round robin, one per replica
        assert [r.status_code for r in replies] == [200, 200], replies[0].text
        assert [r.json()["text"] for r in replies] == [want.json()["text"]] * 2
        debug = c.get("/debug/engine").json()
        assert len(debug["replicas"]) == 2 and all(r["invariants_ok"] for r in debug["replicas"])
