"""A stand-in ``vllm`` package, so vLLM's test modules import without vLLM installed.

Every ``vllm.*`` module exists and every name in it is a placeholder (callable, subclassable, falsy), so a
module that imports vLLM classes for its unit tests still loads and its *server* tests can run; the unit
tests themselves are left out of the count (plugin.py). A few names are real, because server tests use them:
``vllm.tokenizers.get_tokenizer`` (our tokenizer of the model that answers for that name) and
``vllm.platforms.current_platform`` (a CPU).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from functools import cache
from typing import Any


class _Placeholder:
    """Any vLLM class or function a test module imports but a server test never really uses."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Placeholder:
        return _Placeholder()

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __bool__(self) -> bool:  # `if current_platform.is_rocm():` and the like take the plain branch
        return False

    def __iter__(self):  # noqa: ANN204 - unpacking a placeholder gives nothing
        return iter(())

    def __class_getitem__(cls, item: Any) -> type[_Placeholder]:
        return cls


class _Tokenizer:
    """The subset of a Hugging Face tokenizer vLLM's server tests call, over forwardpass's tokenizer."""

    def __init__(self, model: str) -> None:
        from forwardpass.loader.tokenizer import Tokenizer
        from forwardpass.registry import resolve_model

        self._tok = Tokenizer.from_dir(resolve_model(model))

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Any, skip_special_tokens: bool = False, **_: Any) -> str:
        return self._tok.decode([ids] if isinstance(ids, int) else list(ids),
                                skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    def apply_chat_template(self, conversation: list[dict] | None = None, tokenize: bool = False,
                            add_generation_prompt: bool = False, **kwargs: Any) -> Any:
        messages = conversation if conversation is not None else kwargs.pop("messages")
        cont = kwargs.pop("continue_final_message", False)
        text = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        if cont:  # transformers: cut right after the final message's text
            last = messages[-1]["content"]
            text = text[: text.rindex(last) + len(last)]
        return self._tok.encode(text, add_special_tokens=False) if tokenize else text

    def __len__(self) -> int:
        return len(self._tok)


def _answering(hf_id: str) -> str:
    """The model that answers for ``hf_id`` in the running test (plan.model_for: some files get their own)."""
    from benchmarks.vllm_openai_compat.plan import model_for

    return model_for(hf_id, os.environ.get("PYTEST_CURRENT_TEST", ""))


@cache
def _tokenizer(model: str) -> _Tokenizer:
    return _Tokenizer(model)


def get_tokenizer(tokenizer_name: str = "", *args: Any, **kwargs: Any) -> _Tokenizer:
    return _tokenizer(_answering(tokenizer_name or kwargs.get("tokenizer", "")))


class ModelConfig:
    """``vllm.config.ModelConfig(model=...)``: the vocabulary size of the model that answers for that name
    (tests size their token ids with it)."""

    def __init__(self, model: str = "", **_: Any) -> None:
        self.model = model

    def get_vocab_size(self) -> int:
        from forwardpass.models.model_spec import load_model_spec
        from forwardpass.registry import resolve_model

        return load_model_spec(resolve_model(_answering(self.model))).vocab


_REAL: dict[str, dict[str, Any]] = {
    "vllm.config": {"ModelConfig": ModelConfig},
    "vllm.tokenizers": {"get_tokenizer": get_tokenizer},
    "vllm.transformers_utils.tokenizer": {"get_tokenizer": get_tokenizer},
    "vllm.platforms": {"current_platform": _Placeholder()},
}


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__dict__.update(_REAL.get(spec.name, {}))
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
