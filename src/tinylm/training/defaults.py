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

#: ``tinylm rl``'s defaults (:class:`tinylm.training.rl.RLConfig` and ``tinylm rl --help``
#: both read them). ``lr`` None: 1e-5 for full fine-tuning, 1e-4 with LoRA.
RL_DEFAULTS = {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 48,
               "temperature": 1.0, "advantage": "mean", "updates_per_batch": 1,
               "clip_eps": 0.2, "kl_coef": 0.0, "lora_rank": None, "lora_alpha": None,
               "lr": None, "max_steps": 100, "time_budget": None, "eval_every": 20,
               "save_every": 20, "pass_k": 4, "seed": 0, "n_train": 1000,
               "n_held_out": 50, "grad_clip": 1.0, "match": "exact", "reward": None}
#: The default learning rates of ``tinylm rl``: (full fine-tuning, LoRA).
RL_LR = (1e-5, 1e-4)
