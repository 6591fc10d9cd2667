"""The worker side: the model runner (one forward pass per step), fault isolation, prompt logprobs, the
encoder step of encoder-decoder models, and MoE routing statistics read off the model."""
