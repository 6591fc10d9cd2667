"""A model directory's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library.

transformers is not a runtime dependency, so this reproduces the parts of its ``AutoTokenizer`` load
that change ids or text: special tokens from ``tokenizer_config.json`` (added if the vocabulary lacks
them), padding and truncation baked into tokenizer.json (off, as HF's ``tokenizer(text)`` has them),
chat templates from ``chat_template.jinja`` / ``additional_chat_templates/`` / the config, and
``clean_up_tokenization_spaces`` (which transformers 5 ignores for BPE models). BOS/EOS insertion is
whatever tokenizer.json's post-processor says: like transformers 5, the config's ``add_bos_token`` /
``add_eos_token`` are ignored when tokenizer.json exists.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

from forwardpass.errors import ChatTemplateError, ModelNotFoundError, TokenizerError
from forwardpass.loader.chat_template import probe_chat_template, render_chat_template
from forwardpass.loader.detokenizer import IncrementalDetokenizer
from forwardpass.loader.jsonfile import read_json_object
from forwardpass.loader.paths import check_inside, model_file

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict:
    return read_json_object(path, error=TokenizerError, fix="re-save the tokenizer with save_pretrained")


def _as_added_token(value: Any) -> AddedToken | None:
    """A special token from the config: a string or an AddedToken dict ({"content": ..., ...})."""
    if value is None:
        return None
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return AddedToken(
            value["content"],
            special=True,
            single_word=value.get("single_word", False),
            lstrip=value.get("lstrip", False),
            rstrip=value.get("rstrip", False),
            normalized=value.get("normalized", False),
        )
    raise TokenizerError(f"special token {value!r} must be a string or a {{'content': ...}} object")


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (for WordPiece-era tokenizers)."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


def _load_chat_templates(model_dir: Path, config: dict) -> dict[str, str]:
    """Templates by name; files written by newer transformers override the config's copy."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for item in raw:
            if not (isinstance(item, dict) and isinstance(item.get("template"), str)):
                raise TokenizerError(
                    f"{model_dir / TOKENIZER_CONFIG_FILE}: chat_template entries must be {{name, template}} "
                    "objects"
                )
            templates[str(item.get("name", "default"))] = item["template"]
    elif raw is not None:
        raise TokenizerError(f"{model_dir / TOKENIZER_CONFIG_FILE}: chat_template must be a string or a list")
    if (jinja := model_file(model_dir, "chat_template.jinja")).is_file():
        templates["default"] = jinja.read_text(encoding="utf-8")
    extra_dir = model_file(model_dir, "additional_chat_templates")
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = check_inside(model_dir, file).read_text(encoding="utf-8")
    return templates


class Tokenizer:
    """Encode / decode / chat-template for one model, matching ``transformers.AutoTokenizer``.

    ``vocab_size`` counts added tokens too (HF's ``len(tokenizer)``, not its ``vocab_size``): it is
    the range of ids this tokenizer can produce or decode, which the model's embedding must cover.
    """

    def __init__(
        self, backend: tokenizers.Tokenizer, config: dict, chat_templates: dict[str, str], source: Path
    ):
        self.backend = backend
        self.source = source
        self.chat_templates = chat_templates
        self.chat_template: str | None = chat_templates.get("default")
        # HF's `tokenizer(text)` neither pads nor truncates, whatever tokenizer.json says.
        backend.no_padding()
        backend.no_truncation()

        specials = {key: _as_added_token(config.get(key)) for key in _SPECIAL_KEYS}
        extras = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extras = list(extras.values()) if isinstance(extras, dict) else list(extras)
        extra_tokens = [t for t in (_as_added_token(v) for v in extras) if t is not None]
        self._add_missing_tokens(config, [t for t in specials.values() if t is not None] + extra_tokens)

        self.special_tokens = {key: tok.content for key, tok in specials.items() if tok is not None}
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        self.pad_token_id = self._id(self.special_tokens.get("pad_token"))

        named = [self._id(t) for t in self.special_tokens.values()] + [
            self._id(t.content) for t in extra_tokens
        ]
        # What decode(skip_special_tokens=True) drops: added tokens flagged special.
        self.skipped_special_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        self.all_special_ids: set[int] = {i for i in named if i is not None} | self.skipped_special_ids

        # transformers 5 skips the cleanup for BPE models because it corrupts their output.
        self.cleans_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
        )
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(
            backend.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1
        )
        # Ids of <0xNN> tokens when the model falls back to bytes (SentencePiece-style); the streaming
        # detokenizer needs them because such runs decode as one group.
        self.byte_fallback_ids: frozenset[int] | None = None
        if getattr(backend.model, "byte_fallback", False):
            self.byte_fallback_ids = frozenset(
                i for t, i in vocab.items() if len(t) == 6 and t.startswith("<0x") and t.endswith(">")
            )
        for name, template in chat_templates.items():  # untrusted code: refused now, not at a request
            try:
                probe_chat_template(template, **self.special_tokens)
            except ChatTemplateError as exc:
                raise TokenizerError(f"the chat template {name!r} of {source} is refused: {exc}") from None

    # ----- loading ------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        path = Path(model_dir)
        if not path.is_dir():
            raise ModelNotFoundError(f"model path {str(path)!r} does not exist or is not a directory")
        file = model_file(path, TOKENIZER_FILE)
        if not file.is_file():
            extra = (
                " (only a SentencePiece tokenizer.model is present)"
                if (path / "tokenizer.model").is_file()
                else ""
            )
            raise TokenizerError(
                f"{file} is missing{extra}: forwardpass needs a fast tokenizer; write it with "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # includes pyo3 panics
            raise TokenizerError(
                f"{file} could not be loaded by the tokenizers library ({exc}); re-save the tokenizer with "
                "save_pretrained (or upgrade `tokenizers` if the file is from a newer version)"
            ) from exc
        config_file = model_file(path, TOKENIZER_CONFIG_FILE)
        config = _read_json(config_file) if config_file.is_file() else {}
        legacy_map = model_file(path, "special_tokens_map.json")
        if "added_tokens_decoder" not in config and legacy_map.is_file():  # older repos, as HF reads them
            for key, value in _read_json(legacy_map).items():
                config.setdefault(key, value)
        return cls(backend, config, _load_chat_templates(path, config), path)

    def _add_missing_tokens(self, config: dict, specials: list[AddedToken]) -> None:
        """Register tokens the config names but tokenizer.json lacks as added tokens, like HF does."""
        have = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        decoder = config.get("added_tokens_decoder") or {}
        for _, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            if isinstance(entry, dict) and entry.get("content") not in have:
                tok = AddedToken(
                    entry["content"],
                    special=entry.get("special", False),
                    single_word=entry.get("single_word", False),
                    lstrip=entry.get("lstrip", False),
                    rstrip=entry.get("rstrip", False),
                    normalized=entry.get("normalized", not entry.get("special", False)),
                )
                (self.backend.add_special_tokens if tok.special else self.backend.add_tokens)([tok])
                have.add(tok.content)
        new = [t for t in specials if t.content not in have]
        if new:
            self.backend.add_special_tokens(new)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # ----- text <-> ids -------------------------------------------------------------------------
    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token's string holds (bounds how much text a token can cover)."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > 16384:  # the batch call releases the GIL: a long text does not stall other threads
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode_raw(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Decode without transformers' space cleanup (what the streaming detokenizer builds on)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def clean_up_spaces(self, text: str) -> str:
        return _clean_up_tokenization(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.decode_raw(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.cleans_up_spaces else text

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ----- chat ---------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's chat template (sandboxed jinja2, as transformers renders it).

        ``template_kwargs`` become template variables (``tools``, ``enable_thinking``, ...); special
        token strings (``bos_token``, ``eos_token``, ...) are available as in HF.
        """
        template = self.chat_template
        if template_kwargs.get("tools") and "tool_use" in self.chat_templates:
            template = self.chat_templates["tool_use"]
        if template is None:
            names = (
                f" (named templates: {', '.join(sorted(self.chat_templates))})" if self.chat_templates else ""
            )
            raise ChatTemplateError(
                f"the model in {self.source} has no chat_template{names}; use generate() with a raw prompt "
                "instead of chat, or add a chat_template to tokenizer_config.json"
            )
        variables = {**self.special_tokens, **template_kwargs}
        return render_chat_template(
            template, messages, add_generation_prompt=add_generation_prompt, **variables
        )
