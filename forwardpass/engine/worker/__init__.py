"""The worker side: the model runner (one forward pass per step), the step's sampling (``sample_step.py``;
rows with drafts go to the ``DraftVerifier`` it is handed), fault isolation, prompt logprobs, the encoder
step of encoder-decoder models, and MoE routing statistics read off the model. It imports nothing from
``speculative/``."""
