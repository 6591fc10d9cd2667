"""Video DiT and VideoPipeline: oracles for the network, shapes, seeds, CFG call counts, export and CLI."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from forwardpass.diffusion.dit import DiTTransformer2DModel
from forwardpass.diffusion.video import DEFAULT_VIDEO_MODEL_DIR
from forwardpass.diffusion.video.dit import VideoDiTModel
from forwardpass.errors import ValidationError

SMALL = {"hidden_size": 32, "num_layers": 2, "num_attention_heads": 2, "cross_attention_dim": 16}


def _randomise(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # the zero-initialised adaLN / output layers too, or the test is vacuous
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize("mode", ["full", "factorized"])
@pytest.mark.parametrize("pt", [1, 2])
def test_inflated_image_dit_is_the_image_dit_on_a_still_clip(mode, pt):
    """Oracle: a clip of identical frames through the inflated video DiT = the image DiT on one frame (full
    attention over duplicated keys is attention over one copy; fresh temporal layers are zero)."""
    image = DiTTransformer2DModel(**SMALL).eval()
    _randomise(image)
    video = VideoDiTModel.from_image_dit(image, attention_mode=mode, patch_size_t=pt).eval()
    x, t, ctx = torch.randn(2, 4, 8, 8), torch.tensor([250.0, 900.0]), torch.randn(2, 3, 16)
    want = image(x, t, ctx)
    clip = x[:, None].expand(2, 2 * pt, 4, 8, 8).contiguous()
    got = video(clip, t, ctx)
    assert got.shape == clip.shape
    torch.testing.assert_close(got, want[:, None].expand_as(got), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["full", "factorized"])
def test_video_dit_backends_agree_with_the_naive_reference(mode):
    model = VideoDiTModel(**SMALL, attention_mode=mode, attention_backend="naive").eval()
    _randomise(model, 1)
    x, t, ctx = torch.randn(2, 4, 4, 8, 8), torch.rand(2, 4) * 1000, torch.randn(2, 5, 16)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    ref = model(x, t, ctx, mask)
    for module in model.modules():
        if hasattr(module, "backend"):
            module.backend = "sdpa"
    torch.testing.assert_close(model(x, t, ctx, mask), ref, atol=1e-5, rtol=1e-5)


def test_full_attention_mixes_frames_and_factorized_is_per_position_in_time():
    """A change in frame 0 reaches frame 3 in both layouts; in factorized, through the
    temporal attention only."""
    for mode in ("full", "factorized"):
        model = VideoDiTModel(**SMALL, attention_mode=mode).eval()
        _randomise(model, 2)
        x, t, ctx = torch.randn(1, 4, 4, 8, 8), torch.tensor([500.0]), torch.randn(1, 2, 16)
        y = x.clone()
        y[:, 0] += 1.0
        assert (model(x, t, ctx) - model(y, t, ctx))[:, 3].abs().max() > 1e-4


def test_with_attention_mode_keeps_the_shared_weights():
    """factorized → full (issue 43's fine-tune start): every weight but the temporal attention carries over.
    Oracle: on a one-frame clip full attention is the spatial attention, so a factorized model whose temporal
    output is zero (as inflated) gives the same output after conversion. And the full model knows each
    token's frame: reversing the frames of the input does not just reverse the output."""
    model = VideoDiTModel(**SMALL, attention_mode="factorized").eval()
    _randomise(model, 3)
    for block in model.blocks:
        torch.nn.init.zeros_(block.attn_temporal.to_out.weight)
        torch.nn.init.zeros_(block.attn_temporal.to_out.bias)
    full, mapping = model.with_attention_mode("full")
    assert full.config["attention_mode"] == "full" and not full.training and not mapping["new"]
    assert {n.split(".")[2] for n in mapping["dropped"]} == {"attn_temporal", "norm_temporal"}
    assert all(torch.equal(full.state_dict()[k], model.state_dict()[k]) for k in mapping["kept"])
    x, t, ctx = torch.randn(2, 1, 4, 8, 8), torch.tensor([250.0, 900.0]), torch.randn(2, 3, 16)
    torch.testing.assert_close(full(x, t, ctx), model(x, t, ctx), atol=1e-5, rtol=1e-5)
    clip = torch.randn(1, 4, 4, 8, 8)
    out, out_rev = full(clip, t[:1], ctx[:1]), full(clip.flip(1), t[:1], ctx[:1])
    assert (out_rev.flip(1) - out).abs().max() > 1e-3
    back, mapping_back = full.with_attention_mode("factorized")  # the temporal layers return as the identity
    assert sorted(mapping_back["new"]) == sorted(mapping["dropped"])
    torch.testing.assert_close(back(clip, t[:1], ctx[:1]), model(clip, t[:1], ctx[:1]), atol=1e-5, rtol=1e-5)


def test_patchify_roundtrip_and_per_frame_timesteps():
    model = VideoDiTModel(**SMALL, patch_size_t=2)
    x = torch.randn(2, 4, 4, 8, 8)
    assert model.patchify(x).shape == (2, 2 * 16, 4 * 2 * 2 * 2)
    torch.testing.assert_close(model.unpatchify(model.patchify(x), 4, 8, 8), x)
    with pytest.raises(ValidationError, match="agree within"):
        model(x, torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 2), torch.randn(2, 2, 16))


@pytest.fixture(scope="module")
def pipe():
    from forwardpass.diffusion.video.pipeline import VideoPipeline

    torch.set_num_threads(1)
    return VideoPipeline.from_pretrained(DEFAULT_VIDEO_MODEL_DIR)


def test_shapes_and_output_types(pipe):
    np_out = pipe(["a handwritten 3 moving left", "seven moving up"], num_frames=8, num_inference_steps=2,
                  seed=0,
                  output_type="np", show_progress=False).frames  # fmt: skip
    assert np_out.shape == (2, 8, 32, 32, 1) and 0 <= np_out.min() and np_out.max() <= 1
    pil = pipe("two moving down", num_frames=4, num_inference_steps=1, seed=0, num_videos_per_prompt=2,
               show_progress=False).frames  # fmt: skip
    assert len(pil) == 2 and len(pil[0]) == 4 and pil[0][0].size == (32, 32)
    lat = pipe("two", num_inference_steps=1, seed=0, output_type="latent", show_progress=False).frames
    assert lat.shape == (1, 8, 4, 8, 8)


def test_seeds_are_reproducible(pipe):
    def run(seed, framewise=False):
        return pipe("a handwritten 5 moving right", num_frames=4, num_inference_steps=2, seed=seed,
                    output_type="np",
                    framewise=framewise, show_progress=False).frames  # fmt: skip

    np.testing.assert_array_equal(run(7), run(7))
    np.testing.assert_array_equal(run(7, True), run(7, True))
    assert np.abs(run(7) - run(8)).max() > 1e-3


class CountingTransformer(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, []
        self.config = inner.config

    def forward(self, x, t, *args):
        self.calls.append((x.shape[0], tuple(t.shape)))
        return self.inner(x, t, *args)


@pytest.mark.parametrize(
    ("guidance", "negative", "framewise", "passes", "batch"),
    [
        (3.0, None, False, 3, 2),
        (3.0, "8", False, 3, 2),
        (1.0, None, False, 3, 1),
        (3.0, None, True, 4 * 3, 2),
    ],
)
def test_cfg_call_count(pipe, guidance, negative, framewise, passes, batch):
    """CFG: one denoiser call per step on a 2× batch [negative | prompt] (frame by frame:
    one per frame per step)."""
    counting = CountingTransformer(pipe.transformer)
    inner, pipe.transformer = pipe.transformer, counting
    try:
        pipe("a handwritten 3 moving left", negative_prompt=negative, num_frames=4, num_inference_steps=3,
             guidance_scale=guidance, framewise=framewise, seed=0, show_progress=False)  # fmt: skip
    finally:
        pipe.transformer = inner
    assert len(counting.calls) == passes
    assert all(b == batch for b, _ in counting.calls)
    if framewise:  # per-frame timesteps: [B, F]
        assert all(shape == (batch, 4) for _, shape in counting.calls)


def test_callback_sees_every_step_and_can_stop(pipe):
    seen = []

    class Stop(Exception):
        pass

    def cb(_pipe, i, _t, state):
        seen.append((i, tuple(state["latents"].shape)))
        if i == 2:
            raise Stop

    with pytest.raises(Stop):
        pipe(
            "three moving up",
            num_frames=4,
            num_inference_steps=5,
            callback_on_step_end=cb,
            show_progress=False,
        )
    assert seen == [(i, (1, 4, 4, 8, 8)) for i in range(3)]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"num_frames": 0}, "num_frames"), ({"num_frames": 17}, "num_frames"), ({"num_inference_steps": 0},
     "num_inference_steps"), ({"height": 64, "width": 64}, "size"), ({"output_type": "gif"}, "output_type")],
)  # fmt: skip
def test_validation_names_the_parameter(pipe, kwargs, param):
    with pytest.raises(ValidationError) as err:
        pipe("three", **kwargs)
    assert err.value.param == param


def test_framewise_needs_a_flow_scheduler(pipe):
    from forwardpass.diffusion.video.pipeline import VideoPipeline

    other = VideoPipeline.from_pretrained(DEFAULT_VIDEO_MODEL_DIR, scheduler="ddim")
    assert (
        other(
            "three", num_frames=2, num_inference_steps=2, output_type="np", show_progress=False
        ).frames.shape[1]
        == 2
    )
    with pytest.raises(ValidationError, match="FlowMatch"):
        other("three", framewise=True)


def test_image_folder_is_refused_with_a_hint():
    from forwardpass.diffusion import DEFAULT_MODEL_DIR
    from forwardpass.diffusion.video.pipeline import VideoPipeline
    from forwardpass.errors import ConfigError

    with pytest.raises(ConfigError, match="ImagePipeline"):
        VideoPipeline.from_pretrained(DEFAULT_MODEL_DIR)


def test_gif_export_and_mp4_error(pipe, tmp_path, monkeypatch):
    from PIL import Image

    from forwardpass.diffusion.video.export import encode_video, export_to_video

    frames = pipe("six moving left", num_frames=4, num_inference_steps=1, seed=0, show_progress=False).frames[
        0
    ]
    path = export_to_video(frames, tmp_path / "clip.gif", scale=2)
    gif = Image.open(path)
    assert gif.n_frames == 4 and gif.size == (64, 64)
    with pytest.raises(ValidationError, match=".gif or .mp4"):
        export_to_video(frames, tmp_path / "clip.avi")
    import sys

    monkeypatch.setitem(sys.modules, "av", None)  # as if PyAV were not installed
    with pytest.raises(ValidationError, match="pip install av"):
        encode_video(frames, "mp4")
    assert io.BytesIO(encode_video(frames, "gif")).getvalue()[:6] == b"GIF89a"


def test_cli_video_writes_a_gif_and_pngs(tmp_path, capsys):
    from PIL import Image

    from forwardpass.cli import main

    out = tmp_path / "clip.gif"
    rc = main(["video", "a handwritten 3 moving left", "-o", str(out), "--frames", "8", "--steps", "2",
               "--seed", "1", "--frames-dir", str(tmp_path / "f"), "--no-progress"])  # fmt: skip
    assert rc == 0 and "8 frames, whole clip" in capsys.readouterr().out
    assert Image.open(out).n_frames == 8 and len(list((tmp_path / "f").glob("*.png"))) == 8
    assert main(["video", "three", "-o", str(tmp_path / "x.webm")]) == 1
    assert ".gif or .mp4" in capsys.readouterr().err
