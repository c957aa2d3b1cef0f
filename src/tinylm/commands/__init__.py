"""Commands that transform a checkpoint into another: compress (low-rank), and more."""
