"""``forwardpass explain``: one real request, shown step by step with the engine's own numbers.

:func:`explain` runs the request through the engine (``LLMEngine``) and keeps what the engine reports:
the drawn tokens and each step's ``StepRecord`` (tokens computed, time, FLOPs, bytes, KV blocks).
The views the engine does not compute — hidden-state norm per layer, one head's attention weights,
the sampling funnel, MoE routing per token — are computed *outside* the engine by calling the model's
own modules on the request's tokens (:mod:`forwardpass.explain.views`, :mod:`forwardpass.explain.funnel`)
and checked against the engine's run: the funnel re-draws every token with the request's seed and
must get the engine's token.
"""

from forwardpass.explain.trace import explain

__all__ = ["explain"]
