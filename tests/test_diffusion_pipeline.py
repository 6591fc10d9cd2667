"""ImagePipeline on tiny random-weight checkpoints the tests write: CFG semantics, denoiser call counting,
scheduler ↔ model coordinate conversion, bad input, and from_pretrained errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from forwardpass.diffusion.dit import DiTTransformer2DModel
from forwardpass.diffusion.loading import save_scheduler
from forwardpass.diffusion.pipeline import ImagePipeline
from forwardpass.diffusion.schedulers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, LCMScheduler
from forwardpass.diffusion.text_encoder import TinyTextEncoder, build_word_tokenizer
from forwardpass.diffusion.vae import TinyAutoencoderKL
from forwardpass.errors import (
    ConfigError,
    MissingFileError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
    ValidationError,
    WeightShapeError,
)

WORDS = ["a", "the", "handwritten", "digit", "number", "seven", "three", "thin", "3", "7"]


def write_tiny_pipeline(root, *, student: bool = True):
    torch.manual_seed(0)
    tok = build_word_tokenizer(WORDS)
    (root / "tokenizer").mkdir(parents=True)
    tok.save(str(root / "tokenizer" / "tokenizer.json"))
    TinyTextEncoder(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=1,
                    num_attention_heads=2,
                    max_position_embeddings=8).save_pretrained(root / "text_encoder")  # fmt: skip
    for name in ["transformer", "student_transformer"] if student else ["transformer"]:
        dit = DiTTransformer2DModel(
            hidden_size=32, num_layers=2, num_attention_heads=2, cross_attention_dim=32
        )
        with (
            torch.no_grad()
        ):  # adaLN-Zero starts as the identity; give every weight a value so tests see it work
            for p in dit.parameters():
                p.add_(0.2 * torch.randn_like(p))
        dit.save_pretrained(root / name)
    TinyAutoencoderKL(block_out_channels=[8, 8, 8]).save_pretrained(root / "vae")
    save_scheduler(FlowMatchEulerDiscreteScheduler(shift=1.0), root / "scheduler")
    index = {
        "_class_name": "ImagePipeline",
        "text_encoder": ["forwardpass", "TinyTextEncoder"],
        "tokenizer": ["forwardpass", "PromptTokenizer"],
        "transformer": ["forwardpass", "DiTTransformer2DModel"],
        "vae": ["forwardpass", "TinyAutoencoderKL"],
        "scheduler": ["forwardpass", "FlowMatchEulerDiscreteScheduler"],
        "forwardpass_defaults": {"num_inference_steps": 4, "guidance_scale": 3.0},
    }
    if student:
        save_scheduler(LCMScheduler(prediction_type="sample"), root / "student_scheduler")
        index["student_transformer"] = ["forwardpass", "DiTTransformer2DModel"]
        index["student_scheduler"] = ["forwardpass", "LCMScheduler"]
        index["forwardpass_few_step_defaults"] = {"num_inference_steps": 2, "guidance_scale": 1.0}
    (root / "model_index.json").write_text(json.dumps(index))
    return root


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny; on a shared 2-core machine one thread is many times faster than two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_pipeline(tmp_path_factory.mktemp("tiny_pipe"))


@pytest.fixture
def pipe(tiny_dir):
    p = ImagePipeline.from_pretrained(tiny_dir)
    p.set_progress_bar_config(disable=True)
    return p


def count_calls(pipe):
    """Wrap the denoiser's forward; return the list that collects each call's batch size."""
    calls: list[int] = []
    inner = pipe.transformer.forward

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return inner(x, *args, **kwargs)

    pipe.transformer.forward = counted
    return calls


def manual_loop(pipe, prompts, negatives, guidance, steps, seed, separate: bool):
    """Reference denoising loop written out by hand: conditional only, or CFG with two separate passes."""
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn((len(prompts), 4, 8, 8), generator=g)
    cond, cmask = pipe.encode_prompt(prompts)
    uncond, umask = pipe.encode_prompt(negatives)
    pipe.scheduler.set_timesteps(steps)
    for t in pipe.scheduler.timesteps:
        tt = t.reshape(1).expand(len(prompts))
        c = pipe.transformer(latents, tt, cond, cmask)
        if separate:
            u = pipe.transformer(latents, tt, uncond, umask)
            c = u + guidance * (c - u)
        latents = pipe.scheduler.step(c, t, latents).prev_sample
    return latents


# ----------------------------------------------------------------------- CFG
def test_guidance_one_equals_conditional_pass(pipe):
    calls = count_calls(pipe)
    out = pipe(
        ["a thin 7", "the digit 3"], guidance_scale=1.0, num_inference_steps=3, seed=5, output_type="latent"
    )
    assert calls == [2, 2, 2]  # no unconditional half at all
    ref = manual_loop(pipe, ["a thin 7", "the digit 3"], ["", ""], 1.0, 3, 5, separate=False)
    torch.testing.assert_close(out.images, ref, atol=1e-5, rtol=1e-5)


def test_cfg_batched_equals_two_separate_passes(pipe):
    prompts, negs = ["a thin 7", "the digit 3"], ["3", "seven"]
    out = pipe(
        prompts, negative_prompt=negs, guidance_scale=4.0, num_inference_steps=3, seed=1, output_type="latent"
    )
    ref = manual_loop(pipe, prompts, negs, 4.0, 3, 1, separate=True)
    torch.testing.assert_close(out.images, ref, atol=1e-5, rtol=1e-5)


def test_cfg_formula_at_scale_one_is_conditional(pipe):
    # uncond + 1·(cond − uncond) == cond: a CFG run at scale 1 (two passes) equals the conditional run.
    a = manual_loop(pipe, ["seven"], [""], 1.0, 3, 2, separate=True)
    b = manual_loop(pipe, ["seven"], [""], 1.0, 3, 2, separate=False)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("guidance,expected_batch", [(3.0, 12), (1.0, 6), (0.0, 6)])
def test_denoiser_calls_and_batch_sizes(pipe, guidance, expected_batch):
    calls = count_calls(pipe)
    out = pipe(["seven", "3"], num_images_per_prompt=3, guidance_scale=guidance, num_inference_steps=5,
               seed=0,
               output_type="np")  # fmt: skip
    assert calls == [expected_batch] * 5  # one call per step: 2·B with CFG, B without
    assert out.images.shape == (6, 32, 32, 1)
    assert 0.0 <= out.images.min() and out.images.max() <= 1.0


def test_student_runs_without_cfg(tiny_dir):
    p = ImagePipeline.from_pretrained(tiny_dir, few_step=True)
    calls = count_calls(p)
    out = p("seven", seed=0, output_type="np", show_progress=False)
    assert calls == [1, 1] and isinstance(p.scheduler, LCMScheduler)
    assert out.images.shape == (1, 32, 32, 1)


# ------------------------------------------------------------ determinism, outputs, callbacks
def test_seed_determinism_and_generator(pipe):
    a = pipe("seven", seed=3, output_type="np").images
    b = pipe("seven", seed=3, output_type="np").images
    c = pipe("seven", generator=torch.Generator().manual_seed(3), output_type="np").images
    d = pipe("seven", seed=4, output_type="np").images
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    assert not np.array_equal(a, d)


def test_output_types_and_callback(pipe):
    seen = []

    def cb(p, i, t, tensors):
        seen.append(i)
        return {"latents": tensors["latents"]}

    pil = pipe("seven", seed=0, num_inference_steps=3, callback_on_step_end=cb).images
    assert seen == [0, 1, 2] and pil[0].size == (32, 32) and pil[0].mode == "L"
    assert pipe("seven", seed=0, output_type="latent").images.shape == (1, 4, 8, 8)
    assert pipe("seven", seed=0, output_type="pt").images.shape == (1, 1, 32, 32)
    assert pipe("seven", seed=0, height=48, width=16, output_type="np").images.shape == (1, 48, 16, 1)


def test_attention_backends_agree(tiny_dir):
    a = ImagePipeline.from_pretrained(tiny_dir)
    b = ImagePipeline.from_pretrained(tiny_dir, attention_backend="naive")
    x = a(["seven", "a thin 3"], seed=0, output_type="latent", show_progress=False).images
    y = b(["seven", "a thin 3"], seed=0, output_type="latent", show_progress=False).images
    torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------ scheduler coordinate conversion
class PointMassDenoiser(nn.Module):
    """Exact flow velocity for data that is always the constant c: v = (x_σ − c)/σ."""

    def __init__(self, c: torch.Tensor):
        super().__init__()
        self.c = c
        self.config = {"patch_size": 2, "in_channels": 4}

    def forward(self, x, t, context, mask=None):
        return (x - self.c) / (t / 1000).view(-1, 1, 1, 1)


@pytest.mark.parametrize("sched", [
    FlowMatchEulerDiscreteScheduler(), FlowMatchEulerDiscreteScheduler(shift=3.0),
    DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False),
    DDIMScheduler(clip_sample=False, prediction_type="v_prediction"),
    LCMScheduler(), LCMScheduler(prediction_type="sample"),
])  # fmt: skip
def test_every_scheduler_drives_a_flow_model(pipe, sched):
    """With the exact velocity of a point mass, every scheduler must land on it: the VP ↔
    flow mapping is right."""
    c = torch.linspace(-1, 1, 4 * 8 * 8).view(1, 4, 8, 8)
    pipe.transformer = PointMassDenoiser(c)
    pipe.scheduler = sched
    out = pipe("seven", seed=0, num_inference_steps=4, guidance_scale=1.0, output_type="latent").images
    torch.testing.assert_close(out, c, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    ({"height": 30}, "multiple of 8"),
    ({"width": 20}, "multiple of 8"),
    ({"height": 0}, "multiple of 8"),
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"num_inference_steps": -3}, "num_inference_steps"),
    ({"num_inference_steps": 2.5}, "num_inference_steps"),
    ({"guidance_scale": -1.0}, "guidance_scale"),
    ({"num_images_per_prompt": 0}, "num_images_per_prompt"),
    ({"output_type": "jpeg"}, "output_type"),
    ({"seed": 1, "generator": torch.Generator()}, "either generator or seed"),
    ({"negative_prompt": ["a", "b"]}, "negative_prompt"),
])  # fmt: skip
def test_bad_input_is_a_clear_error(pipe, kwargs, match):
    with pytest.raises(ValidationError, match=match):
        pipe("seven", **kwargs)


@pytest.mark.parametrize("prompt", ["", "   ", ["seven", ""], []])
def test_empty_prompt_rejected(pipe, prompt):
    with pytest.raises(ValidationError, match="prompt"):
        pipe(prompt)


def test_unknown_scheduler_name(pipe, tiny_dir):
    with pytest.raises(ConfigError, match="unknown scheduler"):
        pipe.set_scheduler("KarrasVeScheduler")
    with pytest.raises(ConfigError, match="unknown scheduler"):
        ImagePipeline.from_pretrained(tiny_dir, scheduler="nope")
    pipe.set_scheduler("ddim", clip_sample=False)  # a known one swaps in and runs
    assert pipe("seven", seed=0, num_inference_steps=2, output_type="np").images.shape == (1, 32, 32, 1)


def test_unknown_attention_backend(tiny_dir):
    with pytest.raises(ConfigError, match="attention backend"):
        ImagePipeline.from_pretrained(tiny_dir, attention_backend="flashy")


# ----------------------------------------------------------------------- from_pretrained errors
def _copy(tiny_dir, tmp_path):
    dst = tmp_path / "pipe"
    shutil.copytree(tiny_dir, dst)
    return dst


def _edit_index(root, **changes):
    index = json.loads((root / "model_index.json").read_text())
    for k, v in changes.items():
        if v is None:
            index.pop(k, None)
        else:
            index[k] = v
    (root / "model_index.json").write_text(json.dumps(index))


def test_from_pretrained_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError):
        ImagePipeline.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(MissingFileError, match="model_index.json"):
        ImagePipeline.from_pretrained(tmp_path)


@pytest.mark.parametrize("component", ["vae", "text_encoder", "tokenizer", "transformer", "scheduler"])
def test_from_pretrained_missing_component_folder(tiny_dir, tmp_path, component):
    root = _copy(tiny_dir, tmp_path)
    shutil.rmtree(root / component)
    with pytest.raises(MissingFileError, match=component):
        ImagePipeline.from_pretrained(root)


def test_from_pretrained_component_not_listed(tiny_dir, tmp_path):
    root = _copy(tiny_dir, tmp_path)
    _edit_index(root, vae=None)
    with pytest.raises(MissingFileError, match="vae"):
        ImagePipeline.from_pretrained(root)


@pytest.mark.parametrize("slot,entry", [
    ("vae", ["diffusers", "AutoencoderTiny"]),
    ("transformer", ["diffusers", "UNet2DConditionModel"]),
    ("scheduler", ["diffusers", "EulerAncestralDiscreteScheduler"]),
    ("tokenizer", ["transformers", "T5Tokenizer"]),
])  # fmt: skip
def test_from_pretrained_unknown_component_class(tiny_dir, tmp_path, slot, entry):
    root = _copy(tiny_dir, tmp_path)
    _edit_index(root, **{slot: entry})
    with pytest.raises(UnsupportedArchitectureError, match=entry[1]):
        ImagePipeline.from_pretrained(root)


def test_from_pretrained_missing_weights_and_bad_shapes(tiny_dir, tmp_path):
    root = _copy(tiny_dir, tmp_path)
    (root / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(MissingFileError, match="safetensors"):
        ImagePipeline.from_pretrained(root)
    root2 = _copy(tiny_dir, tmp_path / "b")
    cfg = json.loads((root2 / "transformer" / "config.json").read_text())
    cfg["hidden_size"] = 64
    (root2 / "transformer" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightShapeError):
        ImagePipeline.from_pretrained(root2)


def test_few_step_requires_student(tmp_path):
    root = write_tiny_pipeline(tmp_path / "nostudent", student=False)
    with pytest.raises(MissingFileError, match="few-step student"):
        ImagePipeline.from_pretrained(root, few_step=True)


def test_cli_image(tiny_dir, tmp_path, capsys):
    from PIL import Image

    from forwardpass.cli import main

    out = tmp_path / "one.png"
    assert main(["image", "a handwritten 7", "--model", str(tiny_dir), "--steps", "2", "--seed", "1",
                 "-o", str(out), "--no-progress"]) == 0  # fmt: skip
    assert Image.open(out).size == (32, 32)
    grid = tmp_path / "grid.png"
    assert main(["image", "seven", "--model", str(tiny_dir), "--steps", "2", "--num-images", "4",
                 "--negative-prompt", "3", "--guidance", "2", "-o", str(grid),
                 "--no-progress"]) == 0  # fmt: skip
    assert Image.open(grid).size[0] > 32 * 2
    assert main(["image", "seven", "--model", str(tiny_dir), "--few-step", "--size", "16x24", "-o",
                 str(tmp_path / "s.png"), "--no-progress"]) == 0  # fmt: skip
    assert Image.open(tmp_path / "s.png").size == (16, 24)
    assert main(["image", "seven", "--model", str(tiny_dir), "--size", "30x30", "-o", str(out)]) == 1
    assert "multiple of 8" in capsys.readouterr().err
    assert main(["image", "seven", "--model", str(tiny_dir), "--scheduler", "bogus", "-o", str(out)]) == 1
    assert main(["image", "seven", "--model", str(tiny_dir), "--size", "big", "-o", str(out)]) == 1


def test_unknown_words_warn_by_name(pipe, caplog):
    with caplog.at_level("WARNING", logger="forwardpass.diffusion.pipeline"):
        pipe("a zebra seven", seed=0, num_inference_steps=1, output_type="latent")
    assert "zebra" in caplog.text and "seven" not in caplog.text.split("words")[-1]
