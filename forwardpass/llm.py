"""The offline Python API, mirroring vLLM: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from forwardpass.config import EngineConfig
from forwardpass.engine.frontend.llm_engine import LLMEngine
from forwardpass.engine.frontend.outputs import RequestOutput
from forwardpass.errors import ChatTemplateError, ValidationError
from forwardpass.sampling.params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """Load a Hugging Face model and generate with continuous batching.

    ``model`` is any name ``forwardpass models`` lists, a directory, a ``.gguf`` file or a Hugging Face id
    (``"Qwen/Qwen3-0.6B"``, at ``revision``), resolved by ``forwardpass/registry.py``; ``model=None`` uses
    the embedded default model shipped in ``forwardpass/assets``.
    Engine options (``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``, ``num_kv_blocks``,
    ``kv_cache_memory``, ``max_model_len``, ``enable_prefix_caching``, ``attention_backend``,
    ``cpu_kernels``, ``seed``, ``enable_lora``, ``max_loras``, ``max_lora_rank``, ``tensor_parallel_size``,
    ``enable_expert_parallel``, ``distributed_timeout_s``) are passed through to
    :class:`forwardpass.config.EngineConfig`. ``num_threads``: CPU threads of torch's pools and the compiled
    kernels (default: the cores this process may use; ``forwardpass/threads.py``). With
    ``tensor_parallel_size > 1`` worker processes are spawned, so a script needs an
    ``if __name__ == "__main__":`` guard (``docs/distributed.md``).

    ``task``: ``"generate"``, ``"embed"`` (an encoder such as a sentence-transformers ``BertModel``:
    ``llm.embed(texts)``; options ``device``, ``max_model_len``, ``max_num_batched_tokens``,
    ``attention_backend``) or ``"auto"`` (embed for encoders, generate otherwise).
    """

    def __init__(self, model: str | Path | None = None, dtype: str = "auto", revision: str | None = None,
                 task: str = "auto", num_threads: int | None = None, **engine_kwargs: Any):
        from forwardpass.threads import apply_threads, check_threads

        # CPU threads of torch's pools and the compiled kernels (llama.cpp's -t); None: the cores this process
        # may use, or fewer if torch was already set lower (forwardpass/threads.py)
        self.num_threads = apply_threads(check_threads(num_threads, "num_threads"))
        if model is None:
            from forwardpass.assets import default_llm_path

            model = default_llm_path()
        else:
            from forwardpass.registry import resolve_model_path

            model = resolve_model_path(model, revision=revision)
        from forwardpass.embed.task import resolve_task

        # task="embed" (or "auto" on an encoder such as BertModel): no paged engine, an EmbeddingRunner
        self.task = resolve_task(model, task)
        self._ids = itertools.count()
        self.embedder = None
        if self.task == "embed":
            from forwardpass.embed.offline import build_runner

            self.embedder = build_runner(model, dtype, engine_kwargs)
            return
        config = EngineConfig(dtype=dtype, **engine_kwargs)
        from forwardpass.memory_need import check_memory

        # weights + KV cache against the memory there is, before loading (generate, chat, this API; serve
        # checks in its own process): refused with the numbers, not killed by the OS halfway through the load
        check_memory(model, config)
        self.engine = LLMEngine(model, config)

    def __getattr__(self, name: str) -> Any:
        if name == "engine" and self.__dict__.get("task") == "embed":
            raise ValidationError("this LLM embeds (task='embed'); use llm.embed(texts), or load a "
                                  "generative model to generate", param="task")
        raise AttributeError(name)

    def get_tokenizer(self):
        return self.embedder.tokenizer if self.embedder is not None else self.engine.tokenizer

    # ----- embed ---------------------------------------------------------------------------------
    def embed(self, prompts: PromptType | Seq[PromptType], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list:
        """One ``EmbeddingRequestOutput`` per prompt (``out.outputs.embedding``), in the prompts' order.

        ``truncate_prompt_tokens``: ``k`` keeps at most ``k`` tokens, ``-1`` the model's maximum; without
        it an input longer than the model's maximum is an error. See ``forwardpass/embed/``.
        """
        if self.embedder is None:
            raise ValidationError("embed() needs an embedding model: load an encoder (e.g. a "
                                  "sentence-transformers BertModel directory) with LLM(model, task='embed')",
                                  param="task")
        from forwardpass.embed.offline import embed_prompts

        return embed_prompts(self.embedder, prompts, truncate_prompt_tokens=truncate_prompt_tokens,
                             use_tqdm=use_tqdm, ids=self._ids)

    # ----- generate ------------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        A prompt is a string, a list of token ids, or ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``;
        a speech model's dict also has ``"multi_modal_data": {"audio": (samples, sample_rate)}``.
        """
        prompts, media = self._normalize_prompts(prompts)
        params = self._per_prompt(sampling_params, len(prompts), "sampling_params")
        loras = self._per_prompt(lora_request, len(prompts), "lora_request")
        ids = []
        try:
            for prompt, p, lora, mm in zip(prompts, params, loras, media):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p or self.engine.default_sampling_params(),
                                        lora_request=lora, multi_modal_data=mm)
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort(ids)  # never leave half a batch in the engine
            raise

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        tok = self.engine.tokenizer
        if tok is None:
            raise ChatTemplateError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                           **(chat_template_kwargs or {}))
            # The template already wrote any BOS token it wants; don't let the tokenizer add another.
            prompts.append(tok.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # ----- helpers -------------------------------------------------------------------------------
    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2)
        with bar:
            while pending:
                for out in self.engine.step(only_finished=True):
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        from forwardpass.analysis.oversubscription import watch_engine

        watch_engine(self.engine).observe(self.engine.stats)  # one warning per process if oversubscribed
        return [results[i] for i in ids]

    @staticmethod
    def _normalize_prompts(prompts) -> tuple[list[str | list[int]], list[dict | None]]:
        """The prompts, and each one's ``multi_modal_data`` (audio for Whisper) or None."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        out: list[str | list[int]] = []
        media: list[dict | None] = []
        for p in prompts:
            media.append(p.get("multi_modal_data") if isinstance(p, dict) else None)
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    p = list(p["prompt_token_ids"])
                elif "prompt" in p:
                    p = p["prompt"]
                else:
                    raise ValidationError("a prompt dict needs 'prompt' or 'prompt_token_ids'",
                                          param="prompts")
            if not isinstance(p, (str, list)):
                raise ValidationError("a prompt must be a string or a list of token ids, got "
                                      f"{type(p).__name__}", param="prompts")
            out.append(p)
        if not out:
            raise ValidationError("no prompts given", param="prompts")
        return out, media

    @staticmethod
    def _per_prompt(value, n: int, name: str) -> list:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValidationError(f"{name} has {len(value)} entries for {n} prompts", param=name)
            return list(value)
        return [value] * n
