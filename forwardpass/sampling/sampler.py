"""The sampler: one token per row from a [B, V] batch of logits, in vLLM v1's order.

    allowed tokens (structured-output bitmask, allowed_token_ids) -> logit_bias -> min_tokens mask
    -> repetition penalty -> presence/frequency penalties -> (greedy: argmax)
    -> temperature -> min_p -> top_k -> top_p -> draw

Cost is what matters here (it runs every decode step over B x 152k logits), so:

* every stage is skipped when no row uses it; an all-greedy batch without penalties is one argmax;
* penalties touch only the (row, token) entries involved (see ``penalties.py``);
* min_p, top_k and top_p all keep a *prefix* of the tokens sorted by logit, so filtered rows work on
  ``topk(candidates)`` and fall back to a full sort only when the nucleus is larger than that;
* the draw is inverse-CDF with one uniform per row: a row's token depends only on its logits and its
  own generator, so a seeded row gives the same token whatever else is in the batch. (The exponential
  race, vLLM's choice on GPU, needs V random numbers per row: ~200 ms for 64 x 152k on two CPU cores.)
  Unfiltered rows use a two-level CDF (block sums, then one block) in float64, so neither a float32
  cumsum's rounding over 152k terms nor an O(V) float64 buffer is needed;
* large temporaries live in a workspace that is reused across steps: a fresh 40 MB tensor costs
  tens of ms in page faults on CPU, more than the arithmetic on it.

Logprobs are of the model's raw distribution (log_softmax of the unprocessed logits), vLLM's default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from forwardpass.sampling.argmax import greedy_tokens
from forwardpass.sampling.params import SamplingParams
from forwardpass.sampling.penalties import (
    TokenIds,
    apply_presence_frequency,
    apply_repetition_penalty,
    as_ids,
    flat_keys,
    mask_tokens,
)

_MASK64 = 2**64 - 1


@dataclass
class SamplingRow:
    """One sequence of the batch as the sampler sees it."""

    params: SamplingParams
    prompt_token_ids: TokenIds
    output_token_ids: TokenIds
    generator: torch.Generator | None = None  # from make_generator when params.seed is set
    # allowed next tokens of a structured-output row: int32 words, bit i of word w = token 32w + i
    token_bitmask: torch.Tensor | None = None


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely under the raw distribution
    top: list[tuple[int, float]]  # the params.logprobs most likely (token_id, logprob), descending
    # params.logprob_token_ids: (token_id, logprob, rank) of each, whatever its rank
    pinned: list[tuple[int, float, int]] = field(default_factory=list)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def make_generator(seed: int | None, sample_index: int = 0) -> torch.Generator | None:
    """The per-sequence generator of a seeded request; sample ``i`` of ``n`` gets its own stream.

    Sample 0 uses the seed itself, so ``n=1`` with seed s reproduces sample 0 of ``n=4`` with seed s;
    the others get a splitmix64 mix of (seed, index) so no two samples of one request coincide.
    """
    if seed is None:
        return None
    state = seed & _MASK64
    if sample_index:
        z = (state + sample_index * 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(state)
    return gen


class _Workspace:
    """Named scratch buffers reused across calls (grown on demand, never shrunk)."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:numel].view(shape)


class Sampler:
    """Picks one token per row; one instance per model runner (its workspace is not thread-safe).

    ``candidates``: how many of the most likely tokens top_k / top_p rows look at before sorting more.
    ``block``: width of the first level of the two-level draw.
    """

    def __init__(self, candidates: int = 256, block: int = 1024) -> None:
        self.candidates = candidates
        self.block = block
        self._ws = _Workspace()

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: Sequence[int] | int = ()
    ) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
        x = self.apply_processors(logits, rows, eos)
        tokens = self._choose(x, rows)
        lps = rows_logprobs(logits, tokens, rows)
        # Whisper's avg_logprob reads the filtered distribution (whisper_rules.py)
        for i, lp in enumerate(lps):
            if lp is not None and rows[i].params.whisper_rules is not None:
                lp.logprob = float(x[i, lp.token_id].float() - torch.logsumexp(x[i].float(), 0))
        return SamplerOutput(tokens.tolist(), lps)

    @staticmethod
    def plain_argmax(params: SamplingParams) -> bool:
        """Whether a row with ``params`` is the argmax of its raw logits at every position, whatever the
        tokens before it: greedy, and none of ``apply_processors``' stages can apply now or later (one that
        reads the tokens so far, min_tokens or a penalty, counts even where it would not change this one).
        Speculative verification takes such a row's tokens for all positions at once (``verify.py``). Every
        stage ``apply_processors`` has must appear here."""
        return (params.greedy and params.min_tokens == 0 and params.repetition_penalty == 1.0
                and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
                and params.structured_outputs is None and params.allowed_token_ids is None
                and not params.logit_bias and params.reasoning_budget is None
                and params.whisper_rules is None)  # fmt: skip

    # ----- stage 1: logit processors (the only stages that write logits) ------------------------
    def apply_processors(
        self, logits: torch.Tensor, rows: list[SamplingRow], eos: Sequence[int] = ()
    ) -> torch.Tensor:
        """Allowed-token masks, logit_bias, min_tokens masking and penalties, applied to a copy of
        ``logits`` (never to ``logits``).

        Returns ``logits`` itself (as float32) when no row needs any. The copy is a workspace buffer
        that the next call overwrites: clone it to keep it.
        """
        B, V = logits.shape
        dev = logits.device
        ps = [r.params for r in rows]
        min_tok = [i for i, r in enumerate(rows) if len(r.output_token_ids) < ps[i].min_tokens]
        rep = [i for i, p in enumerate(ps) if p.repetition_penalty != 1.0]
        pres_freq = [i for i, p in enumerate(ps) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
        bitmasks = [(i, r.token_bitmask) for i, r in enumerate(rows) if r.token_bitmask is not None]
        masked = [i for i, _ in bitmasks]
        allowed = [i for i, p in enumerate(ps) if p.allowed_token_ids is not None]
        bias = [i for i, p in enumerate(ps) if p.logit_bias]
        forced = [(i, t) for i, r in enumerate(rows) if r.params.reasoning_budget is not None
                  and (t := r.params.reasoning_budget.forced_token(_ids(r.prompt_token_ids),
                                                                   _ids(r.output_token_ids))) is not None]
        ruled = [i for i, p in enumerate(ps) if p.whisper_rules is not None]
        if not (min_tok or rep or pres_freq or masked or allowed or bias or forced or ruled):
            return logits if logits.dtype == torch.float32 else logits.float()

        x = self._ws.get("x", (B, V), torch.float32, dev)
        x.copy_(logits)
        if masked:
            words = torch.stack([m for _, m in bitmasks]).to(dev)
            apply_token_bitmask(x, words, torch.tensor(masked, device=dev) if len(masked) < B else None)
        if allowed:
            keep = torch.zeros(len(allowed), V, dtype=torch.bool, device=dev)
            for j, i in enumerate(allowed):
                ids_ok = [t for t in (ps[i].allowed_token_ids or []) if t < V]
                keep[j, torch.tensor(ids_ok, dtype=torch.long, device=dev)] = True
            a = torch.tensor(allowed, device=dev)
            x[a] = x[a].masked_fill(~keep, float("-inf"))
        for i in bias:
            b = ps[i].logit_bias or {}
            tid = torch.tensor([t for t in b if t < V], dtype=torch.long, device=dev)
            val = torch.tensor([v for t, v in b.items() if t < V], dtype=torch.float32, device=dev)
            x[i].index_add_(0, tid, val)
        if min_tok:
            # vLLM: stop_token_ids always, EOS unless ignore_eos; ids past the vocab can never be drawn.
            # (stop_token_ids is a list after SamplingParams.__post_init__; ``or []`` tells the checker.)
            ids = [
                [t for t in (ps[i].stop_token_ids or []) + ([] if ps[i].ignore_eos else list(eos)) if t < V]
                for i in min_tok
            ]
            mask_tokens(x, flat_keys(min_tok, [as_ids(t) for t in ids], V, dev))
        if rep:
            seen = [
                torch.cat([as_ids(rows[i].prompt_token_ids), as_ids(rows[i].output_token_ids)]) for i in rep
            ]
            penalty = torch.tensor([p.repetition_penalty for p in ps], dtype=torch.float32, device=dev)
            apply_repetition_penalty(x, flat_keys(rep, seen, V, dev), penalty)
        if pres_freq:
            out = [as_ids(rows[i].output_token_ids) for i in pres_freq]
            presence = torch.tensor([p.presence_penalty for p in ps], dtype=torch.float32, device=dev)
            frequency = torch.tensor([p.frequency_penalty for p in ps], dtype=torch.float32, device=dev)
            apply_presence_frequency(x, flat_keys(pres_freq, out, V, dev), presence, frequency)
        for i, t in forced:  # the reasoning budget is spent: its closing tag is the only choice
            x[i].fill_(float("-inf"))
            x[i, t] = 0.0
        for i in ruled:
            ps[i].whisper_rules.apply(x[i], _ids(rows[i].output_token_ids))  # type: ignore[union-attr]
        return x

    # ----- stage 2: greedy rows take the argmax, the others are sampled --------------------------
    def _choose(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        B = x.shape[0]
        dev = x.device
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if len(greedy) == B:
            # every step of a greedy batch: numpy's argmax on CPU, 7x torch's max (argmax.py)
            return greedy_tokens(x)
        tokens = torch.empty(B, dtype=torch.long, device=dev)
        if greedy:
            g = torch.tensor(greedy, device=dev)
            tokens[g] = greedy_tokens(self._take(x, g, "g"))
        sampled = [i for i in range(B) if not rows[i].params.greedy]
        s = torch.tensor(sampled, device=dev)
        tokens[s] = self._sample(x, s, [rows[i] for i in sampled])
        return tokens

    def _take(self, x: torch.Tensor, idx: torch.Tensor, name: str) -> torch.Tensor:
        """``x[idx]`` into a workspace buffer (no fresh allocation); ``x`` itself when idx is everything."""
        if idx.numel() == x.shape[0] and bool((idx == torch.arange(x.shape[0], device=x.device)).all()):
            return x
        out = self._ws.get(name, (idx.numel(), x.shape[1]), x.dtype, x.device)
        return torch.index_select(x, 0, idx, out=out)

    # ----- stage 3: temperature, min_p, top_k, top_p and the draw --------------------------------
    def _sample(self, x: torch.Tensor, idx: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        V = x.shape[1]
        dev = x.device
        ps = [r.params for r in rows]
        n = len(rows)
        K = min(self.candidates, V)
        temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)
        top_k = torch.tensor([max(0, p.top_k) for p in ps], dtype=torch.long, device=dev)
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float64, device=dev)
        min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=dev)
        u = self._uniforms(rows, dev)
        out = torch.empty(n, dtype=torch.long, device=dev)

        full = [j for j, p in enumerate(ps) if p.top_k <= 0]  # may still use min_p / top_p
        cand = [j for j, p in enumerate(ps) if 0 < p.top_k <= K]
        big_k = [j for j, p in enumerate(ps) if p.top_k > K]

        if full:
            # These rows need the whole distribution: to draw from it, or (top_p) for its mass Z, which
            # tells whether the nucleus ends inside the candidates.
            f = torch.tensor(full, device=dev)
            e = self._ws.get("e", (len(full), V), torch.float32, dev)
            torch.index_select(x, 0, idx[f], out=e)
            e.sub_(e.amax(-1, keepdim=True)).div_(temp[f, None]).exp_()  # p / p_max, so min_p is e < min_p
            if any(ps[j].min_p > 0 for j in full):
                e.masked_fill_(e < min_p[f, None], 0.0)
            block = min(self.block, V)  # a small vocab is one block
            block_cum = _block_cumsum(e, block)
            plain = [k for k, j in enumerate(full) if ps[j].top_p >= 1.0]
            if plain:
                pl = torch.tensor(plain, device=dev)
                e_pl = e if len(plain) == len(full) else e[pl]
                out[f[pl]] = _draw_two_level(e_pl, block_cum[pl], u[f[pl]], block)
            nucleus = [k for k, j in enumerate(full) if ps[j].top_p < 1.0]
            if nucleus:
                nu = torch.tensor(nucleus, device=dev)
                r = f[nu]
                e_nu = e if len(nucleus) == len(full) else e[nu]
                vals, ids = e_nu.topk(K, dim=-1)
                z = block_cum[nu, -1]
                tok, kept = _draw_prefix(vals, ids, top_k[r], top_p[r], min_p[r], u[r], mass=z)
                ok = kept < K  # the nucleus ended inside the candidates
                if K < V and not bool(ok.all()):
                    ov = (~ok).nonzero().squeeze(1)
                    tok[ov] = _draw_big_nucleus(e_nu[ov], top_p[r[ov]], min_p[r[ov]], u[r[ov]], z[ov])
                out[r] = tok
        for group, select in ((cand, "topk"), (big_k, "sort")):
            # top_k rows: the kept set lies within the top_k tokens, so no total mass is needed.
            if not group:
                continue
            g = torch.tensor(group, device=dev)
            xs = self._take(x, idx[g], "t")
            if select == "topk":
                vals, ids = xs.topk(K, dim=-1)
            else:  # top_k larger than the candidates
                vals, ids = xs.sort(dim=-1, descending=True, stable=True)
            e_top = ((vals - vals[:, :1]) / temp[g, None]).exp_()
            out[g], _ = _draw_prefix(e_top, ids, top_k[g], top_p[g], min_p[g], u[g])
        return out

    @staticmethod
    def _uniforms(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """One U[0, 1) per row: seeded rows from their own generator, the rest from the default one."""
        u = torch.rand(len(rows), dtype=torch.float64)
        for j, r in enumerate(rows):
            if r.generator is not None:
                u[j] = torch.rand(
                    (), dtype=torch.float64, generator=r.generator, device=r.generator.device
                ).item()
        return u.to(device)


# ----- logprobs of the raw distribution ----------------------------------------------------------
def rows_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]
) -> list[TokenLogprobs | None]:
    """What each row's request asked for about its chosen token ``tokens[i]`` (``logprobs``, and the
    ``logprob_token_ids`` it pins), None where it asked for nothing. Shared with speculative verification."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not want:
        return result
    w = torch.tensor(want, device=logits.device)
    found = token_logprobs(logits.index_select(0, w), tokens[w], [rows[i].params.logprobs or 0 for i in want])
    for i, lp in zip(want, found):
        if pinned := rows[i].params.logprob_token_ids:
            from forwardpass.sampling.pinned_logprobs import pinned_logprobs

            lp.pinned = pinned_logprobs(logits[i], pinned)
        result[i] = lp
    return result


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """Under the raw distribution of each row of ``logits``: the logprob and rank of ``tokens[i]`` and
    the ``ks[i]`` most likely tokens. Used for sampled tokens and for prompt tokens (prompt_logprobs)."""
    raw = logits.float()
    ks = [k if k >= 0 else raw.shape[-1] for k in ks]  # -1: the whole vocabulary
    lse = torch.logsumexp(raw, dim=-1)  # log_softmax(raw)[t] = raw[t] - lse, without a [n, V] output
    chosen = raw.gather(1, tokens[:, None]).squeeze(1)
    rank = (raw > chosen[:, None]).sum(-1) + 1
    k_max = max(ks, default=0)
    top_vals, top_ids = raw.topk(k_max, dim=-1) if k_max else (raw[:, :0], raw[:, :0].long())
    top_lps: list[list[float]] = (top_vals - lse[:, None]).tolist()
    top_tok: list[list[int]] = top_ids.tolist()
    return [
        TokenLogprobs(token_id=t, logprob=lp, rank=rk, top=list(zip(top_tok[j][:k], top_lps[j][:k])))
        for j, (t, lp, rk, k) in enumerate(zip(tokens.tolist(), (chosen - lse).tolist(), rank.tolist(), ks))
    ]


def _ids(ids: TokenIds) -> Sequence[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else ids


def apply_token_bitmask(x: torch.Tensor, words: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set to -inf the logits of tokens whose bit is clear: ``words[j]`` masks row ``rows[j]`` of ``x``
    (every row when ``rows`` is None). ``words`` are int32, bit i of word w = token 32w + i (xgrammar's
    layout); bits past the vocabulary are ignored. Pure torch, so the same on CPU and CUDA."""
    V = x.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    bits = ((words[:, :, None] >> shifts) & 1).reshape(words.shape[0], -1)[:, :V]
    refused = bits == 0
    if rows is None:
        x.masked_fill_(refused, float("-inf"))
    else:
        x[rows] = x[rows].masked_fill(refused, float("-inf"))


# ----- draws: inverse CDF, one uniform per row ----------------------------------------------------
def _block_cumsum(e: torch.Tensor, block: int) -> torch.Tensor:
    """Cumulative sums of ``block``-wide slices of each row (the last one may be shorter).

    Each block is summed in float32 (torch's cascade sum: ~1e-7 relative error, and 7x faster than
    accumulating in float64 on CPU); only the short running sum over blocks is float64.
    """
    n, V = e.shape
    nb = V // block
    parts = []
    if nb:
        parts.append(e[:, : nb * block].reshape(n, nb, block).sum(-1))
    if V % block:
        parts.append(e[:, nb * block :].sum(-1, keepdim=True))
    sums = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return sums.double().cumsum(-1)


def _draw_two_level(e: torch.Tensor, block_cum: torch.Tensor, u: torch.Tensor, block: int) -> torch.Tensor:
    """Token ~ e / e.sum() per row: pick a block by its cumulative mass, then a token inside it."""
    V = e.shape[1]
    t = u * block_cum[:, -1]
    j = torch.searchsorted(block_cum, t[:, None], right=True).clamp_(max=block_cum.shape[1] - 1)
    before = torch.where(j > 0, block_cum.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(t[:, None]))
    t = t[:, None] - before  # >= 0: position inside block j
    pos = j * block + torch.arange(block, device=e.device)
    inner = e.gather(1, pos.clamp(max=V - 1)) * (pos < V)  # the last block may be short
    inner_cum = inner.cumsum(-1, dtype=torch.float64)
    # The block total came from a different summation order; keep t strictly inside this block.
    t = torch.minimum(t, torch.nextafter(inner_cum[:, -1:], torch.zeros_like(t)))
    k = torch.searchsorted(inner_cum, t, right=True).clamp_(max=block - 1)
    return (j * block + k).squeeze(1)


def _draw_prefix(
    e: torch.Tensor,
    ids: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
    mass: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw from the leading ``C`` tokens of each row, given (``e``, ``ids``) sorted by ``e`` descending.

    ``e`` is p / p_max at the row's temperature (so ``e[:, 0] == 1``). min_p, top_k and top_p each keep
    a prefix of the sorted tokens, so the kept set is the shortest of the three prefixes (top_p measured
    after the other two, as vLLM). ``mass`` is each row's total ``e`` (after min_p) when the prefix may
    be shorter than the kept set; without it the prefix is taken to hold the whole kept set. Returns the
    tokens and how many tokens were kept: if that is the whole prefix, the nucleus may go on past it.
    """
    C = e.shape[1]
    keep = e >= min_p[:, None]
    pos = torch.arange(C, device=e.device)
    keep &= pos < torch.where(top_k > 0, top_k, C)[:, None]
    e = e * keep
    cum = e.cumsum(-1, dtype=torch.float64)
    kept = keep.sum(-1)  # >= 1: the top token has e = 1 >= min_p, and top_k >= 1
    if mass is None:
        mass = cum.gather(1, (kept - 1)[:, None]).squeeze(1)
    # Keep token i while the mass strictly before it is < top_p: the smallest set reaching top_p.
    keep &= (cum - e) < (top_p * mass)[:, None]
    kept = keep.sum(-1).clamp_(min=1)
    total = cum.gather(1, (kept - 1)[:, None])
    j = torch.searchsorted(cum, u[:, None] * total, right=True)
    j = torch.minimum(j, (kept - 1)[:, None])
    return ids.gather(1, j).squeeze(1), kept


def _draw_big_nucleus(
    e: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor, mass: torch.Tensor
) -> torch.Tensor:
    """top_p rows whose nucleus is larger than the candidates: sort, but on CPU only what can matter.

    A full sort of 152k values costs ~14 ms per row on one CPU core. Tokens in the float32 exponent
    bins below the one where the nucleus ends (found from a per-row histogram of mass by exponent)
    weigh < (1 - top_p) * mass and so cannot be in it; sorting the rest is ~6x cheaper on flat
    distributions. Sorts are stable (ties break by token id), so a row's token never depends on the
    batch. The bound is only an optimization: a row whose nucleus reaches the end of the pruned
    prefix (float error) is redone on the full sort. On GPU the full sort is cheap and used directly.
    """
    n, V = e.shape
    zero = torch.zeros(n, dtype=torch.long, device=e.device)
    if e.device.type == "cpu":
        exponent = e.view(torch.int32) >> 23  # e in [0, 1]: no sign bit; bin b holds [2^(b-127), 2^(b-126))
        keys = exponent + torch.arange(n, dtype=torch.int32)[:, None] * 256
        hist = torch.bincount(keys.view(-1), weights=e.reshape(-1), minlength=n * 256).view(n, 256).double()
        at_or_above = hist.flip(1).cumsum(1).flip(1)  # mass in bins >= b
        b = (at_or_above >= (top_p * mass)[:, None]).sum(1) - 1  # the bin where the nucleus ends
        floor = torch.where(b > 0, torch.ldexp(torch.ones(n), (b - 127).to(torch.int32)), 0.0)
        kept_vals, kept_ids = [], []
        for i in range(n):
            sel = (e[i] >= floor[i]).nonzero().squeeze(1)
            vals, order = e[i, sel].sort(descending=True, stable=True)
            kept_vals.append(vals)
            kept_ids.append(sel[order])
        vals = torch.nn.utils.rnn.pad_sequence(kept_vals, batch_first=True)  # zero mass past each row's end
        ids = torch.nn.utils.rnn.pad_sequence(kept_ids, batch_first=True)
        tok, kept = _draw_prefix(vals, ids, zero, top_p, min_p, u, mass=mass)
        lengths = torch.tensor([len(v) for v in kept_vals])
        ok = (kept < lengths) | (lengths == V)  # the nucleus ended inside what was sorted
        if bool(ok.all()):
            return tok
        redo = (~ok).nonzero().squeeze(1)
        tok[redo] = _draw_big_nucleus_by_full_sort(e[redo], top_p[redo], min_p[redo], u[redo], mass[redo])
        return tok
    return _draw_big_nucleus_by_full_sort(e, top_p, min_p, u, mass)


def _draw_big_nucleus_by_full_sort(
    e: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor, mass: torch.Tensor
) -> torch.Tensor:
    vals, ids = e.sort(dim=-1, descending=True, stable=True)
    zero = torch.zeros(e.shape[0], dtype=torch.long, device=e.device)
    return _draw_prefix(vals, ids, zero, top_p, min_p, u, mass=mass)[0]
