"""Every named recipe of every experiment file builds, dry-runs on the meta device, and round-trips through
config.json without its file."""
import pathlib
import re

import msgspec
import pytest

from fvx import config as fconfig
from fvx.training import dry_run

EXPERIMENTS = sorted((pathlib.Path(__file__).resolve().parents[1] / "experiments").glob("*.py"))
RECIPES = [f"{path}:{name}" for path in EXPERIMENTS for name in fconfig.recipes(fconfig.run_experiment(path))]


def test_the_experiments_define_recipes():
    assert {pathlib.Path(r.partition(":")[0]).name for r in RECIPES} >= {"dmd2.py", "finetune_wan.py"}


@pytest.mark.parametrize("recipe", RECIPES, ids=[pathlib.Path(r).name for r in RECIPES])
def test_every_recipe_builds_and_dry_runs(recipe, tmp_path):
    config = fconfig.load_experiment(recipe)
    # one micro-batch of one sample per rank (FastVideo's KD recipes run 8 ranks of 2, its LoRA recipe accumulates 5)
    split = getattr(config.method, "micro_batches", None)  # DiffusionNFT's accumulation counts micro-steps
    world = config.data.batch_size // (getattr(config.method, "grad_accum", 1) if split is None else split(config.data))
    # its own latents when it samples them (a recipe's data is not here), else 1 + a multiple of 4 and of 8 frames
    # (the dry run refuses clips the method refuses: a streaming recipe's stages need its own 39 latent frames)
    own = config.validation.latent_shape or getattr(config.method, "latent_shape", None)
    video = None if own is not None else (81, 448, 832)
    report = dry_run.report(config, world=world, video=video)
    assert re.search(r"(fits|does NOT fit) in [\d.]+ GiB", report), report  # a recipe at 1 rank may not fit
    fconfig.dump(config, tmp_path)
    loaded = fconfig.load_typed(tmp_path)
    assert msgspec.to_builtins(loaded.config) == msgspec.to_builtins(config)
    assert [s for s in loaded.sources if "rebuilt" not in s] == []


def test_an_unknown_recipe_lists_the_files_recipes():
    path = next(p for p in EXPERIMENTS if p.name == "dmd2.py")
    with pytest.raises(fconfig.ConfigError, match="has no recipe 'nope'; its recipes: world_lora, wan21_t2v_1p3b"):
        fconfig.load_experiment(f"{path}:nope")
    with pytest.raises(fconfig.ConfigError, match="defines no recipes"):
        fconfig.load_experiment(f"{next(p for p in EXPERIMENTS if p.name == 'finetune_hunyuan.py')}:x")
