"""Spreading a run over processes: joining them and laying them on a mesh (``processes``), sharding params
(``sharding``), gathering them where used (``gathers``, scheduled by ``gather_schedule``), sequence parallelism
(``sequence_parallel``), compiling units (``compile``), and what each rank holds (``memory``)."""
