"""What methods share: building the program of a one-role method (``one_role``), and the distribution-matching core
of DMD2 and its kin (``distribution_matching``). Role updates, accumulation and the optimizer are the core's
(``fvx.core.role``)."""
