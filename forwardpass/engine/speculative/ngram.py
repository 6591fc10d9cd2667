"""Prompt-lookup drafts: the continuation of the last n-gram's earlier occurrence in prompt + output.

No model: if the sequence ends with tokens ``t[-n:]`` that also occur earlier, the tokens that followed
that occurrence are a good guess for what comes next whenever text is copied (quoting, summarising,
editing a given text, code with repeated identifiers, a model looping). The longest ``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min`` is tried first; of its occurrences the most recent
one is used (the nearest context). A continuation that runs into the end of the sequence goes on reading
what it has just proposed, so a loop of period p (``a b c a b c a b``) is proposed k tokens ahead. The
search is ``bytes.rfind`` over the ids packed 8 bytes each (a match must start at a token boundary): it runs
every decode step of a speculating request, 3x faster than numpy comparisons over 400 tokens (7 vs 24 us).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

WIDTH = 8  # bytes of a token id in the searched buffer (array 'q')


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, "
                             f"{prompt_lookup_max}")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (empty when no n-gram recurs)."""
        return self.match(token_ids, k)[0]

    def match(self, token_ids: Sequence[int], k: int) -> tuple[tuple[int, ...], int]:
        """``(drafts, n)``: up to ``k`` drafts and the length ``n`` of the n-gram match they continue (the
        policy's acceptance estimate depends on it); ``((), 0)`` when no n-gram recurs."""
        num = len(token_ids)
        if k < 1 or num <= self.min_n:
            return (), 0
        data = array("q", token_ids).tobytes()  # WIDTH bytes a token: the search is bytes.rfind, in C
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            suffix = data[(num - n) * WIDTH :]
            # the most recent occurrence that ends before the suffix itself (within tokens 0 .. num - 2),
            # at a token boundary
            end = (num - 1) * WIDTH
            at = data.rfind(suffix, 0, end)
            while at > 0 and at % WIDTH:
                end = at + len(suffix) - 1
                at = data.rfind(suffix, 0, end)
            if at >= 0:
                start = at // WIDTH + n  # its continuation
                drafts = list(token_ids[start : start + k])
                while len(drafts) < k:  # ran into the end: continue through the proposal itself
                    drafts.append(drafts[len(drafts) - (num - start)])
                return tuple(drafts), n
        return (), 0
