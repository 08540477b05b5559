"""A job that goes on with the ranks it has: the global batch kept across world sizes
(``global_batch``) and what each change of membership cost (``restart_cost``)."""
