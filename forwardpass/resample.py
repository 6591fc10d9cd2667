"""Polyphase resampling, the same arithmetic as ``scipy.signal.resample_poly`` (its default Kaiser window,
beta 5), in NumPy: importing ``scipy.signal`` takes a second or more (it parses every docstring of the
package), longer than transcribing a short clip, and audio that is not 16 kHz (espeak-ng writes 22.05 kHz)
would pay it at every ``forwardpass transcribe``. ``tests/test_audio.py`` checks it against scipy.

The filter is scipy's ``firwin(2 * 10 * max(up, down) + 1, 1 / max(up, down), window=("kaiser", 5.0))``
scaled by ``up``; each output sample is the dot product of one polyphase branch of it with the input
samples under it (``upfirdn`` without ever building the upsampled signal), cut to scipy's output span.
"""

from __future__ import annotations

import math

import numpy as np

KAISER_BETA = 5.0
CHUNK = 1 << 16  # output samples computed at once: bounds the [chunk, taps] index array (~30 MB)


def lowpass(up: int, down: int) -> np.ndarray:
    """scipy's ``firwin`` low-pass for the ratio ``up / down``: windowed sinc, unit DC gain, times ``up``."""
    max_rate = max(up, down)
    numtaps = 2 * 10 * max_rate + 1
    m = np.arange(numtaps) - (numtaps - 1) / 2
    cutoff = 1.0 / max_rate
    h = cutoff * np.sinc(cutoff * m) * np.kaiser(numtaps, KAISER_BETA)
    return h / h.sum() * up


def resample_poly(x: np.ndarray, up: int, down: int) -> np.ndarray:
    """``x`` (1-D) resampled by ``up / down``, as ``scipy.signal.resample_poly(x, up, down)``, in float64."""
    g = math.gcd(up, down)
    up, down = up // g, down // g
    x = np.asarray(x, dtype=np.float64)
    if up == down == 1:
        return x.copy()
    n_in = len(x)
    n_out = -(-n_in * up // down)
    h = lowpass(up, down)
    half_len = (len(h) - 1) // 2
    pre_pad = down - half_len % down  # scipy's padding, so that its output starts where the signal does
    h = np.concatenate((np.zeros(pre_pad), h))
    first = (half_len + pre_pad) // down  # outputs scipy drops before the signal starts
    taps = -(-len(h) // up)
    branches = np.zeros((up, taps))  # branches[p, t] = h[p + up * t]
    padded = np.zeros(taps * up)
    padded[: len(h)] = h
    branches[:] = padded.reshape(taps, up).T
    xp = np.concatenate((np.zeros(taps - 1), x, np.zeros(taps)))  # x[i] at xp[i + taps - 1]
    out = np.empty(n_out)
    for start in range(0, n_out, CHUNK):
        k = np.arange(first + start, first + min(n_out, start + CHUNK))
        n = k * down  # the output's position in the upsampled signal
        phase, base = n % up, n // up
        idx = base[:, None] - np.arange(taps)[None, :] + taps - 1
        idx = np.minimum(idx, len(xp) - 1)  # past the end: the zero padding
        out[start : start + len(k)] = np.einsum("kt,kt->k", branches[phase], xp[idx])
    return out
