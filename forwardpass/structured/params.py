"""``StructuredOutputsParams``: the constraint a request's output must satisfy (vLLM's field of that name).

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``json_object`` (any JSON
object), ``regex``, ``choice`` (one of a list of strings), ``grammar`` (EBNF, xgrammar's GBNF dialect)
or ``structural_tag`` (xgrammar's structural tag JSON). The constraint is checked when the object is
made: a schema, regex or grammar that xgrammar cannot turn into a grammar raises a
``SamplingParamsError`` naming the field and what is wrong (the server's 400). The object is plain
data (picklable, comparable), so it crosses to the engine process inside ``SamplingParams``; the
engine compiles it against the tokenizer once per distinct constraint (``backend.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from forwardpass.errors import SamplingParamsError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
#: Longest schema / regex / grammar text accepted (the server's body limit is the outer bound).
MAX_SPEC_CHARS = 1 << 20
MAX_CHOICES = 4096
#: Whitespace characters allowed between two JSON tokens. Unbounded (xgrammar's default), a weak model
#: fills every gap with newlines and never finishes: on the embedded model, 9 of 9 outputs of three
#: schemas completed within 400 tokens with 4, 7 of 9 with 8, none within 300 with 16. Four allows one
#: newline plus indentation of most pretty-printed JSON; ``disable_any_whitespace`` allows none.
MAX_WHITESPACE = 4


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    #: compact JSON (no free whitespace between tokens), vLLM's ``disable_any_whitespace``
    disable_any_whitespace: bool = False
    #: with a reasoning parser: the token ids that end reasoning (``</think>``); the constraint applies to
    #: what follows them (the reasoning before is free)
    reasoning_end: tuple[int, ...] | None = None
    #: set by the engine: the canonical (kind, text) used as the compile-cache key
    key: tuple[str, str] = field(default=("", ""), init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(given) != 1:
            raise SamplingParamsError(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}",
                param="structured_outputs",
            )
        kind = given[0]
        text = _canonical(kind, getattr(self, kind))
        if len(text) > MAX_SPEC_CHARS:
            raise SamplingParamsError(
                f"structured_outputs.{kind} is {len(text)} characters; at most {MAX_SPEC_CHARS}",
                param=f"structured_outputs.{kind}",
            )
        self.key = (kind, text)
        check_grammar(self)

    @property
    def kind(self) -> str:
        return self.key[0]


def _canonical(kind: str, value: Any) -> str:
    """The text xgrammar compiles for this constraint (and the cache key)."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise SamplingParamsError(
                    f"structured_outputs.json is not valid JSON: {exc}", param="structured_outputs.json"
                ) from None
        if not isinstance(value, (dict, bool)):
            raise SamplingParamsError(
                f"structured_outputs.json must be a JSON schema (an object), got {type(value).__name__}",
                param="structured_outputs.json",
            )
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    if kind == "json_object":
        if value is not True:
            raise SamplingParamsError("structured_outputs.json_object must be true",
                                      param="structured_outputs")
        return '{"type": "object"}'  # OpenAI's json_object: any JSON object
    if kind == "choice":
        if (not isinstance(value, (list, tuple)) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise SamplingParamsError(
                f"structured_outputs.choice must be a list of 1..{MAX_CHOICES} non-empty strings, got "
                f"{value!r:.200}", param="structured_outputs.choice",
            )
        # EBNF string literals take JSON's escapes
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
    if not isinstance(value, str) or not value:
        raise SamplingParamsError(
            f"structured_outputs.{kind} must be a non-empty string, got {value!r:.200}",
            param=f"structured_outputs.{kind}",
        )
    return value


def json_whitespace(p: StructuredOutputsParams) -> dict[str, Any]:
    """Whitespace JSON may have between tokens: compact with ``disable_any_whitespace``, else at most
    ``MAX_WHITESPACE`` characters per gap (unbounded whitespace lets a weak model loop on newlines)."""
    if p.disable_any_whitespace:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}


def check_grammar(p: StructuredOutputsParams) -> None:
    """Parse the constraint with xgrammar (no tokenizer needed): a 400 that says what is wrong."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise SamplingParamsError("structured output needs xgrammar: pip install 'forwardpass[structured]'",
                                  param="structured_outputs") from None
    kind, text = p.key
    try:
        if kind in ("json", "json_object"):
            xgr.Grammar.from_json_schema(text, **json_whitespace(p))
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind in ("grammar", "choice"):
            xgr.Grammar.from_ebnf(text)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(text)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own types
        what = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar",
                "choice": "choice list", "structural_tag": "structural tag"}[kind]
        msg = str(exc).strip().splitlines()
        raise SamplingParamsError(
            f"structured_outputs.{kind}: unsupported or invalid {what}: {' '.join(msg)[:500]}",
            param=f"structured_outputs.{kind}",
        ) from None
