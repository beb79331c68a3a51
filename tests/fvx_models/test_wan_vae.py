"""fvx_models.wan_vae against diffusers' own AutoencoderKLWan: tiny decode, load from save_pretrained, bad folders."""
import inspect
import json

import pytest
import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import load_file, save_file

from fvx.core import random
from fvx_models import wan_vae
from fvx_models.wan_vae import WanVAEConfig

TINY = wan_vae.PRESETS["tiny"]
MEAN = [0.1 * i for i in range(16)]  # non-identity statistics, to see that load reads them from the folder
STD = [1.0 + 0.5 * i for i in range(16)]


@pytest.fixture(scope="module")
def latents():
    return random.normal(random.key(1), (2, 16, 2, 4, 4))


@pytest.fixture(scope="module")
def tiny():
    return WanVAEConfig().build(random.key(0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(diffusers module, pipeline root) with the module saved by its own save_pretrained under root/vae."""
    state = torch.get_rng_state()
    torch.manual_seed(0)
    module = AutoencoderKLWan(**{**TINY, "latents_mean": MEAN, "latents_std": STD}).eval()
    torch.set_rng_state(state)
    root = tmp_path_factory.mktemp("pipeline")
    module.save_pretrained(root / "vae")
    return module, root


def reference_decode(module, latents):
    with torch.no_grad():
        return (module.decode(latents).sample / 2 + 0.5).clamp(0, 1)


# ----------------------------------------------------------------------------------------------------------- tiny


def test_tiny_decode_shape_range_and_interface(tiny):
    video = tiny.decode(random.normal(random.key(1), (1, 16, 2, 8, 8)))
    assert video.shape == (1, 3, tiny.num_frames(2), 32, 32) == (1, 3, 5, 32, 32)
    assert video.dtype == torch.float32 and not video.requires_grad
    assert 0 <= video.min() and video.max() <= 1 and video.std() > 0.01
    assert (tiny.latent_channels, tiny.temporal_compression, tiny.spatial_compression) == (16, 4, 4)
    assert tiny.latents_mean == (0.0,) * 16 and tiny.latents_std == (1.0,) * 16


def test_tiny_is_deterministic_per_key_and_reads_no_global_rng(latents):
    before, copy = torch.get_rng_state(), latents.clone()
    first = WanVAEConfig().build(random.key(0)).decode(latents)
    again = WanVAEConfig().build(random.key(0)).decode(latents)
    other = WanVAEConfig().build(random.key(1)).decode(latents)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(first, again) and not torch.allclose(first, other)
    assert torch.equal(latents, copy)


def test_each_sample_decodes_as_if_alone(tiny, latents):
    both = tiny.decode(latents)
    torch.testing.assert_close(both[1:], tiny.decode(latents[1:]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("frames", [1, 3])
def test_num_frames_matches_the_decode(tiny, frames):
    video = tiny.decode(torch.zeros(1, 16, frames, 4, 4))
    assert video.shape[2] == tiny.num_frames(frames) == 1 + 4 * (frames - 1)


def test_bf16_decodes_close_to_fp32_and_returns_fp32(latents):
    fp32 = WanVAEConfig().build(random.key(0)).decode(latents)
    bf16 = WanVAEConfig(dtype="bf16").build(random.key(0)).decode(latents)
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, fp32, rtol=0, atol=0.05)


@pytest.mark.parametrize("preset", list(wan_vae.PRESETS))
def test_compression_agrees_with_the_diffusers_config(preset):
    kwargs = wan_vae.PRESETS[preset]
    assert wan_vae.compression(preset) == (kwargs["scale_factor_temporal"], kwargs["scale_factor_spatial"])


def test_wan21_preset_is_diffusers_default_autoencoder():
    defaults = {name: p.default for name, p in inspect.signature(AutoencoderKLWan.__init__).parameters.items()
                if name != "self"}
    assert wan_vae.PRESETS["wan2.1"] == defaults


# ------------------------------------------------------------------------------------------------------------ load


def test_load_from_save_pretrained_decodes_like_diffusers(saved, latents):
    module, root = saved
    expected = reference_decode(module, latents)
    for path in (root, root / "vae"):  # pipeline root and the VAE folder itself
        vae = WanVAEConfig(path=str(path)).build()
        torch.testing.assert_close(vae.decode(latents), expected, rtol=0, atol=1e-6)
        assert vae.latents_mean == pytest.approx(MEAN) and vae.latents_std == pytest.approx(STD)


def test_missing_config_json_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no config.json in"):
        WanVAEConfig(path=str(tmp_path)).build()


def test_missing_and_unexpected_keys_are_listed_in_one_error(saved, tmp_path):
    _, root = saved
    tensors = load_file(root / "vae" / wan_vae.WEIGHTS_NAME)
    del tensors["decoder.conv_out.bias"], tensors["encoder.conv_in.bias"]  # a missing encoder key is fine
    tensors["decoder.extra.weight"] = torch.zeros(2)
    tensors["decoder.conv_in.bias"] = torch.zeros(3)
    save_file(tensors, tmp_path / wan_vae.WEIGHTS_NAME)
    (tmp_path / "config.json").write_text((root / "vae" / "config.json").read_text())
    with pytest.raises(ValueError) as error:
        WanVAEConfig(path=str(tmp_path)).build()
    message = str(error.value)
    assert "missing keys (1): decoder.conv_out.bias" in message
    assert "unexpected keys (1): decoder.extra.weight" in message
    assert "shape mismatches (1): decoder.conv_in.bias: [3]" in message
    assert "encoder.conv_in.bias" not in message


def test_architecture_mismatch_names_the_field(saved, tmp_path):
    _, root = saved
    config = json.loads((root / "vae" / "config.json").read_text())
    config["base_dim"] = 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="base_dim: folder has 16, expected 8"):
        WanVAEConfig(path=str(tmp_path)).build()


def test_missing_weights_is_a_clear_error(saved, tmp_path):
    _, root = saved
    (tmp_path / "config.json").write_text((root / "vae" / "config.json").read_text())
    with pytest.raises(ValueError, match="safetensors only"):
        WanVAEConfig(path=str(tmp_path)).build()


# ------------------------------------------------------------------------------------------------------ bad input


def test_bad_config_and_inputs_are_clear_errors(tiny):
    with pytest.raises(ValueError, match="unknown Wan VAE preset 'huge'"):
        WanVAEConfig(preset="huge")
    with pytest.raises(ValueError, match="a key is required"):
        WanVAEConfig().build()
    with pytest.raises(ValueError, match=r"latents must be a float tensor \[B, 16, T, H, W\]"):
        tiny.decode(torch.zeros(1, 8, 2, 4, 4))
