"""Speculative decoding inside the engine: drafts proposed by the scheduler, verified by the runner.

``ngram.py`` proposes (prompt lookup), ``policy.py`` decides per request and step whether proposing pays,
``verify.py`` is the runner's acceptance rule, ``rollback.py`` refuses caches that cannot give back what
rejected drafts held, and ``stats.py`` counts engine-wide. It plugs into the scheduler and the runner
through the interfaces they declare (``scheduling/speculation.py``, ``worker/sample_step.py``,
``worker/plugins.py``), and imports them; they import nothing of it. ``engine/builder.py`` wires it in.
See docs/speculative.md.
"""
