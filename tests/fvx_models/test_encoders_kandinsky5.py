"""Kandinsky 5's encoders (fvx_models.encoders, the record in fvx_models.kandinsky5): a tiny random
Kandinsky5T2VPipeline folder (a Qwen2.5-VL, CLIP's text model, the HunyuanVideo VAE) saved locally, opened as
preprocessing opens it, against diffusers' own calls. The Qwen tokenizer is built here so that the pipeline's template
takes exactly the tokens it crops, as on the real one: the rows kept are the prompt's own tokens and the closing
<|im_end|>.

The real folder's ``tokenizer`` is a ``Qwen2VLProcessor``, which transformers 5 builds only with torchvision (its
video processor's base class); torchvision is not installed here. The pipeline calls it on text alone, which a
processor hands to its tokenizer unchanged (``ProcessorMixin.__call__``: no image or video placeholders to expand), so
the record loads that tokenizer itself (``encoders.processor_tokenizer``) and this folder, named as the real one, holds
only the tokenizer's files; the last test checks the claim where torchvision is."""
import json

import pytest
import torch
import transformers
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5T2VPipeline

import encoder_checks
from fvx_models import kandinsky5
from fvx_models.kandinsky5 import Kandinsky5Config

PROMPTS = ["red bars moving left", "a   cat"]  # the pipeline cleans whitespace: "a cat"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TEMPLATE_OF = Kandinsky5T2VPipeline(transformer=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                                     tokenizer_2=None, scheduler=FlowMatchEulerDiscreteScheduler())
TEMPLATE, CROP = _TEMPLATE_OF.prompt_template, _TEMPLATE_OF.prompt_template_encode_start_idx


def qwen_tokenizer(vocab: dict, merges: list) -> transformers.Qwen2Tokenizer:
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    return tokenizer


def tiny_qwen_tokenizer() -> transformers.Qwen2Tokenizer:
    """A byte-level BPE of the template's and the cleaned prompts' words (Qwen's own pre-tokenizer splits them), one
    token each, the template's part before the prompt CROP tokens long, as Qwen's vocabulary makes it."""
    return encoder_checks.template_cropping_tokenizer(
        qwen_tokenizer, {SPECIALS[0]: 0}, SPECIALS[1:], [TEMPLATE.format(p.replace("   ", " ")) for p in PROMPTS],
        TEMPLATE.split("{}")[0], CROP)


def tiny_qwen(vocab_size: int) -> transformers.Qwen2_5_VLForConditionalGeneration:
    return transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=None, eos_token_id=None,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0])))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    tokenizer, clip_tokenizer = tiny_qwen_tokenizer(), encoder_checks.tiny_clip_tokenizer(PROMPTS)
    clip = encoder_checks.tiny_clip_text(len(clip_tokenizer))
    vae = encoder_checks.tiny_hunyuan_vae()
    pipe = Kandinsky5T2VPipeline(transformer=None, vae=vae, text_encoder=tiny_qwen(len(tokenizer)),
                                 tokenizer=tokenizer, text_encoder_2=clip, tokenizer_2=clip_tokenizer,
                                 scheduler=FlowMatchEulerDiscreteScheduler())
    path = tmp_path_factory.mktemp("kandinsky5")
    pipe.save_pretrained(path)
    index = json.loads((path / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "Qwen2VLProcessor"]  # as the real folder names it
    (path / "model_index.json").write_text(json.dumps(index))
    return path


def test_the_qwen_tokenizer_is_the_folders_and_the_template_takes_its_cropped_tokens(folder):
    tokenizer = kandinsky5.ENCODERS.open(folder, ["text"]).pipe.tokenizer
    assert type(tokenizer) is transformers.Qwen2Tokenizer and tokenizer.padding_side == "right"
    assert len(tokenizer(TEMPLATE.split("{}")[0]).input_ids) == CROP
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(TEMPLATE.format(PROMPTS[0])).input_ids)
    assert tokens[CROP:] == ["red", "Ġbars", "Ġmoving", "Ġleft", "<|im_end|>"]


def real_tokens(pipe, embeds: torch.Tensor) -> list[torch.Tensor]:
    """Each prompt's rows of ``embeds`` where its tokens (the pipeline's cleaned prompt in its template, tokenized as
    it tokenizes them) are, the template's cropped: the reference cut, independent of ``cu_seqlens``."""
    texts = [TEMPLATE.format(" ".join(p.split())) for p in PROMPTS]
    mask = pipe.tokenizer(texts, max_length=CROP + kandinsky5.TEXT_LEN, truncation=True, padding=True,
                          return_tensors="pt").attention_mask[:, CROP:]
    return [e[m.bool()] for e, m in zip(embeds, mask)]


@pytest.mark.parametrize("side", ["right", "left"])
def test_text_is_the_pooled_row_then_the_pipelines_tokens(folder, side):
    opened = kandinsky5.ENCODERS.open(folder, ["text"])
    opened.pipe.tokenizer.padding_side = side
    rows = opened.encode_text(PROMPTS)
    embeds, pooled, cu_seqlens = opened.pipe.encode_prompt(PROMPTS, max_sequence_length=512,
                                                           device=torch.device("cpu"))
    lengths = [5, 3] if side == "right" else [5, 5]  # left padding: the crop keeps 2 template tokens of "a cat"
    assert embeds.shape == (2, 5, 32) and pooled.shape == (2, 16) and cu_seqlens.diff().tolist() == lengths
    expected = real_tokens(opened.pipe, embeds)
    assert [len(t) for t in expected] == lengths
    encoder_checks.assert_pooled_row_then_tokens(rows, pooled, expected)


def test_training_reads_the_stored_rows_back_as_the_pipelines_conditioning(folder):
    opened = kandinsky5.ENCODERS.open(folder, ["text"])
    batch = encoder_checks.collate_stored_rows(opened.encode_text(PROMPTS), text_len=9)
    cond = kandinsky5.KANDINSKY5.conditioning.from_batch(Kandinsky5Config(preset="tiny"), batch)
    embeds, pooled, _ = opened.pipe.encode_prompt(PROMPTS, max_sequence_length=512, device=torch.device("cpu"))
    mask = torch.tensor([[1.0] * 5 + [0.0] * 3, [1.0] * 3 + [0.0] * 5])
    assert torch.equal(cond["pooled"], pooled) and torch.equal(cond["text_mask"], mask)
    assert torch.equal(cond["text"][:, :5], embeds * mask[:, :5, None]) and not cond["text"][:, 5:].any()


def test_video_latents_are_the_vaes_posterior_mean(folder):
    encoder_checks.assert_video_latents_are_the_posterior_mean(kandinsky5.ENCODERS, folder, (3, 5, 32, 32),
                                                               (4, 2, 4, 4))


def test_a_folder_without_a_text_encoder_is_refused_in_one_line(folder, tmp_path):
    encoder_checks.assert_refused_without(kandinsky5.ENCODERS, folder, tmp_path, "text_encoder",
                                          ("tokenizer", "tokenizer_2", "text_encoder_2"),
                                          r"has no 'text_encoder' component[^\n]*$")


def test_a_qwen2vl_processor_tokenizes_text_as_its_tokenizer(folder):
    pytest.importorskip("torchvision")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder / "tokenizer")
    processor = transformers.Qwen2VLProcessor(image_processor=transformers.Qwen2VLImageProcessor(),
                                              tokenizer=tokenizer, video_processor=transformers.Qwen2VLVideoProcessor())
    texts = [TEMPLATE.format(p) for p in PROMPTS]
    kwargs = dict(images=None, videos=None, max_length=CROP + 512, truncation=True, return_tensors="pt", padding=True)
    by_processor, by_tokenizer = processor(text=texts, **kwargs), tokenizer(text=texts, **kwargs)
    for key in ("input_ids", "attention_mask"):
        assert torch.equal(by_processor[key], by_tokenizer[key])
