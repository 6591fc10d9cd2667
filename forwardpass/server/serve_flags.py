"""``serve`` flags that vLLM's server has and ours follows, and the ``ServerConfig`` settings they make
(checked here, so a bad value is a one-line start-up error naming the flag)."""

from __future__ import annotations

import argparse
import re
from typing import Any

from forwardpass.errors import ValidationError
from forwardpass.server.config import MAX_LOGPROBS

#: a URL path prefix: "/" and segments of URL-safe characters, no trailing slash
_ROOT_PATH = re.compile(r"^(/[A-Za-z0-9._~-]+){1,16}$")


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root-path", default="", metavar="/PREFIX",
                   help="the routes also answer under this prefix (a proxy that forwards /PREFIX/v1/... "
                   "unchanged), as vLLM's --root-path")  # fmt: skip
    p.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, metavar="K",
                   help=f"most top logprobs a request may ask for (logprobs, top_logprobs, prompt_logprobs; "
                   f"default {MAX_LOGPROBS}); -1: the whole vocabulary, and a request's -1 means that")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="usage on every streamed chunk, whatever stream_options says (vLLM's)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprob tokens as 'token_id:N' unless a request says otherwise (vLLM's)")


def vllm_flag_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``ServerConfig`` keyword arguments from the flags above."""
    root = args.root_path.rstrip("/") if args.root_path != "/" else ""
    if root and not _ROOT_PATH.match(root):
        raise ValidationError(f"--root-path must be a URL path such as /llm (segments of letters, digits, "
                              f"'.', '_', '~', '-'), got {args.root_path!r}", param="--root-path")
    if args.max_logprobs < -1:
        raise ValidationError(f"--max-logprobs must be -1 (the whole vocabulary) or >= 0, got "
                              f"{args.max_logprobs}", param="--max-logprobs")
    return {"root_path": root, "max_logprobs": args.max_logprobs,
            "force_include_usage": args.enable_force_include_usage,
            "return_tokens_as_token_ids": args.return_tokens_as_token_ids}
