"""The embedded digits model (forwardpass/assets/image): loads offline, deterministic, and measurably right.

Quality is judged by the committed eval classifier (trained on real digits the generator never saw).
The fast tests use 50 images; the issue's full 200-image comparison is marked slow.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from forwardpass import ImagePipeline
from forwardpass.diffusion import DEFAULT_MODEL_DIR
from forwardpass.diffusion.quality import classify, eval_prompts, load_classifier, recognition_rate


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny; on a shared 2-core machine one thread is many times faster than two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def teacher():
    return ImagePipeline.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def student():
    return ImagePipeline.from_pretrained(DEFAULT_MODEL_DIR, few_step=True)


@pytest.fixture(scope="module")
def classifier():
    return load_classifier(DEFAULT_MODEL_DIR / "eval_classifier")


def test_embedded_model_is_small():
    total = sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.rglob("*") if p.is_file())
    assert total < 15 * 2**20, f"embedded image model is {total / 2**20:.1f} MiB"


def test_loads_and_is_deterministic(teacher):
    a = teacher("a handwritten 7", seed=123, show_progress=False)
    b = teacher("a handwritten 7", seed=123, show_progress=False)
    assert len(a.images) == 1 and a.images[0].size == (32, 32) and a.images[0].mode == "L"
    np.testing.assert_array_equal(np.asarray(a.images[0]), np.asarray(b.images[0]))
    c = teacher("a handwritten 7", seed=124, show_progress=False)
    assert not np.array_equal(np.asarray(a.images[0]), np.asarray(c.images[0]))


def test_student_is_deterministic_and_few_step(student):
    assert student.defaults["num_inference_steps"] <= 4 and student.defaults["guidance_scale"] <= 1.0
    a = student("the digit 3", seed=9, output_type="np", show_progress=False).images
    b = student("the digit 3", seed=9, output_type="np", show_progress=False).images
    assert a.shape == (1, 32, 32, 1)
    np.testing.assert_array_equal(a, b)


def test_classifier_accuracy_recorded(classifier):
    metrics = json.loads((DEFAULT_MODEL_DIR / "eval_classifier" / "metrics.json").read_text())
    assert metrics["real_test_accuracy"] >= 0.95


def test_teacher_quality_default_settings(teacher, classifier):
    assert recognition_rate(teacher, classifier, n=50, batch_size=50) >= 0.9


def test_student_quality_four_steps(student, classifier):
    assert recognition_rate(student, classifier, n=50, batch_size=50, num_inference_steps=4) >= 0.9


def test_synonyms_mean_the_same_digit(student, classifier):
    """ "seven", "7", "number seven", "a thin 7" all draw a seven."""
    prompts = ["seven", "7", "number seven", "a thin 7", "the digit 7", "a handwritten seven"]
    images = student(prompts, num_images_per_prompt=4, seed=0, output_type="np", show_progress=False).images
    assert (classify(classifier, images) == 7).mean() >= 0.8


def test_cli_on_embedded_model(tmp_path):
    from PIL import Image

    from forwardpass.cli import main

    out = tmp_path / "seven.png"
    assert main(["image", "a handwritten 7", "--steps", "4", "--few-step", "--seed", "3", "-o", str(out),
                 "--no-progress"]) == 0  # fmt: skip
    assert Image.open(out).size == (32, 32)


@pytest.mark.slow
def test_quality_200_images(teacher, student, classifier):
    """The issue's criterion: ≥ 90% at defaults; student@4 ≥ teacher@4 and within 5 points of teacher@30."""
    teacher_default = recognition_rate(teacher, classifier, n=200)
    teacher_4 = recognition_rate(teacher, classifier, n=200, num_inference_steps=4)
    teacher_30 = recognition_rate(teacher, classifier, n=200, num_inference_steps=30)
    student_4 = recognition_rate(student, classifier, n=200, num_inference_steps=4)
    assert teacher_default >= 0.9 and student_4 >= 0.9
    assert student_4 >= teacher_4
    assert student_4 >= teacher_30 - 0.05


def test_eval_prompts_cycle_digits():
    prompts, labels = eval_prompts(20)
    assert labels[:10] == list(range(10)) and len(set(prompts)) == 20
    assert torch.tensor(labels).bincount().tolist() == [2] * 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_same_seed_same_image_on_cuda():
    cpu = ImagePipeline.from_pretrained(DEFAULT_MODEL_DIR)
    gpu = ImagePipeline.from_pretrained(DEFAULT_MODEL_DIR).to("cuda")
    for few_step in (False, True):
        if few_step:
            cpu = ImagePipeline.from_pretrained(DEFAULT_MODEL_DIR, few_step=True)
            gpu = ImagePipeline.from_pretrained(DEFAULT_MODEL_DIR, few_step=True).to("cuda")
        a = cpu(["seven", "a thin 3"], seed=0, output_type="np", show_progress=False).images
        b = gpu(["seven", "a thin 3"], seed=0, output_type="np", show_progress=False).images
        np.testing.assert_allclose(a, b, atol=2e-2)
