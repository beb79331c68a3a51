"""The pure functional core: explicit keys (``random``), pytrees (``tree``), gradients and remat (``grad``), optimizers
as composable transforms (``optim``) with their schedules (``schedules``) and knobs (``optim_config``), moving
averages (``ema``), flow-matching math (``flow``), the train state (``state``) and one role's update (``role``). It
imports nothing from the distributed or running parts of fvx."""
