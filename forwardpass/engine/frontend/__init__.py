"""The front end: LLMEngine and AsyncLLMEngine, the loop that drives EngineCore in its own thread or
process, the transports between them, protocol messages, the output processor that turns token
deltas into outputs, and ``launch.py``, which builds the engine core with the executor its config asks
for (one rank here, or the tensor-parallel ranks first)."""
