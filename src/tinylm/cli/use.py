"""The commands that use a model: ``info``, ``sample``, ``chat``, ``eval``, ``explain``
and ``serve``."""

from __future__ import annotations

import argparse
import logging
import sys

from tinylm import __version__
from tinylm.cli.flags import _allow_nonfinite_flag, _count, _device_flag, _positive

log = logging.getLogger("tinylm")


def _add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="show versions, the device and native kernels, and what a model is",
        description="Print tinylm/torch versions, the device tinylm picks (cuda > mps > "
        "cpu) and whether its native kernels are active. Given a checkpoint or run folder, "
        "also its architecture, parameter count (quantized weights included) and bytes on "
        "disk and in memory, tokenizer kind and size, what made it (train, finetune, "
        "quantize, compress, merge, convert), the training step and validation loss (its "
        "source's for a quantized or compressed copy), its quantization, low-rank ranks and "
        "LoRA adapters with their base.",
    )
    p.add_argument("run", nargs="?", metavar="RUN",
                   help="a checkpoint folder or training run folder to describe")
    p.add_argument("--model", metavar="DIR", help="the same as RUN")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_info)


def _native_status() -> str:
    """'active' or 'off' for the native kernels, asked through the acceleration door."""
    from tinylm import acceleration

    native = getattr(acceleration, "native", None)
    available = getattr(acceleration, "available", None) or getattr(native, "available", None)
    if native is None or not callable(available):
        return "off (no native package)"
    try:
        return "active" if available() else "off (torch's kernels)"
    except Exception:  # a broken build must not break `info`
        return "off (torch's kernels)"


def _cmd_info(args: argparse.Namespace) -> int:
    import json

    import torch

    from tinylm.core.config import resolve_device
    from tinylm.core.errors import ConfigError
    from tinylm.io.describe import describe_checkpoint

    if args.run and args.model and args.run != args.model:
        raise ConfigError(f"give the folder once: RUN ({args.run}) or --model ({args.model})")
    folder = args.run or args.model
    runtime = {"tinylm": __version__, "torch": torch.__version__,
               "device": str(resolve_device()), "native_kernels": _native_status()}
    info = describe_checkpoint(folder) if folder else None
    if args.json:
        print(json.dumps({**runtime, **({"checkpoint": info} if info else {})}))
        return 0
    print(f"tinylm {runtime['tinylm']}, torch {runtime['torch']}, device {runtime['device']}, "
          f"native kernels {runtime['native_kernels']}")
    if info is not None:
        for label, text in _info_lines(info):
            print(f"{label:<13} {text}")
    return 0


def _info_lines(info: dict) -> list[tuple[str, str]]:
    from tinylm.io.describe import info_lines

    return info_lines(info)


def _add_sample(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sample",
        help="generate text from a checkpoint (KV cache, temperature/top-k/top-p, streaming)",
        description="Continue a prompt with a trained model. The prompt goes through the "
        "model in one pass, then one token per step through the KV cache; text is "
        "streamed to stdout as it becomes decodable (whole characters only). Without a "
        "prompt, generation starts from the end-of-text token. Past the context length "
        "the window slides. A sample ends at the end-of-text token, a --stop string, or "
        "after --max-new-tokens.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="a checkpoint folder")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", metavar="TEXT", help="the text to continue")
    src.add_argument("--prompt-file", metavar="FILE",
                     help="read the prompt from a UTF-8 file ('-' = stdin), used as is")
    p.add_argument("--max-new-tokens", type=_count, default=200, metavar="N",
                   help="tokens to generate per sample (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="0 = greedy; <1 sharper, >1 more random (default: %(default)s)")
    p.add_argument("--top-k", type=_count, metavar="K",
                   help="sample among the K most likely (default: all)")
    p.add_argument("--top-p", type=float, metavar="P",
                   help="sample among the smallest set of tokens whose probability reaches P "
                   "(0 < P <= 1) (default: all)")
    p.add_argument("--seed", type=_count, metavar="S",
                   help="random seed in [0, 2^63 - 1]: same seed, same text (default: random)")
    p.add_argument("--num-samples", type=_count, default=1, metavar="N",
                   help="samples generated together in one batch, printed one after another "
                   "(default: %(default)s)")
    p.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="end a sample before this string (repeatable; escapes like \\n work)")
    p.add_argument("--no-echo", action="store_true", help="print only the continuation")
    p.add_argument("--allow-special", action="store_true",
                   help="a special token spelled in the prompt (e.g. <|endoftext|>) becomes "
                   "that token; without it, it is ordinary text")
    _allow_nonfinite_flag(p)
    _device_flag(p)
    p.set_defaults(func=_cmd_sample)


#: The most prompt text read from --prompt-file (a prompt uses at most its last C - 1
#: tokens; this only stops /dev/zero or a huge file from filling memory).
PROMPT_MAX_BYTES = 16 * 1024 * 1024


def _read_prompt(args: argparse.Namespace) -> str:
    """--prompt, or the text of --prompt-file (at most :data:`PROMPT_MAX_BYTES`)."""
    from pathlib import Path

    from tinylm.core.errors import DataError

    limit = PROMPT_MAX_BYTES
    if args.prompt_file is None:
        return args.prompt or ""
    name = "stdin" if args.prompt_file == "-" else f"prompt file {args.prompt_file}"
    try:
        if args.prompt_file == "-":
            if sys.stdin is None or sys.stdin.isatty():
                raise DataError("--prompt-file - reads the prompt from stdin, but stdin is a "
                                "terminal; pipe text in or use --prompt")
            raw = getattr(sys.stdin, "buffer", None)  # text-only streams (tests) have none
            data = raw.read(limit + 1) if raw is not None else \
                sys.stdin.read(limit + 1).encode("utf-8", "surrogateescape")
        else:
            with open(Path(args.prompt_file), "rb") as f:
                data = f.read(limit + 1)
    except FileNotFoundError as exc:
        raise DataError(f"{name} does not exist; pass a UTF-8 text file to --prompt-file") \
            from exc
    except OSError as exc:
        raise DataError(f"cannot read {name} ({exc.strerror or exc}); pass a UTF-8 text file "
                        f"to --prompt-file") from exc
    if len(data) > limit:
        raise DataError(f"{name} is larger than {limit // 2**20} MB; a prompt uses "
                        f"only its last context-length tokens, so pass the end of the text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{name} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                        f"convert it to UTF-8") from exc


def _stop_strings(given: list[str]) -> list[str]:
    """--stop's strings with the escapes \\n, \\t, \\r and \\\\ made real; none may be empty."""
    import re

    from tinylm.core.errors import ConfigError

    escapes = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    stop = [re.sub(r"\\([ntr\\])", lambda m: escapes[m.group(1)], s) for s in given]
    if any(not s for s in stop):
        raise ConfigError("--stop needs a non-empty string")
    return stop


def _cmd_sample(args: argparse.Namespace) -> int:
    from tinylm.core.config import resolve_device
    from tinylm.io.checkpoint import load_model, require_tokenizer_of
    from tinylm.use.sampling import SamplingConfig, check_generation, generate_text

    SamplingConfig(args.temperature, args.top_k, args.top_p)  # check flags before loading
    device = resolve_device(args.device)
    check_generation(args.max_new_tokens, args.num_samples, args.seed, device=device)
    stop = _stop_strings(args.stop)
    prompt = _read_prompt(args)
    model = load_model(args.model, device, allow_nonfinite=args.allow_nonfinite)
    check_generation(args.max_new_tokens, args.num_samples, args.seed,
                     prompt_tokens=len(prompt.encode("utf-8")) + 1, device=device,
                     model_config=model.config)
    tokenizer = require_tokenizer_of(args.model, "sample needs the model's tokenizer to turn "
                                     "text into ids")
    pieces = generate_text(model, tokenizer, prompt, args.max_new_tokens,
                           num_samples=args.num_samples, stop=stop,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           seed=args.seed, allow_special=args.allow_special)
    echo = "" if args.no_echo else prompt
    out = sys.stdout
    if args.num_samples == 1:
        out.write(echo)
        out.flush()
        for _, piece in pieces:
            out.write(piece)
            out.flush()
        out.write("\n")
        return 0
    texts = [""] * args.num_samples
    for i, piece in pieces:
        texts[i] += piece
    for i, text in enumerate(texts):
        if i:
            out.write("\n")
        out.write(f"--- sample {i + 1} ---\n{echo}{text}\n")
    out.flush()
    return 0


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a fine-tuned model in the terminal (or answer one --prompt)",
        description="An interactive chat: the history is kept within the model's context "
        "(the oldest turns are dropped, with a note), answers stream as they are generated. "
        "Commands: /reset, /system TEXT, /temperature X, /help; Ctrl-D quits. With --prompt, "
        "answer one message and exit.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint or run folder")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="answer this message and exit (repeatable: each is answered as a "
                   "new conversation, printed after its question)")
    p.add_argument("--system", metavar="TEXT", help="a system message (default: none)")
    p.add_argument("--temperature", type=float, default=0.7, metavar="T",
                   help="sampling temperature, 0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, metavar="K", help="sample from the K likeliest tokens")
    p.add_argument("--top-p", type=float, default=0.9, metavar="P",
                   help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                   help="longest answer in tokens (default: %(default)s)")
    p.add_argument("--seed", type=int, metavar="N", help="seed for reproducible answers")
    _device_flag(p)
    p.set_defaults(func=_cmd_chat)


def _cmd_chat(args: argparse.Namespace) -> int:
    from tinylm.use.chatsession import open_session, run_terminal

    session = open_session(args.model, system=args.system, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p,
                           max_new_tokens=args.max_new_tokens, seed=args.seed,
                           device=args.device)
    if args.prompt is None:
        return run_terminal(session, sys.stdin, sys.stdout)
    for prompt in args.prompt:
        session.reset()
        if len(args.prompt) > 1:
            sys.stdout.write(f"Q: {prompt}\nA: ")
        for piece in session.reply(prompt, note=lambda s: print(s, file=sys.stderr)):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="loss, perplexity and bits per byte over a split or a text file; task "
        "accuracy (--task, --suite)",
        description="Score every next-token target of a prepared split (--data) or a text "
        "file (--text) exactly once: non-overlapping windows of the model's context "
        "length, or sliding windows with --stride. Bits per byte divide the total loss "
        "in bits by the UTF-8 size of the text, so they compare across tokenizers. "
        "With --task or --suite: task accuracy, scored as lm-evaluation-harness scores "
        "it (multiple choice: acc, acc_norm, acc_bytes; cloze; generative exact match); "
        "see docs/evaluate.md.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", metavar="DIR", help="a folder written by 'tinylm prepare'")
    src.add_argument("--text", metavar="FILE", help="a UTF-8 text file")
    src.add_argument("--task", action="append", metavar="NAME|FILE",
                     help="a task: builtin:copy, builtin:count, builtin:brackets, "
                     "builtin:add-digits, builtin:add-words, or a JSONL file (tinylm's "
                     "formats, HellaSwag, ARC, PIQA, Winogrande, BoolQ, LAMBADA, GSM8K); "
                     "repeatable")
    src.add_argument("--suite", metavar="FILE.toml",
                     help="several tasks, each centred on its random baseline, and their "
                     "mean (a CORE-style score)")
    p.add_argument("--model", required=True, metavar="DIR", help="a checkpoint or run folder")
    p.add_argument("--split", choices=("val", "train"), default="val",
                   help="which split of --data (default: %(default)s)")
    p.add_argument("--stride", type=_count, metavar="N",
                   help="sliding-window step, 1..C; each scored token then sees at least "
                   "C - N tokens of context (default: C, non-overlapping windows)")
    p.add_argument("--batch-size", type=_count, default=16, metavar="B",
                   help="windows (with --task: requests) per forward pass (default: %(default)s)")
    p.add_argument("--max-windows", type=_count, metavar="N",
                   help="stop after N windows: a quick estimate instead of the exact value")
    _add_task_flags(p)
    _device_flag(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: loss, perplexity, bits_per_byte, tokens "
                   "(with --task/--suite: {\"tasks\": {name: {kind, n, acc, ...}}, ...})")
    _allow_nonfinite_flag(p)
    p.set_defaults(func=_cmd_eval)


def _add_task_flags(p: argparse.ArgumentParser) -> None:
    """eval's flags for --task and --suite."""
    p.add_argument("--task-format", metavar="FORMAT",
                   help="the format of --task's file: mc, cloze, generate, hellaswag, arc, "
                   "piqa, winogrande, boolq, lambada, gsm8k (default: found from its fields)")
    p.add_argument("--limit", type=_count, metavar="N", help="score only the first N items")
    p.add_argument("--num-fewshot", type=int, default=0, metavar="K",
                   help="K examples from the task's own train/dev split before each item "
                   "(default: 0)")
    p.add_argument("--fewshot-file", metavar="FILE",
                   help="the split few-shot examples come from (default: a built-in task's "
                   "own; for a file, its items after --limit)")
    p.add_argument("--seed", type=int, metavar="S",
                   help="seed of the few-shot draw (default: 1234, as the harness)")


def _cmd_eval(args: argparse.Namespace) -> int:
    import json

    if args.task or args.suite:
        from tinylm.cli.evaluate import cmd_eval_tasks

        return cmd_eval_tasks(args)
    from tinylm.core.config import resolve_device
    from tinylm.io.checkpoint import load_model, load_tokenizer_of, require_tokenizer_of
    from tinylm.use.evaluation import evaluate_split, evaluate_text

    model = load_model(args.model, resolve_device(args.device),
                       allow_nonfinite=args.allow_nonfinite)
    options = {"stride": args.stride, "batch_size": args.batch_size,
               "max_windows": args.max_windows}
    if args.text is not None:
        tokenizer = require_tokenizer_of(args.model, "--text cannot be encoded without it, so "
                                         "evaluate a prepared split with --data instead")
        result = evaluate_text(model, tokenizer, _read_text(args.text), **options)
        what = f"{args.text}"
    else:
        result = evaluate_split(model, load_tokenizer_of(args.model), args.data, args.split,
                                **options)
        what = f"{args.data} ({args.split} split)"
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    bpb = "unknown" if result.bits_per_byte is None else f"{result.bits_per_byte:.4f}"
    print(f"model          {args.model}")
    print(f"evaluated on   {what}: {result.tokens:,} tokens")
    print(f"loss           {result.loss:.4f} nats/token")
    print(f"perplexity     {result.perplexity:.3f}")
    print(f"bits per byte  {bpb}")
    return 0


def _read_text(path: str) -> str:
    """The UTF-8 text of eval's --text file; a one-line DataError when it cannot be read."""
    from pathlib import Path

    from tinylm.core.errors import DataError

    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise DataError(f"text file {path} does not exist; pass a UTF-8 text file "
                        f"to --text") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path} as UTF-8 text ({exc}); convert it to "
                        f"UTF-8") from exc


def _add_explain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="next-token table per position, attention maps (PNG/HTML), embedding neighbours",
        description="For each position t of the prompt, show the token at t and the top-k "
        "candidates for the NEXT token with their probabilities (row t is the distribution "
        "after tokens 0..t, as in the study note's 'This is a pen .' table). Optionally draw "
        "every attention map (layers x heads) as a PNG, write an offline HTML explorer, "
        "or list the tokens nearest to one token in embedding space.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="a checkpoint or run folder")
    p.add_argument("--prompt", metavar="TEXT",
                   help="the text to explain (at most the model's context length in tokens)")
    p.add_argument("--top-k", type=int, default=5, metavar="K",
                   help="candidates per row (default: %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="print JSON: a list of rows {token, id, position, candidates: "
                   "[{token, id, prob}]} (with --neighbours, their list too)")
    p.add_argument("--attention", metavar="FILE.png",
                   help="draw all attention maps as a grid of heatmaps, in the format the "
                   "suffix names: .png, .jpg, .svg or .pdf (needs matplotlib)")
    p.add_argument("--html", metavar="FILE.html",
                   help="write the explorer: one offline page that walks every equation of "
                   "attention on the prompt (steps, heads, maps, logit lens, ablation, low "
                   "rank, next-token table)")
    p.add_argument("--layer", type=int, default=0, metavar="L",
                   help="the layer the page opens on (default: %(default)s)")
    p.add_argument("--head", type=int, default=0, metavar="H",
                   help="the head the page opens on (default: %(default)s)")
    p.add_argument("--neighbours", metavar="TOKEN",
                   help="list the tokens nearest to TOKEN by cosine similarity of embeddings")
    p.add_argument("--count", type=int, default=10, metavar="N",
                   help="how many neighbours (default: %(default)s)")
    _device_flag(p)
    p.set_defaults(func=_cmd_explain)


def _cmd_explain(args: argparse.Namespace) -> int:
    import json

    from tinylm.use import inspection
    from tinylm.use.explorer import run_explain

    report = run_explain(args.model, prompt=args.prompt, top_k=args.top_k,
                         attention=args.attention, html_path=args.html, layer=args.layer,
                         head=args.head, neighbours=args.neighbours, count=args.count,
                         device=args.device)
    for path in report.written:
        log.info("wrote %s", path)
    out: dict[str, object] = {}
    if report.explanation is not None:
        out["rows"] = report.explanation.to_json()
        if not args.json:
            print(inspection.format_table(report.explanation))
    if report.neighbours is not None:
        out["neighbours"] = [{"token": n.token, "id": n.id, "similarity": n.similarity}
                             for n in report.neighbours]
        if not args.json:
            if report.explanation is not None:
                print()
            print(inspection.format_neighbours(args.neighbours, report.neighbours))
    if args.json:
        print(json.dumps(out if len(out) > 1 else next(iter(out.values())), ensure_ascii=False,
                         indent=1))
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (continuous batching) and a web page",
        description="Serve a checkpoint over HTTP: POST /v1/completions, /v1/chat/completions "
                    "(models with a chat template), /v1/explain, /v1/explore; GET /v1/models, "
                    "/health, "
                    "/metrics; the playground and explorer page at /. Concurrent requests "
                    "decode together in one batched step. Needs the [serve] extra.")
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint folder")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: %(default)s; any other needs an API key of "
                        "16 or more characters)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (default: $TINYLM_API_KEY; "
                        "none on 127.0.0.1)")
    p.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="more names clients may send in the Host header, comma-separated "
                        "('*': any); the loopback names and --host are always allowed, others "
                        "get 421 (default: none)")
    p.add_argument("--max-batch", type=_positive, default=16, metavar="N",
                   help="requests decoded together in one step (default: %(default)s)")
    p.add_argument("--max-queue", type=_positive, default=64, metavar="N",
                   help="requests waiting beyond the batch (explore/explain: in a queue of "
                        "their own); more get 429 (default: %(default)s)")
    p.add_argument("--max-tokens", type=_positive, default=256, metavar="N",
                   help="the largest max_tokens a request may ask for (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="per-request time limit; generation ends there, an explore or explain "
                        "still waiting gets 429 (default: %(default)g)")
    p.add_argument("--max-explore-tokens", type=_positive, default=256, metavar="N",
                   help="the longest prompt /v1/explore and /v1/explain take; longer is a 413 "
                        "(default: %(default)s)")
    p.add_argument("--explore-memory", type=_positive, default=2048, metavar="MB",
                   help="MiB all explore and explain requests may use at once, by their "
                        "estimate; more wait in the queue, a request estimated over it is a "
                        "413 (default: %(default)s)")
    _add_serve_decoding(p)
    p.add_argument("--max-connections", type=_positive, default=128, metavar="N",
                   help="open connections; more are closed at once (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or SIGINT: new requests get 503 and running ones have "
                        "this long to finish before they are cancelled; then the server "
                        "exits 0 (default: %(default)g)")
    p.add_argument("--threads", type=_positive, default=None, metavar="N",
                   help="torch threads of the decoding loop (default: torch's own choice)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id clients send (default: the folder's name, a run "
                   "folder's own, or a .gguf file's name without .gguf)")
    p.set_defaults(func=_cmd_serve)


def _add_serve_decoding(p: argparse.ArgumentParser) -> None:
    """serve's flags for how its engine decodes: prefix reuse and prompt lookup."""
    p.add_argument("--prefix-cache", type=_count, default=256, metavar="MB",
                   help="MiB of prompt keys and values kept (by blocks of 16 tokens, least "
                        "recently used dropped first) so a prompt that starts like an "
                        "earlier one skips that part's prefill; 0 turns it off "
                        "(default: %(default)s)")
    p.add_argument("--speculate", choices=["ngram"], default=None,
                   help="ngram: prompt-lookup decoding: greedy requests verify draft tokens "
                        "copied from their own prompt and output in one forward (faster on "
                        "text that quotes its input; same tokens) (default: off)")
    p.add_argument("--draft-tokens", type=_positive, default=8, metavar="K",
                   help="the most draft tokens --speculate verifies per step "
                        "(default: %(default)s)")


def _cmd_serve(args: argparse.Namespace) -> int:
    from tinylm.core.errors import ConfigError
    from tinylm.serve import serve

    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise ConfigError(f"--shutdown-timeout must be >= 0 seconds, got "
                          f"{args.shutdown_timeout}")
    if args.prefix_cache < 0:
        raise ConfigError(f"--prefix-cache must be >= 0 MiB (0 turns it off), got "
                          f"{args.prefix_cache}")
    kwargs = {} if args.model_name is None else {"model_name": args.model_name}
    allowed = tuple(h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip())
    serve(args.model, host=args.host, port=args.port, api_key=args.api_key,
          max_batch=args.max_batch, max_queue=args.max_queue, max_tokens=args.max_tokens,
          timeout=args.timeout, threads=args.threads, allowed_hosts=allowed,
          max_explore_tokens=args.max_explore_tokens,
          explore_memory=args.explore_memory << 20, max_connections=args.max_connections,
          shutdown_timeout=args.shutdown_timeout, prefix_cache=args.prefix_cache << 20,
          speculate=args.speculate, draft_tokens=args.draft_tokens, **kwargs)
    return 0
