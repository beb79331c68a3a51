"""The Wan variants' encoders: SkyReels-V2, AnyFlow and block-causal Wan encode as Wan (its record), Wan 2.2 A14B as Wan
without the CLIP image encoder. Tiny random folders of the variants' own diffusers pipelines, opened as preprocessing
opens them, against those pipelines' own ``encode_prompt``."""
import pytest
import torch
import transformers
from diffusers import (AnyFlowPipeline, AutoencoderKLWan, FlowMapEulerDiscreteScheduler,
                       FlowMatchEulerDiscreteScheduler, SkyReelsV2Pipeline, UniPCMultistepScheduler,
                       WanImageToVideoPipeline)

import encoder_checks
from fvx_models import anyflow, skyreels_v2, wan, wan_causal, wan_moe
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
                   wan_moe.Wan22MoEConfig):
        assert config.encoders is wan.ENCODERS
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
    opened = config.encoders.open(tmp_path, ["text", "video"])
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
    opened = wan_moe.Wan22MoEConfig.encoders.open(tmp_path, ["text", "video", "first_frame"])  # preprocess's parts
    video = encoder_checks.random_clip((3, 5, 32, 32), seed=2)
    assert torch.equal(opened.encode_first_frame(video), wan.encode_first_frame(opened.pipe, video[None])[0])
    assert opened.encode_image((video[:, 0] + 1) / 2) is None  # FastVideo stores no clip_feature
