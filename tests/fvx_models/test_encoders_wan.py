"""Wan's encoders (fvx_models.encoders, the record in fvx_models.wan): a tiny random Wan I2V pipeline folder (UMT5,
the Wan VAE, a CLIP vision encoder) saved locally, opened as preprocessing opens it, against diffusers' own calls."""
import shutil

import pytest
import torch

import encoder_checks
import tiny_wan_pipeline
from fvx_models import wan


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_wan_pipeline.save(tmp_path_factory.mktemp("wan_i2v"))


def test_text_is_the_pipelines_encode_prompt_cut_to_its_tokens(folder):
    encoder_checks.assert_text_is_the_pipelines_encode_prompt_cut_to_its_tokens(wan.ENCODERS.open(folder, ["text"]))


def test_video_latents_are_the_vaes_posterior_mean(folder):
    encoder_checks.assert_video_latents_are_the_posterior_mean(wan.ENCODERS, folder, (3, 5, 32, 32), (4, 3, 16, 16))


def test_i2v_first_frame_and_clip_features_are_the_pipelines(folder):
    opened = wan.ENCODERS.open(folder, ["video", "first_frame", "image"])
    pixels = torch.randint(0, 256, (3, 5, 32, 32), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    video = pixels.float() / 255 * 2 - 1
    condition = torch.cat([video[:, :1], torch.zeros(3, 4, 32, 32)], dim=1)
    vae = opened.pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
    expected = (vae.encode(condition[None]).latent_dist.mean[0] - mean) / std
    assert torch.allclose(opened.encode_first_frame(video), expected, atol=1e-6, rtol=0)
    from PIL import Image
    image = Image.fromarray(pixels[:, 0].permute(1, 2, 0).numpy())
    reference = opened.pipe.encode_image(image, device=torch.device("cpu"))[0]
    features = opened.encode_image((video[:, 0] + 1) / 2)
    assert features.shape == (17, 16) and torch.equal(features, reference)


def test_a_folder_without_a_component_is_named_before_any_weight_loads(folder, tmp_path):
    encoder_checks.assert_refused_without(wan.ENCODERS, folder, tmp_path, "text_encoder", ("tokenizer",),
                                          "has no 'text_encoder' component")
    with pytest.raises(ValueError, match="is not a diffusers pipeline folder"):
        wan.ENCODERS.open(tmp_path / "nowhere", ["video"])


def test_a_decoder_only_vae_is_refused_before_it_loads(folder, tmp_path):
    from safetensors.torch import load_file, save_file
    shutil.copytree(folder, tmp_path / "model")
    weights = tmp_path / "model" / "vae" / "diffusion_pytorch_model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if not k.startswith("encoder.")}, weights)
    with pytest.raises(ValueError, match="has no encoder weights \\(encoder.\\*; a decoder-only VAE\\)"):
        wan.ENCODERS.open(tmp_path / "model", ["video"])
    wan.ENCODERS.open(tmp_path / "model", ["text"])  # text needs no VAE
