"""Train a one-step video model with MeanFlow (Geng et al. 2025, arXiv 2505.13447): a two-time Wan `u(x_t, t, r)`
learns the average velocity from `t` to `r` through the MeanFlow identity, its target a forward-mode derivative of
the model itself (`fvx.core.derivatives`).

The default starts from the teacher that `experiments/finetune_wan.py` trains on fvx's toy video world (exported to
`runs/teacher`), with the r input added (`models.student.r_embedder`), and trains it on the world's data:
    python -m fvx.run experiments/finetune_wan.py && python -m fvx.run export runs/finetune_wan --out runs/teacher
    python -m fvx.run experiments/meanflow.py
Validation samples the student in 1, 2 and 4 jumps (`validation/student_<n>step/nearest_mse`). The recipe
`world_distill` distils the same teacher instead (`meanflow_distill`: the teacher's velocity in place of the data's).
The exact derivative runs eagerly (`method.derivative=ad`); a compiled model takes
`method.derivative=finite_difference`.
"""
import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.meanflow import MeanFlow, MeanFlowDistill
from fvx_models.anyflow import AnyFlowConfig
from fvx_models.wan import WanConfig
from fvx_models.wan_two_time import REmbedder
from fvx_models.wan_vae import WanVAEConfig


class MeanFlowWan(Experiment):
    models: dict[str, WanConfig | AnyFlowConfig] = msgspec.field(
        default_factory=lambda: {"student": WanConfig(r_embedder=REmbedder())})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: MeanFlow | MeanFlowDistill = MeanFlow()


TEACHER = "runs/teacher"  # experiments/finetune_wan.py's run, exported (module docstring)

config = MeanFlowWan(
    run=RunConfig(seed=0, steps=300, output_dir="runs/meanflow", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": WanConfig(preset="world", path=TEACHER, r_embedder=REmbedder())},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=100, num_prompts=8, display_scale=4),
    method=MeanFlow(optim=AdamWConfig(lr=3e-4, max_grad_norm=1.0), shift=3.0),
)


@recipe
def world_distill() -> MeanFlowWan:
    """The default run distilling the teacher's velocity (``meanflow_distill``) instead of the data's."""
    return msgspec.structs.replace(
        config, run=msgspec.structs.replace(config.run, output_dir="runs/meanflow_distill"),
        models={**config.models, "teacher": WanConfig(preset="world", path=TEACHER)},
        method=MeanFlowDistill(optim=config.method.optim, shift=config.method.shift))
