"""The embedded default speech model (``forwardpass/assets/speech``) on speech synthesised now by espeak-ng
(utterances it never heard): ``forwardpass transcribe`` and ``LLM.generate`` write what transformers'
greedy decoding of the shipped weights writes, and the digit strings said come back with at most
``MAX_WER`` word errors per word (the model's held-out error rates:
``forwardpass/assets/speech/README.md``)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.audio import log_mel_spectrogram, read_wav, to_mono_16k
from forwardpass.cli import main
from forwardpass.transcription import default_speech_model_path, transcription_prompt, word_errors

ESPEAK = shutil.which("espeak-ng")
pytestmark = pytest.mark.skipif(
    ESPEAK is None, reason="espeak-ng is not installed (apt-get install espeak-ng; CI installs it)"
)

# what is said and what should be written; a voice the model trained on, at a speed it never heard
# digit strings: what this tiny model recognises best (its README gives its error rates on words and numbers)
UTTERANCES = [("7 3 9", "7 3 9"), ("5 8", "5 8"), ("2 6 1 4", "2 6 1 4"), ("0 9 4", "0 9 4")]
VOICE, SPEED = "en-us+m3", 158
# the shipped weights write all four right here (0 word errors in 12, deterministic: espeak-ng synthesis and
# greedy decoding); the bar allows two errors, for other espeak-ng builds (its held-out WER is in its README)
MAX_WER = 0.17


def _speak(text: str, path) -> None:
    subprocess.run(
        [ESPEAK, "-v", VOICE, "-s", str(SPEED), "-w", str(path), text], check=True, capture_output=True
    )


def test_default_model_transcribes_fresh_speech(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    paths = []
    for i, (said, _) in enumerate(UTTERANCES):
        paths.append(tmp_path / f"u{i}.wav")
        _speak(said, paths[-1])
    # the command line, as a user runs it
    assert main(["transcribe", str(paths[0])]) == 0
    cli_text = capsys.readouterr().out.strip()
    # the Python API, all clips in one batch
    model_dir = default_speech_model_path()
    llm = LLM(model_dir, num_kv_blocks=64)
    tok = llm.get_tokenizer()
    prompt = transcription_prompt(tok, "en")
    audio = [read_wav(p) for p in paths]
    outs = llm.generate(
        [{"prompt_token_ids": prompt, "multi_modal_data": {"audio": a}} for a in audio],
        SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )
    got = [list(o.outputs[0].token_ids) for o in outs]
    texts = [o.outputs[0].text.strip() for o in outs]
    assert cli_text == texts[0]
    llm.engine.check_invariants()

    # the oracle: transformers' greedy decoding of the same features with the shipped weights
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(model_dir).float().eval()
    spec = llm.engine.spec.whisper
    eot = llm.engine.eos_token_ids[0]
    for (samples, rate), tokens in zip(audio, got, strict=True):
        feats = log_mel_spectrogram(to_mono_16k(samples, rate), spec.num_mel_bins, spec.encoder_input_frames)
        with torch.no_grad():  # by hand: transformers' generate() adds Whisper-specific token rules
            enc = hf.model.encoder(feats[None]).last_hidden_state
            seq = torch.tensor([prompt])
            for _ in range(len(tokens)):
                nxt = int(hf(encoder_outputs=(enc,), decoder_input_ids=seq).logits[0, -1].argmax())
                seq = torch.cat([seq, torch.tensor([[nxt]])], 1)
                if nxt == eot:
                    break
        assert seq[0, len(prompt) :].tolist() == tokens

    errors = sum(word_errors(want, hyp) for (_, want), hyp in zip(UTTERANCES, texts, strict=True))
    words = sum(len(want.split()) for _, want in UTTERANCES)
    assert errors / words <= MAX_WER, f"word error rate {errors / words:.2f}: {texts}"


def test_several_files_in_one_command_read_as_each_alone(tmp_path, capsys):
    """``forwardpass transcribe a.wav b.wav``: one model load for all (start-up paid once), the windows
    batched, each transcript printed after its file's name, the same as that file transcribed alone."""
    paths = []
    for i, (said, _) in enumerate(UTTERANCES[:3]):
        paths.append(tmp_path / f"u{i}.wav")
        _speak(said, paths[-1])
    alone = []
    for p in paths:
        assert main(["transcribe", str(p)]) == 0
        alone.append(capsys.readouterr().out.strip())
    assert main(["transcribe", *map(str, paths)]) == 0
    together = capsys.readouterr().out.strip().split("\n\n")
    assert together == [f"==> {p} <==\n{text}" for p, text in zip(paths, alone)]
    assert main(["transcribe", str(paths[0]), str(tmp_path / "missing.wav")]) == 1  # checked before loading
    assert "missing.wav: no such file" in capsys.readouterr().err
