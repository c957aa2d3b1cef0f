"""Training: the loop, its run folder and log, distributed strategies, fine-tuning."""
