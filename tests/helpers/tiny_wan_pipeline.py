"""A tiny random Wan I2V pipeline folder (UMT5, the Wan VAE, a CLIP vision encoder, a tokenizer built here) as
``save_pretrained`` writes it: what preprocess and encode-prompts open in the tests, with no download."""
import pathlib

import torch
import transformers
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline

WORDS = ["<pad>", "</s>", "<unk>"] + [f"▁{w}" for w in "a red blue bars moving left right up down cat".split()]


def tiny_t5_tokenizer() -> transformers.T5Tokenizer:
    return transformers.T5Tokenizer(vocab=[(w, -float(i)) for i, w in enumerate(WORDS)], extra_ids=0)


def save(path: pathlib.Path, pipeline: type = WanImageToVideoPipeline) -> pathlib.Path:
    """The pipeline (transformer left out) saved at ``path``: a 4-channel VAE of 2x time and space compression;
    ``pipeline`` another pipeline class of Wan 2.1 I2V's components (ChronoEdit's)."""
    torch.manual_seed(0)
    text = transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=len(WORDS), d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8))
    vision = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8))
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                           latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0])
    pipeline(tokenizer=tiny_t5_tokenizer(), text_encoder=text, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
             image_processor=processor, image_encoder=vision, transformer=None).save_pretrained(path)
    return path


def save_t2v(path: pathlib.Path, transformer: dict | None = None) -> pathlib.Path:
    """A whole tiny Wan T2V pipeline at ``path`` whose parts fit the ``tiny`` DiT preset: UMT5 of width 32, the tiny
    Wan VAE (16 channels, 4x compression, statistics 0 and 1) and a random transformer (``transformer``: its
    arguments, default the ``tiny`` preset's)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from fvx_models import wan, wan_vae

    torch.manual_seed(0)
    text = transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=len(WORDS), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8))
    WanPipeline(tokenizer=tiny_t5_tokenizer(), text_encoder=text, vae=AutoencoderKLWan(**wan_vae.PRESETS["tiny"]),
                scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                transformer=WanTransformer3DModel(**(transformer or wan.TINY))).save_pretrained(path)
    return path
