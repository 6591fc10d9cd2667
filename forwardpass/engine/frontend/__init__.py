"""The front end: LLMEngine and AsyncLLMEngine, the loop that drives EngineCore in its own thread or
process, the transports between them, protocol messages, and the output processor that turns token
deltas into outputs."""
