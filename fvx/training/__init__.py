"""Running an experiment: its config and setup (``experiment``), the loop (``loop``), resume (``resume``), the run
folder (``run_folder``), callbacks, validation and tracking (``callbacks``, ``validation``, ``tracking``,
``wandb_mirror``), stopping cleanly (``interrupts``, ``run_lock``), and what a finished run gives: ``replay``,
``export`` and the ``dry_run`` of a planned one."""
