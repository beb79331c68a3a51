"""fvx_models.wan_vae against diffusers' own AutoencoderKLWan: tiny decode and encode, load from save_pretrained, bad
folders."""
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
def tiny_encoder():
    return WanVAEConfig(encoder=True).build(random.key(0))


@pytest.fixture(scope="module")
def reference():
    """diffusers' whole AutoencoderKLWan holding the tiny preset's params drawn from key 0 (no RNG read)."""
    with torch.device("meta"):
        module = AutoencoderKLWan(**TINY)
    module.load_state_dict(wan_vae.init(wan_vae.skeleton("tiny", encoder=True)[0], random.key(0)), assign=True)
    return module.eval()


@pytest.fixture(scope="module")
def video():
    return random.uniform(random.key(2), (2, 3, 5, 16, 16))


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


def reference_encode(module, video):
    """diffusers' encode of a [0, 1] video: the posterior's mode (its mean), as FastVideo's re-encoded anchor."""
    with torch.no_grad():
        return module.encode(2 * video - 1).latent_dist.mode()


def decoder_only_folder(saved, folder):
    """``folder`` holding the saved VAE's config.json and its decoder's weights only; returns it."""
    _, root = saved
    tensors = load_file(root / "vae" / wan_vae.WEIGHTS_NAME)
    save_file({name: t for name, t in tensors.items() if name.startswith(("decoder.", "post_quant_conv."))},
              folder / wan_vae.WEIGHTS_NAME)
    (folder / "config.json").write_text((root / "vae" / "config.json").read_text())
    return folder


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


# ---------------------------------------------------------------------------------------------------------- encode


def test_default_build_holds_no_encoder(tiny):
    assert tiny.decode.func is wan_vae.decode
    module = tiny.decode.args[0]
    assert module.encoder is None and module.quant_conv is None
    names = [name for name, _ in module.named_parameters()]
    assert names and all(name.startswith(("decoder.", "post_quant_conv.")) for name in names)
    assert set(wan_vae.init(wan_vae.skeleton("tiny")[0], random.key(0))) == set(names)


def test_encoder_keeps_the_decoders_draws(tiny, tiny_encoder, latents):
    assert torch.equal(tiny_encoder.decode(latents), tiny.decode(latents))


@pytest.mark.parametrize("frames", [1, 5])
def test_tiny_encode_is_diffusers_posterior_mode(tiny_encoder, reference, frames):
    video = random.uniform(random.key(2), (2, 3, frames, 16, 16))
    before, copy = torch.get_rng_state(), video.clone()
    latents = tiny_encoder.encode(video)
    assert torch.equal(torch.get_rng_state(), before) and torch.equal(video, copy)
    assert latents.shape == (2, 16, 1 + (frames - 1) // 4, 4, 4) and latents.dtype == torch.float32
    assert not latents.requires_grad and latents.std() > 0.01
    torch.testing.assert_close(latents, reference_encode(reference, video), rtol=0, atol=1e-6)
    torch.testing.assert_close(latents[1:], reference_encode(reference, video[1:]), rtol=0, atol=0)


def test_encode_of_decode_is_diffusers_decode_then_encode(tiny_encoder, reference, latents):
    with torch.no_grad():
        expected = reference.encode(reference.decode(latents).sample).latent_dist.mode()
    torch.testing.assert_close(tiny_encoder.encode(tiny_encoder.decode(latents)), expected, rtol=0, atol=1e-5)


def test_bf16_encodes_close_to_fp32_and_returns_fp32(tiny_encoder, video):
    bf16 = WanVAEConfig(encoder=True, dtype="bf16").build(random.key(0)).encode(video)
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, tiny_encoder.encode(video), rtol=0, atol=0.05)


def test_load_from_save_pretrained_encodes_like_diffusers(saved, video):
    module, root = saved
    expected = reference_encode(module, video)
    for path in (root, root / "vae"):
        vae = WanVAEConfig(path=str(path), encoder=True).build()
        torch.testing.assert_close(vae.encode(video), expected, rtol=0, atol=1e-6)


def test_decoder_only_folder_loads_the_decoder_and_refuses_the_encoder(saved, tmp_path, latents):
    folder = decoder_only_folder(saved, tmp_path)
    with pytest.raises(ValueError, match=r"^Wan VAE load: weights in .* hold no encoder .*encoder=False$") as error:
        WanVAEConfig(path=str(folder), encoder=True).build()
    assert str(folder) in str(error.value) and "\n" not in str(error.value)
    vae = WanVAEConfig(path=str(folder)).build()
    torch.testing.assert_close(vae.decode(latents), reference_decode(saved[0], latents), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"built without its encoder.*WanVAEConfig\(encoder=True\)"):
        vae.encode(torch.zeros(1, 3, 1, 16, 16))


def test_missing_encoder_keys_are_listed_when_the_encoder_is_kept(saved, tmp_path):
    _, root = saved
    tensors = load_file(root / "vae" / wan_vae.WEIGHTS_NAME)
    del tensors["encoder.conv_in.bias"]
    save_file(tensors, tmp_path / wan_vae.WEIGHTS_NAME)
    (tmp_path / "config.json").write_text((root / "vae" / "config.json").read_text())
    WanVAEConfig(path=str(tmp_path)).build()  # the decoder alone does not need it
    with pytest.raises(ValueError, match=r"missing keys \(1\): encoder.conv_in.bias"):
        WanVAEConfig(path=str(tmp_path), encoder=True).build()


# ------------------------------------------------------------------------------------------------------ bad input


def test_bad_config_and_inputs_are_clear_errors(tiny):
    with pytest.raises(ValueError, match="unknown Wan VAE preset 'huge'"):
        WanVAEConfig(preset="huge")
    with pytest.raises(ValueError, match="a key is required"):
        WanVAEConfig().build()
    with pytest.raises(ValueError, match=r"latents must be a float tensor \[B, 16, T, H, W\]"):
        tiny.decode(torch.zeros(1, 8, 2, 4, 4))
    with pytest.raises(ValueError, match=r"built without its encoder.*vae.encoder=true\)$"):
        tiny.encode(torch.zeros(1, 3, 1, 16, 16))


@pytest.mark.parametrize("shape", [(1, 3, 4, 16, 16), (1, 3, 0, 16, 16), (1, 4, 1, 16, 16), (1, 3, 1, 18, 16),
                                   (0, 3, 1, 16, 16), (3, 1, 16, 16)])
def test_bad_videos_are_clear_errors(tiny_encoder, shape):
    with pytest.raises(ValueError, match=r"video must be a float tensor \[B, 3, 1 \+ 4 k, H, W\] with B >= 1 and "
                                         r"H, W multiples of 4, got torch.float32"):
        tiny_encoder.encode(torch.zeros(shape))
