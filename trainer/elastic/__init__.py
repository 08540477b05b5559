"""A job that goes on with the ranks it has: the global batch kept across world sizes
(``global_batch``), the range checked at the first start (``world_range``, its memory at the
smallest size: ``smallest_size_memory``; its settings, a config section: ``trainer.config_elastic``)
and what each change of membership cost (``restart_cost``)."""
