"""Fine-tuning's defaults, in a module that imports nothing heavy: ``tinylm finetune``
runs them (:func:`tinylm.training.finetune.train_config`) and ``tinylm finetune --help``
shows them, both from here."""

from __future__ import annotations

#: Fine-tuning defaults where they differ from pretraining's (flags override them).
FULL_DEFAULTS = {"lr": 1e-4, "warmup_steps": 20, "max_steps": 300, "eval_every": 50,
                 "save_every": 100, "log_every": 10, "weight_decay": 0.0, "batch_size": 16,
                 "optimizer": "adamw"}
#: LoRA's: the full defaults with a larger peak lr (the adapters start at zero).
LORA_DEFAULTS = {**FULL_DEFAULTS, "lr": 2e-3}
#: Fine-tuning runs without dropout unless asked (``--dropout``), as LitGPT, torchtune
#: and nanochat fine-tune: the base's pretraining dropout is not carried over. With
#: dropout 0 the fused native training block runs (it steps aside for dropout).
FINETUNE_DROPOUT = 0.0
