"""``method: draft_model``: a small model with the target's tokenizer proposes the drafts.

The draft runs in the engine, beside the scheduler: the ``Speculator`` asks it for a speculating sequence's
drafts (``propose_for``), it catches its own KV cache (``draft_cache.py``) up with the sequence's tokens,
then runs ``k`` one-token steps. It is built by the engine's own loader with the target's execution plan
(any name, directory or ``.gguf`` file the engine takes), so it goes through the same attention kernels.

Rollback needs no message from the scheduler: the draft's cache remembers the tokens it holds, and the next
proposal keeps only the prefix the sequence still agrees with (rejected drafts differ from what the target
emitted there). A finished or preempted sequence's blocks are returned through ``release``.

Greedy requests (and requests filtered by top-k / top-p / min-p, whose filtered distribution the
verifier does not rebuild) get the draft's argmax: a point mass, verified by ``verify.py``'s rule as
prompt-lookup drafts are. Other sampled requests draw each draft from the draft's distribution ``q`` at the
request's temperature and pass ``q`` along (``DraftTokens.probs``), for the full rejection rule of
``draft_verify.py``; each sequence draws from a generator of its own, separate from the target's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from forwardpass.attention.context import AttentionContext
from forwardpass.config import EngineConfig, SpeculativeConfig
from forwardpass.engine.scheduling.kv_cache_spec import KVCacheGroup
from forwardpass.engine.speculative.draft_cache import DraftKVCache, DraftSequence, build_draft_cache
from forwardpass.engine.speculative.draft_step import DraftStepper
from forwardpass.errors import ConfigError
from forwardpass.sampling.argmax import greedy_tokens
from forwardpass.sampling.params import SamplingParams
from forwardpass.sampling.sampler import make_generator

logger = logging.getLogger(__name__)

#: text whose token ids must be the same under both tokenizers (words, digits, punctuation, spacing)
_PROBE = "The quick brown fox, 1234 times: don't stop!\n\n  Zürich -- \"quoted\" (text)."
_DRAFT_STREAM = 0x5DEECE66D  # mixed into a seeded request's seed: the draft's draws are not the target's


class DraftTokens(tuple):
    """Draft token ids (a plain ``tuple[int, ...]`` to every reader) and, for drafts sampled from the draft's
    distribution, that distribution: ``probs[i]`` is the ``q`` that ``self[i]`` was drawn from (float32,
    ``[len(self), vocab]``); None for point-mass (argmax) drafts."""

    probs: torch.Tensor | None

    def __new__(cls, tokens: Sequence[int], probs: torch.Tensor | None = None) -> DraftTokens:
        self = super().__new__(cls, tokens)
        self.probs = probs
        return self


class Drafting(Protocol):
    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    index: int


def samples_from_q(params: SamplingParams) -> bool:
    """Whether drafts for a request with ``params`` are drawn from ``q`` (full rejection rule), not argmax."""
    return not params.greedy and params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0


class DraftModelProposer:
    def __init__(self, model: Any, cache: DraftKVCache, *, device: str, attention_backend: str = "sdpa",
                 decode_kernel: Any = None, max_len: int | None = None):
        self.model, self.cache, self.device = model, cache, device
        self.max_len = max_len  # the draft's context (positions): longer sequences get no drafts
        self.attention_backend, self.decode_kernel = attention_backend, decode_kernel
        self.generators: dict[int, torch.Generator | None] = {}
        # the lean forward (draft_step.py) where the draft's decode step is its decode stack; else None
        self.stepper = DraftStepper.build(model, cache, max_len, decode_kernel)
        self.num_forwards = 0  # draft forward passes run (tests: the draft really ran)
        self.num_lean = 0  # of which through the stepper (tests: the fast path was taken)
        self.seconds_per_draft = 0.0  # running mean of one forward pass: the adaptive policy's cost model
        self.seconds_drafting = 0.0  # every forward pass's time (benchmarks: the draft's share of a step)

    @torch.inference_mode()
    def propose_for(self, seq: Drafting, k: int) -> DraftTokens:
        """Up to ``k`` drafts to follow ``seq.token_ids`` (fewer only when the draft's pool is full)."""
        tokens = seq.token_ids
        if k < 1 or not tokens or (self.max_len is not None and len(tokens) + k > self.max_len):
            return DraftTokens(())
        state = self.cache.sequence(seq.seq_id)
        # keep the K/V of the prefix the sequence still agrees with; the last token always runs again
        keep = min(state.common_prefix(tokens), len(tokens) - 1)
        self.cache.truncate(state, keep)
        state.checked = keep
        sampled = samples_from_q(seq.params)
        gen = self._generator(seq) if sampled else None
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        feed = list(tokens[keep:])
        for _ in range(k):
            logits = self._forward(state, feed)
            if logits is None:  # the pool is full: no (more) drafts for now, and its blocks go back
                self.cache.release(seq.seq_id)
                break
            token = self._draw(logits, seq, gen, probs if sampled else None)
            drafts.append(token)
            feed = [token]
        return DraftTokens(drafts, torch.stack(probs) if probs and len(probs) == len(drafts) else None)

    @staticmethod
    def _draw(logits: torch.Tensor, seq: Drafting, gen: torch.Generator | None,
              probs: list[torch.Tensor] | None) -> int:
        """One draft from ``logits``: the argmax (``probs`` None), else a draw from ``q`` at the request's
        temperature, with ``q`` appended to ``probs``."""
        if probs is None:
            return int(greedy_tokens(logits))
        q = torch.softmax(logits / seq.params.temperature, dim=-1)
        probs.append(q)
        return int(torch.multinomial(q, 1, generator=gen))

    def _forward(self, state: DraftSequence, feed: list[int]) -> torch.Tensor | None:
        """Run ``feed`` after the cached tokens; the float32 logits after its last token (None: no room)."""
        t0 = time.perf_counter()
        start = len(state.tokens)
        end = start + len(feed)
        if not self.cache.reserve(state, end):
            return None
        if self.stepper is not None and self.stepper.applies(state, feed):
            logits = self.stepper.run(state, feed)
            self.num_lean += 1
        else:
            logits = self._model_forward(state, feed, start, end)
        self.num_forwards += 1
        seconds = time.perf_counter() - t0
        self.seconds_drafting += seconds
        if len(feed) <= 2:  # a draft step (not a prompt's catch-up, paid once per sequence)
            old = self.seconds_per_draft
            self.seconds_per_draft = seconds if not old else 0.8 * old + 0.2 * seconds
        return logits

    def _model_forward(self, state: DraftSequence, feed: list[int], start: int, end: int) -> torch.Tensor:
        """The generic path: the engine's metadata builders and the model's own forward (a prompt's catch-up,
        drafts the stepper does not cover)."""
        builders = [g.spec.metadata_builder(self.device) for g in self.cache.groups]
        for builder, table in zip(builders, state.tables):
            builder.add(table, start, end, 0)
        ctx = AttentionContext(kv_caches=self.cache.kv_caches, groups=[b.build() for b in builders],
                               layer_group=self.cache.layer_group, num_decode=int(len(feed) == 1),
                               backend=self.attention_backend, decode_kernel=self.decode_kernel)
        ids = torch.tensor(feed, dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, dtype=torch.long, device=self.device)
        hidden = self.model(ids, positions, ctx)
        state.tokens.extend(feed)
        return self.model.compute_logits(hidden[-1:])[0].float()

    def _generator(self, seq: Drafting) -> torch.Generator | None:
        if seq.seq_id not in self.generators:
            seed = seq.params.seed
            self.generators[seq.seq_id] = None if seed is None else make_generator(seed ^ _DRAFT_STREAM,
                                                                                  seq.index)
        return self.generators[seq.seq_id]

    def release(self, seq_id: int) -> None:
        """The sequence finished or was preempted: its cache blocks return to the draft's pool."""
        self.cache.release(seq_id)
        self.generators.pop(seq_id, None)


def check_same_tokenizer(target_dir: Path, draft_dir: Path, target_vocab: int, draft_vocab: int) -> None:
    """A ``ConfigError`` naming ``model`` unless the draft speaks the target's token ids."""
    from forwardpass.loader.tokenizer import Tokenizer

    why = None
    if draft_vocab != target_vocab:
        why = f"its vocabulary has {draft_vocab} tokens, the target's {target_vocab}"
    elif (target_dir / "tokenizer.json").exists() and (draft_dir / "tokenizer.json").exists():
        t, d = Tokenizer.from_dir(target_dir), Tokenizer.from_dir(draft_dir)
        if t.encode(_PROBE, add_special_tokens=False) != d.encode(_PROBE, add_special_tokens=False):
            why = "its tokenizer encodes a probe text to other token ids"
        elif t.eos_token_id != d.eos_token_id:
            why = f"its end-of-sequence token is {d.eos_token_id}, the target's {t.eos_token_id}"
        elif any(t.id_to_token(i) != d.id_to_token(i)
                 for i in (0, 1, 2, target_vocab // 2, target_vocab - 1)):
            why = "its tokens differ from the target's at the same ids"
    if why:
        raise ConfigError(f"speculative_config.model {draft_dir}: the draft must share the target's "
                          f"tokenizer, but {why}", param="speculative_config.model")


def draft_engine(config: SpeculativeConfig, engine: EngineConfig, draft_dir: Path) -> EngineConfig:
    """The draft's engine options: the target's numerics (dtype, device, kernels), none of its per-model
    options, and the draft's own quantization. ``auto`` quantizes to int8 on CPU where the draft would compute
    with fp32 weights from a plain checkpoint: 4x fewer weight bytes make a draft pass much cheaper beside the
    target's, and the draft's precision can change which tokens it proposes, never the output."""
    from forwardpass.loader.ctranslate2 import is_converted_dir
    from forwardpass.loader.gguf import is_gguf_dir

    quant = config.quantization
    if quant == "auto":
        plain = not (is_gguf_dir(draft_dir) or is_converted_dir(draft_dir))
        quant = "int8" if plain and engine.device == "cpu" and engine.torch_dtype == torch.float32 else None
    return dataclasses.replace(engine, quantization=quant, enable_lora=False, speculative_config=None)


def build_draft_proposer(config: SpeculativeConfig, target_dir: Path, engine: EngineConfig, target_vocab: int,
                         target_groups: Sequence[KVCacheGroup]) -> DraftModelProposer:
    """Load ``config.model`` with the engine's loader and plan, check its tokenizer, size its KV pool."""
    from forwardpass.errors import ModelNotFoundError
    from forwardpass.models.prepare import prepare_model, resolve_plan
    from forwardpass.registry import resolve_model

    try:
        draft_dir = Path(resolve_model(config.model, kinds=("text",), flag="speculative_config.model"))
    except (ModelNotFoundError, ConfigError) as exc:
        raise ConfigError(f"speculative_config.model {config.model!r}: {exc}",
                          param="speculative_config.model") from exc
    try:
        plan = resolve_plan(draft_engine(config, engine, draft_dir), draft_dir)
    except ConfigError:  # e.g. an already-quantized checkpoint: "auto" then takes its weights as stored
        if config.quantization != "auto":
            raise
        plan = resolve_plan(draft_engine(dataclasses.replace(config, quantization=None), engine, draft_dir),
                            draft_dir)
    net, spec = prepare_model(draft_dir, plan)
    check_same_tokenizer(target_dir, draft_dir, target_vocab, spec.vocab)
    cache, groups, size = build_draft_cache(spec, net, engine, target_groups, config.num_speculative_tokens)
    logger.info("draft model %s: %d layers, weights %s, KV pool of %d blocks (%.1f MB)", draft_dir,
                spec.layers, plan.quantized_format or "as stored", groups[0].num_blocks, size / 1e6)
    return DraftModelProposer(net, cache, device=engine.device, attention_backend=engine.attention_backend,
                              decode_kernel=plan.kernels.decode, max_len=spec.max_position_embeddings or None)
