"""MoCo v2 (He et al. 2020; Chen et al. 2020) with CO2's consistency term: the sharded key queue
(``key_queue``) and the InfoNCE loss over it (``queue_loss``)."""
