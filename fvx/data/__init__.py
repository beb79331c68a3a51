"""Training data: datasets and batches as a pure function of the step (``datasets``: FastVideo's parquet and
synthetic latents), and the toy video world the CPU defaults train on (``toy_world``)."""
