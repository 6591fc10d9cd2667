"""vLLM's own OpenAI-server tests run against forwardpass serve (run.py)."""
