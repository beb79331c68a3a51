"""Wan image-to-video (fvx_models.wan_i2v): the given first frame enters the DiT as diffusers' I2V pipeline feeds it
(the family cases check the whole forward against the pipeline's call), the first-frame form keeps that frame out of
the noise path and the loss, guidance keeps the image, and bad I2V input is one clear error."""
import pytest
import torch

from fvx.core import flow, random
from fvx_models import build, cond as fcond
from fvx_models.wan import WanConfig
from fvx_models.wan_moe import Wan22MoEConfig

from family_cases import CASES, inputs, native_modules, raw_batch  # noqa: E402


@pytest.fixture(scope="module")
def ti2v():
    model = WanConfig(preset="tiny-ti2v", first_frame=True).build()
    return model, model.weights.init(random.key(0))


def test_the_first_frame_form_feeds_the_given_frame_at_timestep_zero(ti2v):
    model, _ = ti2v
    config = WanConfig(preset="tiny-ti2v", first_frame=True)
    x, t, cond = inputs(model, random.key(1))
    kwargs, _ = build.native_inputs(config, x, t, cond)
    assert torch.equal(kwargs["hidden_states"][:, :, :1], cond["first_frame_latents"][:, :, :1])
    assert torch.equal(kwargs["hidden_states"][:, :, 1:], x[:, :, 1:])
    per_frame = kwargs["timestep"].view(x.shape[0], x.shape[2], -1)
    assert torch.all(per_frame[:, 0] == 0) and torch.equal(per_frame[:, 1], t[:, None].expand_as(per_frame[:, 1]))


def test_the_first_frame_is_untouched_by_the_noise_and_sampling_lands_on_it(ti2v):
    model, params = ti2v
    x, t, cond = inputs(model, random.key(2))
    noisy = x.clone()
    noisy[:, :, :1] = random.normal(random.key(3), x[:, :, :1].shape)  # other noise on the given frame
    outs = [model.apply(params, z, t, cond)[:, :, 1:] for z in (x, noisy)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # the DiT never sees the noisy first frame
    sigmas = [1.0, 0.75, 0.5, 0.25, 0.0]
    video = flow.sample(model.apply, params, random.normal(random.key(4), x.shape), sigmas, cond=cond)
    torch.testing.assert_close(video[:, :, :1], cond["first_frame_latents"][:, :, :1], rtol=0, atol=1e-5)


def test_the_first_frame_is_out_of_the_loss(ti2v):
    """With the data's own first frame given, that frame's velocity error is zero: the flow-matching loss is the
    other frames' error."""
    model, params = ti2v
    batch = model.batch(raw_batch(model, random.key(5)))
    x0 = model.normalize(batch["latents"])
    noise, sigma = random.normal(random.key(7), x0.shape), torch.tensor([0.3, 0.8])
    v = model.apply(params, flow.add_noise(x0, noise, sigma), 1000 * sigma, batch["cond"])
    error = (v - (noise - x0)) ** 2
    assert float(error[:, :, :1].max()) < 1e-8 and float(error[:, :, 1:].mean()) > 1e-2


def test_guidance_keeps_the_given_image_and_a_negative_prompt_file_needs_none(tmp_path):
    model = WanConfig(preset="tiny-i2v").build()
    x, t, cond = inputs(model, random.key(8))
    zero = model.uncond(cond, "zero")
    assert torch.equal(zero["first_frame_latents"], cond["first_frame_latents"])
    assert torch.equal(zero["image_embeds"], cond["image_embeds"]) and not zero["text"].any()
    fcond.save(tmp_path / "negative.safetensors", {"text": torch.ones(1, 3, 32)})
    negative = model.load_negative(str(tmp_path / "negative.safetensors"), "method.negative_prompt_path")
    guided = model.uncond(cond, "negative_prompt", negative)
    assert torch.equal(guided["image_embeds"], cond["image_embeds"])
    assert torch.equal(guided["text"][1], torch.ones(3, 32))


def test_wan22_a14b_i2v_routes_at_its_own_boundary_0_9():
    config = Wan22MoEConfig(preset="tiny-i2v")
    assert config.boundary == 0.9 and Wan22MoEConfig(preset="tiny").boundary == 0.875
    model = config.build()
    params = model.weights.init(random.key(0))
    x, _, cond = inputs(model, random.key(9), batch=2)
    t = torch.tensor([890.0, 905.0])  # high-noise expert for T2V's 875, not for I2V's 900
    modules = native_modules(CASES["wan_moe-i2v"], params)
    with torch.no_grad():
        want = CASES["wan_moe-i2v"].native(modules, x, t, cond)
    torch.testing.assert_close(model.apply(params, x, t, cond), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, message", [
    (lambda raw: raw.pop("first_frame_latents"), "wan needs the batch tensor 'first_frame_latents' (the first frame's "
                                                 "latents: parquet column first_frame_latent"),
    (lambda raw: raw.pop("image_embeds"), "parquet column clip_feature"),
    (lambda raw: raw.update(image_embeds=torch.zeros(2, 3, 8)),
     "cond['image_embeds'] must be [B, N, 16], got [2, 3, 8]"),
])
def test_bad_i2v_data_is_one_line_naming_the_column(change, message):
    model = WanConfig(preset="tiny-i2v").build()
    raw = raw_batch(model, random.key(0))
    change(raw)
    with pytest.raises(ValueError) as error:
        model.batch(raw)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_bad_i2v_shapes_and_knobs_are_refused():
    model = WanConfig(preset="tiny-i2v").build()
    x, t, cond = inputs(model, random.key(0))
    small = {**cond, "first_frame_latents": cond["first_frame_latents"][..., :2, :2]}
    with pytest.raises(ValueError, match=r"first_frame_latents \[2, 16, 2, 2, 2\] do not fit latents \[2, 16, 2, 4,"):
        model.apply(model.weights.init(random.key(0)), x, t, small)
    with pytest.raises(ValueError, match="at most 512 text tokens, got 600"):
        model.apply(model.weights.init(random.key(0)), x, t, {**cond, "text": torch.zeros(2, 600, 32),
                                                       "text_mask": torch.ones(2, 600)})
    with pytest.raises(ValueError, match="wan preset 'tiny' has no per-token timesteps"):
        WanConfig(preset="tiny", first_frame=True)
