"""Unit checks of the diffusion building blocks: DiT patching and adaLN-Zero, text-encoder padding, VAE
shapes, config/weight round trips."""

from __future__ import annotations

import pytest
import torch

from forwardpass.diffusion.dit import DiTTransformer2DModel
from forwardpass.diffusion.text_encoder import PromptTokenizer, TinyTextEncoder, build_word_tokenizer
from forwardpass.diffusion.vae import TinyAutoencoderKL
from forwardpass.errors import ConfigError


def small_dit(**kw):
    return DiTTransformer2DModel(
        hidden_size=32, num_layers=2, num_attention_heads=2, cross_attention_dim=16, **kw
    )


def test_patchify_roundtrip_and_token_count():
    dit = small_dit()
    x = torch.randn(2, 4, 8, 12)
    tokens = dit.patchify(x)
    assert tokens.shape == (2, (8 // 2) * (12 // 2), 4 * 2 * 2)
    dit.config["out_channels"] = 4
    torch.testing.assert_close(dit.unpatchify(tokens, 8, 12), x)


def test_adaln_zero_starts_as_zero_output():
    """Zero-initialised modulation and output layers: the untrained DiT predicts exactly 0."""
    dit = small_dit()
    out = dit(torch.randn(2, 4, 8, 8), torch.tensor([10.0, 900.0]), torch.randn(2, 3, 16))
    assert out.shape == (2, 4, 8, 8) and torch.count_nonzero(out) == 0


def test_dit_uses_text_and_timestep():
    torch.manual_seed(0)
    dit = small_dit()
    with torch.no_grad():
        for p in dit.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x, ctx = torch.randn(1, 4, 8, 8), torch.randn(1, 3, 16)
    a = dit(x, torch.tensor([500.0]), ctx)
    assert not torch.allclose(a, dit(x, torch.tensor([100.0]), ctx))
    assert not torch.allclose(a, dit(x, torch.tensor([500.0]), torch.randn(1, 3, 16)))


def test_text_encoder_ignores_padding():
    tok = PromptTokenizer(build_word_tokenizer(["a", "handwritten", "seven", "thin", "7"]), max_length=8)
    torch.manual_seed(0)
    te = TinyTextEncoder(
        vocab_size=16, hidden_size=32, num_attention_heads=4, max_position_embeddings=8
    ).eval()
    ids, mask = tok(["seven", "a thin handwritten 7"])
    assert ids[0, 0] == 2 and mask.tolist()[0] == [True, True, False, False, False]  # [CLS] seven + padding
    alone_ids, alone_mask = tok(["seven"])
    with torch.no_grad():
        batched = te(ids, mask)[0, :2]
        alone = te(alone_ids, alone_mask)[0]
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)


def test_vae_shapes_and_scaling():
    vae = TinyAutoencoderKL(block_out_channels=[8, 8, 8], scaling_factor=0.5, shift_factor=0.1).eval()
    assert vae.downsample_factor == 4
    x = torch.rand(2, 1, 32, 32) * 2 - 1
    post = vae.encode(x)
    assert post.mean.shape == (2, 4, 8, 8) and post.kl().shape == (2,)
    z = post.mode()
    with torch.no_grad():
        torch.testing.assert_close(vae.decode(vae.scale_latents(z)), vae.decoder(z), atol=1e-5, rtol=1e-5)


def test_config_rejects_unknown_keys_and_ignores_private():
    with pytest.raises(ConfigError, match="num_blocks"):
        DiTTransformer2DModel(num_blocks=3)
    assert small_dit(_class_name="DiTTransformer2DModel").config["hidden_size"] == 32


def test_save_load_roundtrip_fp16(tmp_path):
    dit = small_dit()
    with torch.no_grad():
        for p in dit.parameters():
            p.add_(torch.randn_like(p))
    dit.save_pretrained(tmp_path / "t", half=True)
    back = DiTTransformer2DModel.from_pretrained(tmp_path / "t")
    for (name, a), b in zip(dit.state_dict().items(), back.state_dict().values()):
        assert b.dtype == torch.float32, name
        torch.testing.assert_close(a.half().float(), b)
