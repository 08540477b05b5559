"""The paper's method: full instance classification with the sharded classifier."""
