"""SwAV: prototypes, distributed Sinkhorn codes, swapped prediction over multi-crop views."""
