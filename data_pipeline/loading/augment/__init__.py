"""The augmentation recipe (``AugmentConfig``) and the per-sample view parameters every loader
backend draws the same way."""
