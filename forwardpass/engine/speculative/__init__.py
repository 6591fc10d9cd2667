"""Speculative decoding inside the engine: drafts proposed by the scheduler, verified by the runner.

``ngram.py`` proposes (prompt lookup), ``policy.py`` decides per request and step whether proposing pays,
``verify.py`` is the runner's acceptance rule, ``rollback.py`` gives back what rejected drafts held, and
``stats.py`` counts per request. See docs/speculative.md.
"""
