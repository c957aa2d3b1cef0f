"""``tinylm rl``: on-policy RL from verifiable rewards (:func:`tinylm.training.rl.rl`)."""

from __future__ import annotations

import argparse
import sys

#: flag -> (RLConfig field, type, metavar, help); the defaults come from RL_DEFAULTS.
_FLAGS = [
    ("--group-size", "group_size", int, "G", "completions sampled per prompt"),
    ("--prompts-per-step", "prompts_per_step", int, "P", "training prompts per step"),
    ("--max-new-tokens", "max_new_tokens", int, "N", "longest completion, in tokens"),
    ("--temperature", "temperature", float, "T", "sampling temperature of the rollouts "
     "and of pass@k (pass@1 is greedy)"),
    ("--advantage", "advantage", str, "{mean,std}", "reward - group mean, or that / "
     "(group std + 1e-6) as GRPO"),
    ("--updates-per-batch", "updates_per_batch", int, "U", "policy updates per sampled "
     "batch; U > 1 uses the clipped ratio (U = 1: REINFORCE with the group baseline)"),
    ("--clip-eps", "clip_eps", float, "E", "clip range of the ratio: [1-E, 1+E]"),
    ("--kl-coef", "kl_coef", float, "B", "weight of the k3 KL to the starting model "
     "(0: no reference model kept)"),
    ("--lora-rank", "lora_rank", int, "R", "train rank-R LoRA adapters (else every weight)"),
    ("--lora-alpha", "lora_alpha", float, "A", "LoRA scale numerator (None: 2·R)"),
    ("--lr", "lr", float, "LR", "constant learning rate (None: 1e-5 full, 1e-4 LoRA)"),
    ("--max-steps", "max_steps", int, "S", "RL steps"),
    ("--time-budget", "time_budget", float, "SEC", "stop after this many seconds"),
    ("--eval-every", "eval_every", int, "S", "held-out greedy pass@1 every S steps"),
    ("--save-every", "save_every", int, "S", "write OUT/latest every S steps"),
    ("--pass-k", "pass_k", int, "K", "pass@K at the start and the end (K samples/prompt)"),
    ("--seed", "seed", int, "N", "seed of the tasks, prompts, samples and LoRA"),
    ("--n-train", "n_train", int, "N", "training prompts generated (built-in tasks)"),
    ("--n-held-out", "n_held_out", int, "N", "held-out prompts"),
    ("--grad-clip", "grad_clip", float, "X", "gradient norm clip (0: none)"),
    ("--match", "match", str, "{exact,regex}", "FILE.jsonl tasks: how answers are checked"),
    ("--reward", "reward", str, "MODULE:FUNCTION", "your own reward function of (record, "
     "completion), imported and run in this process: code you chose to run"),
]


def _add_rl(sub: argparse._SubParsersAction) -> None:
    from tinylm.training.defaults import RL_DEFAULTS

    p = sub.add_parser(
        "rl", help="RL from verifiable rewards (GRPO / REINFORCE) on a task",
        description="On-policy RL: each step samples G completions of P task prompts with "
        "the model's chat template, scores them with the task's reward, and updates the "
        "policy with the token-level policy-gradient loss on the completion tokens "
        "(group-relative advantages; the GRPO clipped ratio when U > 1; an optional KL to "
        "the starting model). Writes a run folder as train does (latest/, best/ by "
        "held-out pass@1, metrics.jsonl, loss.png). See docs/rl.md.")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="chat checkpoint, run folder or .gguf file")
    p.add_argument("--task", required=True, metavar="TASK",
                   help="builtin:arith, builtin:count-letters, builtin:sort, "
                   "builtin:gsm8k-mini or FILE.jsonl (prompt + answer)")
    p.add_argument("--out", required=True, metavar="DIR", help="run folder to write")
    for flag, field, kind, metavar, text in _FLAGS:
        default = RL_DEFAULTS[field]
        p.add_argument(flag, dest=field, type=kind, default=default, metavar=metavar,
                       help=f"{text} (default: {default})")
    p.add_argument("--resume", action="store_true", help="continue from OUT/latest")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="force the progress bar on/off (default: on a terminal)")
    p.set_defaults(func=_cmd_rl)


def _cmd_rl(args: argparse.Namespace) -> int:
    from tinylm.training.rl import RLConfig, rl

    cfg = RLConfig(**{field: getattr(args, field) for _f, field, *_ in _FLAGS})
    result = rl(args.model, args.task, args.out, config=cfg, resume=args.resume,
                progress=args.progress)
    if result.stop_reason == "interrupted":
        print(f"interrupted at step {result.steps}; continue with the same command and "
              f"--resume", file=sys.stderr)
        return 130
    for label, scores in (("before", result.before), ("after", result.after)):
        if scores:
            shown = ", ".join(f"{k.removeprefix('heldout_')} {v:.3f}"
                              for k, v in scores.items())
            print(f"held-out {label}: {shown}")
    print(f"{result.steps} steps ({result.stop_reason}); best held-out pass@1 "
          f"{result.best_pass1:.3f}; checkpoint: {result.checkpoint}")
    return 0
