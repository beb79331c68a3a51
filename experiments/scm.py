"""Train a one- and few-step video model with a continuous-time consistency model, sCM (Lu & Song 2024, arXiv
2410.11081): TrigFlow over the flow-matching Wan, the consistency condition's tangent a forward-mode derivative of the
model itself (`fvx.core.derivatives`), normalised and warmed up, the loss weighted per noise level by its running
mean.

The default starts from the teacher that `experiments/finetune_wan.py` trains on fvx's toy video world (exported to
`runs/teacher`; a plain Wan, no second time input) and trains it by consistency training on the world's data:
    python -m fvx.run experiments/finetune_wan.py && python -m fvx.run export runs/finetune_wan --out runs/teacher
    python -m fvx.run experiments/scm.py
Validation samples the student in 1, 2 and 4 consistency steps (`validation/student_<n>step/nearest_mse`). The recipe
`world_distill` distils the same teacher instead (`scm_distill`: the teacher's velocity as dx/dt). The exact
derivative runs eagerly (`method.derivative=dual`); a compiled model takes `method.derivative=finite_difference`.
"""
import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.scm import SCM, SCMDistill
from fvx_models.wan import WanConfig
from fvx_models.wan_vae import WanVAEConfig


class SCMWan(Experiment):
    models: dict[str, WanConfig] = msgspec.field(default_factory=lambda: {"student": WanConfig()})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: SCM | SCMDistill = SCM()


TEACHER = "runs/teacher"  # experiments/finetune_wan.py's run, exported (module docstring)

config = SCMWan(
    run=RunConfig(seed=0, steps=300, output_dir="runs/scm", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": WanConfig(preset="world", path=TEACHER)},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=100, num_prompts=8, display_scale=4),
    method=SCM(optim=AdamWConfig(lr=1e-4, betas=(0.9, 0.99), max_grad_norm=1.0)),
)


@recipe
def world_distill() -> SCMWan:
    """The default run distilling the teacher's velocity (``scm_distill``) instead of the data's."""
    return msgspec.structs.replace(
        config, run=msgspec.structs.replace(config.run, output_dir="runs/scm_distill"),
        models={**config.models, "teacher": WanConfig(preset="world", path=TEACHER)},
        method=SCMDistill(optim=config.method.optim))
