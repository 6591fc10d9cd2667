import os

import pytest

# Tests run on 2 cores next to other work; keep torch from oversubscribing them.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """Session-cached tiny random checkpoints: ``checkpoint_factory("qwen3", **overrides) -> Path``."""
    from tests.helpers.checkpoints import make_checkpoint

    cache = {}

    def make(variant: str = "qwen3", **overrides):
        key = (variant, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            cache[key] = make_checkpoint(tmp_path_factory.mktemp(variant), variant, **overrides)
        return cache[key]

    return make
