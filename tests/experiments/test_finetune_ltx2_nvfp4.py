"""FastVideo's LTX-2 NVFP4 quantization-aware recipes, value for value: fine_tuning/ltx2/nvfp4_qat_t2v.yaml,
fine_tuning/ltx2_3/nvfp4_qat_t2v.yaml and overfit_ltx2_t2v_nvfp4_qat.yaml (the YAML's values written here)."""
import pathlib

import pytest

from fvx import config as fconfig
from fvx_models.linear_qat import LinearQATConfig

FILE = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "finetune_ltx2.py"
# recipe -> (init_from, output_dir, max_train_steps, checkpoint steps / kept, validation every, data path)
YAMLS = {
    "ltx2_t2v_nvfp4_qat": ("models/LTX2-Distilled-Diffusers", "outputs/ltx2_t2v_nvfp4_qat_finetune", 2000, (500, 2),
                           250, "data/your_dataset_preprocessed"),
    "ltx2_3_t2v_nvfp4_qat": ("models/LTX-2.3-Distilled-Diffusers", "outputs/ltx2_3_t2v_nvfp4_qat_finetune", 2000,
                             (500, 2), 250, "data/your_dataset_preprocessed"),
    "ltx2_overfit_nvfp4_qat": ("models/LTX2-Distilled-Diffusers", "outputs/ltx2_overfit_nvfp4_attn_qat", 300, (0, 1),
                               50, "data/ltx2_overfit_preprocessed"),
}


@pytest.mark.parametrize("recipe", YAMLS)
def test_the_recipe_is_its_yaml(recipe):
    path, output, steps, (every, keep), validate_every, data = YAMLS[recipe]
    config = fconfig.load_experiment(f"{FILE}:{recipe}")
    student = config.models["student"]
    assert (student.path, student.attention, student.linear_qat) == (path, "qat", LinearQATConfig())  # ATTN_QAT_TRAIN,
    # quant_config: nvfp4_qat_train (the curated set)
    assert (student.compute_dtype, student.remat, student.lora) == ("bf16", True, None)  # full checkpointing
    assert (config.run.seed, config.run.steps, config.run.output_dir) == (42, steps, output)
    assert (config.run.checkpoint.every, config.run.checkpoint.keep_latest) == (every, keep)
    assert (config.data.path, config.data.batch_size, config.data.cfg_rate, config.data.num_latent_t) == (
        data, 4, 0.0, 11)  # 4 ranks of train_batch_size 1; training_cfg_rate 0; num_latent_t 11
    assert (config.data.preprocess.num_frames, config.data.preprocess.max_height,
            config.data.preprocess.max_width) == (81, 480, 832)
    optim = config.method.optim
    assert (optim.lr, optim.betas, optim.weight_decay, optim.schedule, optim.warmup_steps, optim.max_grad_norm) == (
        5e-5, (0.9, 0.999), 0.0, "constant", 0, 1.0)
    validation = config.validation
    assert (validation.every, validation.num_steps, validation.guidance_scale) == (validate_every, 8, 1.0)
    assert validation.latent_shape[1] == 11  # num_frames 81
