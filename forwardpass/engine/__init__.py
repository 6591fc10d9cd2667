"""The serving engine: sequences, the paged KV cache, the scheduler, the model runner and the step loop."""
