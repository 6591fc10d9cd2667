"""Each scheduler against its diffusers counterpart: timesteps / sigmas and one step, within 1e-6."""

from __future__ import annotations

import json

import pytest
import torch

from forwardpass.diffusion.schedulers import (
    DDIMScheduler,
    FlowMatchEulerDiscreteScheduler,
    LCMScheduler,
    scheduler_class,
    scheduler_from_config,
)
from forwardpass.errors import ConfigError, ValidationError

diffusers = pytest.importorskip("diffusers")

STEPS = [1, 2, 4, 7, 30, 50]


def _step_pair(ours, theirs, step_kwargs=None, seed=0):
    """Run one step at every timestep of the schedule with identical inputs; compare outputs."""
    step_kwargs = step_kwargs or {}
    torch.manual_seed(seed)
    sample = torch.randn(2, 4, 8, 8)
    for i, t in enumerate(theirs.timesteps):
        out = torch.randn(2, 4, 8, 8)
        g1, g2 = torch.Generator().manual_seed(i), torch.Generator().manual_seed(i)
        a = ours.step(out, ours.timesteps[i], sample, generator=g1, **step_kwargs).prev_sample
        b = theirs.step(out, t, sample, generator=g2, **step_kwargs).prev_sample
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        sample = b


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_flow_match_matches_diffusers(steps, shift):
    ours = FlowMatchEulerDiscreteScheduler(shift=shift)
    theirs = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
    torch.testing.assert_close(ours.sigmas, theirs.sigmas, atol=1e-6, rtol=0)
    ours.set_timesteps(steps)
    theirs.set_timesteps(steps)
    torch.testing.assert_close(ours.timesteps, theirs.timesteps, atol=1e-6 * 1000, rtol=0)
    torch.testing.assert_close(ours.timesteps / 1000, theirs.timesteps / 1000, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.sigmas, theirs.sigmas, atol=1e-6, rtol=0)
    _step_pair(ours, theirs)


def test_flow_match_custom_sigmas():
    sig = [1.0, 0.7, 0.3, 0.1]
    ours, theirs = (
        FlowMatchEulerDiscreteScheduler(shift=2.0),
        diffusers.FlowMatchEulerDiscreteScheduler(shift=2.0),
    )
    ours.set_timesteps(sigmas=sig)
    theirs.set_timesteps(sigmas=sig)
    torch.testing.assert_close(ours.sigmas, theirs.sigmas, atol=1e-6, rtol=0)


DDIM_CONFIGS = [
    {},
    {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "clip_sample": False,
     "set_alpha_to_one": False, "steps_offset": 1},
    {"beta_schedule": "squaredcos_cap_v2", "timestep_spacing": "trailing", "prediction_type": "v_prediction",
     "rescale_betas_zero_snr": True},
    {"timestep_spacing": "linspace", "prediction_type": "sample"},
]  # fmt: skip


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("cfg", range(len(DDIM_CONFIGS)))
def test_ddim_matches_diffusers(steps, cfg):
    kw = DDIM_CONFIGS[cfg]
    ours, theirs = DDIMScheduler(**kw), diffusers.DDIMScheduler(**kw)
    torch.testing.assert_close(ours.alphas_cumprod, theirs.alphas_cumprod, atol=1e-6, rtol=0)
    ours.set_timesteps(steps)
    theirs.set_timesteps(steps)
    assert torch.equal(ours.timesteps, theirs.timesteps)
    _step_pair(ours, theirs)


@pytest.mark.parametrize("eta", [0.5, 1.0])
def test_ddim_stochastic_step_matches(eta):
    ours, theirs = DDIMScheduler(), diffusers.DDIMScheduler()
    ours.set_timesteps(10)
    theirs.set_timesteps(10)
    _step_pair(ours, theirs, {"eta": eta})


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 8, 50])
@pytest.mark.parametrize("pred", ["epsilon", "sample", "v_prediction"])
def test_lcm_matches_diffusers(steps, pred):
    ours, theirs = LCMScheduler(prediction_type=pred), diffusers.LCMScheduler(prediction_type=pred)
    ours.set_timesteps(steps)
    theirs.set_timesteps(steps)
    assert torch.equal(ours.timesteps, theirs.timesteps)
    _step_pair(ours, theirs)  # includes the re-noising between steps (same generator seed on both sides)


def test_registry_and_errors(tmp_path):
    assert scheduler_class("ddim") is DDIMScheduler
    assert scheduler_class("LCMScheduler") is LCMScheduler
    diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0).save_config(tmp_path)  # a real scheduler_config.json
    s = scheduler_from_config(json.loads((tmp_path / "scheduler_config.json").read_text()))
    assert isinstance(s, FlowMatchEulerDiscreteScheduler) and s.config["shift"] == 3.0
    with pytest.raises(ConfigError, match="unknown scheduler"):
        scheduler_class("EulerAncestralDiscreteScheduler")
    with pytest.raises(ConfigError, match="use_karras_sigmas"):
        FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True)
    with pytest.raises(ConfigError, match="unknown config field"):
        DDIMScheduler(bogus=1)
    with pytest.raises(ValidationError):
        DDIMScheduler().set_timesteps(0)
    with pytest.raises(ValidationError):
        LCMScheduler().set_timesteps(51)
