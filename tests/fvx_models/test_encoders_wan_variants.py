"""The Wan variants' encoders: SkyReels-V2, AnyFlow and block-causal Wan encode as Wan (its record), Wan 2.2 A14B as Wan
without the CLIP image encoder. Tiny random folders of the variants' own diffusers pipelines, opened as preprocessing
opens them, against those pipelines' own ``encode_prompt``."""
import pytest
import torch
import transformers
from diffusers import (AnyFlowPipeline, AutoencoderKLWan, ChronoEditPipeline, FlowMapEulerDiscreteScheduler,
                       FlowMatchEulerDiscreteScheduler, SkyReelsV2Pipeline, UniPCMultistepScheduler,
                       WanImageToVideoPipeline)

import encoder_checks
import tiny_wan_pipeline
from fvx_models import anyflow, chronoedit, skyreels_v2, wan, wan_causal, wan_moe
from tiny_wan_pipeline import WORDS, tiny_t5_tokenizer


def tiny_wan_vae() -> AutoencoderKLWan:
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0])


def tiny_umt5() -> transformers.UMT5EncoderModel:
    torch.manual_seed(0)
    return transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=len(WORDS), d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8))


def test_the_variants_carry_wans_record_and_only_wan21_i2v_wants_image_features():
    for config in (skyreels_v2.SkyReelsV2Config, anyflow.AnyFlowConfig, wan_causal.WanCausalConfig,
                   wan_moe.Wan22MoEConfig, chronoedit.ChronoEditConfig):
        assert config.family.encoders is wan.ENCODERS
    wanted = {preset: wan.ENCODERS.image_wanted(wan.WanConfig(preset=preset))
              for preset in ("tiny-i2v", "wan2.1-i2v-14b-480p", "world-i2v", "wan2.2-ti2v-5b", "tiny")}
    assert wanted == {"tiny-i2v": True, "wan2.1-i2v-14b-480p": True, "world-i2v": False, "wan2.2-ti2v-5b": False,
                      "tiny": False}
    assert not wan.ENCODERS.image_wanted(wan_moe.Wan22MoEConfig(preset="wan2.2-i2v-a14b"))


@pytest.mark.parametrize("pipeline, scheduler, config", [
    (SkyReelsV2Pipeline, UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True),
     skyreels_v2.SkyReelsV2Config),
    (AnyFlowPipeline, FlowMapEulerDiscreteScheduler(), anyflow.AnyFlowConfig),
], ids=["skyreels_v2", "anyflow"])
def test_text_and_video_are_the_variant_pipelines_own(pipeline, scheduler, config, tmp_path):
    pipeline(tokenizer=tiny_t5_tokenizer(), text_encoder=tiny_umt5(), vae=tiny_wan_vae(), scheduler=scheduler,
             transformer=None).save_pretrained(tmp_path)
    opened = config.family.encoders.open(tmp_path, ["text", "video"])
    assert type(opened.pipe) is pipeline  # the folder's own pipeline class loads it
    encoder_checks.assert_text_is_the_pipelines_encode_prompt_cut_to_its_tokens(opened)
    video = encoder_checks.random_clip((3, 5, 32, 32))
    assert torch.equal(opened.encode_video(video), opened.pipe.vae.encode(video[None]).latent_dist.mean[0])


def test_a14b_i2v_folder_encodes_the_first_frame_without_clip(tmp_path):
    WanImageToVideoPipeline(tokenizer=tiny_t5_tokenizer(), text_encoder=tiny_umt5(), vae=tiny_wan_vae(),
                            scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), image_processor=None,
                            image_encoder=None, transformer=None, transformer_2=None,
                            boundary_ratio=0.9).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no 'image_processor' component"):
        wan.ENCODERS.open(tmp_path, ["text", "video", "first_frame", "image"])  # as for Wan 2.1 I2V, which wants CLIP
    encoders = wan_moe.Wan22MoEConfig.family.encoders
    opened = encoders.open(tmp_path, ["text", "video", "first_frame"])  # preprocess's parts
    video = encoder_checks.random_clip((3, 5, 32, 32), seed=2)
    assert torch.equal(opened.encode_first_frame(video), wan.encode_first_frame(opened.pipe, video[None])[0])
    assert opened.encode_image((video[:, 0] + 1) / 2) is None  # FastVideo stores no clip_feature


def test_a_chronoedit_folder_encodes_as_wan21_i2v_with_its_own_pipeline(tmp_path):
    """ChronoEdit's pipeline holds Wan 2.1 I2V's components: its folder opens with ChronoEditPipeline, and the text,
    the first frame's latents and the CLIP features are that pipeline's own."""
    tiny_wan_pipeline.save(tmp_path, ChronoEditPipeline)
    assert chronoedit.CHRONOEDIT.encoders.image_wanted(chronoedit.ChronoEditConfig(preset="tiny"))
    opened = chronoedit.CHRONOEDIT.encoders.open(tmp_path, ["text", "video", "first_frame", "image"])
    assert type(opened.pipe) is ChronoEditPipeline
    encoder_checks.assert_text_is_the_pipelines_encode_prompt_cut_to_its_tokens(opened)
    pixels = torch.randint(0, 256, (3, 5, 32, 32), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    video = pixels.float() / 255 * 2 - 1
    pipe = opened.pipe  # its prepare_latents: the first frame then zeros, the posterior's mode, normalised
    vae, condition = pipe.vae, torch.cat([video[:, :1], torch.zeros(3, 4, 32, 32)], dim=1)
    mean = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
    expected = (vae.encode(condition[None]).latent_dist.mode()[0] - mean) / std
    assert torch.allclose(opened.encode_first_frame(video), expected, atol=1e-6, rtol=0)
    from PIL import Image
    image = Image.fromarray(pixels[:, 0].permute(1, 2, 0).numpy())
    reference = pipe.encode_image(image, device=torch.device("cpu"))[0]
    assert torch.equal(opened.encode_image((video[:, 0] + 1) / 2), reference)
