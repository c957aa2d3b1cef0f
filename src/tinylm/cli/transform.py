"""The commands that turn one checkpoint into another: ``compress`` (low rank),
``quantize`` (int8) and ``convert`` (Hugging Face folders, both ways)."""

from __future__ import annotations

import argparse

from tinylm.cli.flags import _device_flag, _threads_flag


def _add_compress(sub: argparse._SubParsersAction) -> None:
    from tinylm.layers.defaults import DEFAULT_LAYERS

    p = sub.add_parser(
        "compress",
        help="low-rank (truncated SVD) compression of a checkpoint, with a report",
        description="Replace chosen Linear layers W (E->F) by two thin ones W1 (E, r) and "
        "W2 (r, F), x·W ≈ x·W1·W2, by truncated SVD (the best rank-r approximation). "
        "Pick the ranks with --rank, --energy or --params-fraction; write a checkpoint "
        "that every command loads without flags and print a per-layer report. With "
        "--data also the validation loss before and after (and after --finetune STEPS). "
        "--sweep measures loss and forward speed over several parameter fractions.",
    )
    p.add_argument("--model", required=True, metavar="DIR",
                   help="checkpoint (or training run) folder to compress")
    p.add_argument("--out", metavar="DIR",
                   help="folder for the compressed checkpoint (not needed with --sweep)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--rank", type=int, metavar="R", help="the same rank R in every layer")
    how.add_argument("--energy", type=float, metavar="F",
                     help="per layer, the smallest rank keeping a share F in (0, 1] of Σσ²")
    how.add_argument("--params-fraction", type=float, metavar="P",
                     help="global budget: the whole model keeps at most a share P in (0, 1] "
                     "of its parameters; ranks follow singular-value energy across layers")
    how.add_argument("--sweep", action="store_true",
                     help="for each of --fractions, validation loss and forward tokens/s "
                     "(needs --data; --plot FILE.png draws loss vs parameters kept)")
    p.add_argument("--layers", default=",".join(DEFAULT_LAYERS), metavar="NAMES",
                   help="comma-separated layer names or suffixes to factorise (default: "
                   "%(default)s)")
    p.add_argument("--data", metavar="DIR",
                   help="prepared data folder ('tinylm prepare --out', made with the "
                   "model's tokenizer): report validation loss and perplexity before and "
                   "after")
    p.add_argument("--eval-windows", type=int, metavar="N",
                   help="evaluate on at most N windows of the validation split (default: all)")
    p.add_argument("--finetune", type=int, default=0, metavar="STEPS",
                   help="continue training the factorised model for STEPS steps on --data")
    p.add_argument("--lr", type=float, default=None, metavar="LR",
                   help="peak learning rate of --finetune (default: the peak lr the model "
                   "was trained with, from its config.json, else 1e-3)")
    p.add_argument("--batch-size", type=int, default=32, metavar="B",
                   help="sequences per step of --finetune (default: %(default)s)")
    p.add_argument("--fractions", default="0.9,0.75,0.5,0.35,0.25", metavar="P,P,...",
                   help="parameter fractions of --sweep (default: %(default)s)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="with --sweep: write the loss/speed plot (.png, .svg or .pdf)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing checkpoint in --out (never a run folder or a "
                   "folder with other files)")
    _device_flag(p)
    p.set_defaults(func=_cmd_compress)


def _parse_fractions(text: str) -> list[float]:
    from tinylm.core.errors import ConfigError

    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ConfigError(f"--fractions must be comma-separated numbers in (0, 1], got "
                          f"{text!r}; e.g. --fractions 0.9,0.5,0.25") from exc
    bad = [v for v in values if not 0.0 < v <= 1.0]
    if not values or bad:
        raise ConfigError(f"--fractions must be numbers in (0, 1], got {text!r}; e.g. "
                          f"--fractions 0.9,0.5,0.25")
    return values


def _check_compress_flags(args: argparse.Namespace) -> list[str]:
    """Flag combinations of compress (before anything is loaded); returns the layers."""
    from tinylm.core.errors import ConfigError

    mode = (args.rank, args.energy, args.params_fraction)
    if args.sweep:
        if not args.data:
            raise ConfigError("--sweep needs --data DIR to measure the validation loss; pass "
                              "a folder made by 'tinylm prepare'")
    elif all(v is None for v in mode):
        raise ConfigError("choose how much to keep: --rank R, --energy F, --params-fraction P "
                          "(or --sweep)")
    elif not args.out:
        raise ConfigError("--out DIR is missing: where should the compressed checkpoint go?")
    if args.plot and not args.sweep:
        raise ConfigError("--plot draws the --sweep figure; add --sweep or drop --plot")
    if args.finetune < 0 or (args.finetune and not args.data):
        raise ConfigError(f"--finetune {args.finetune} needs a number of steps >= 1 and "
                          f"--data DIR to train on")
    if args.eval_windows is not None and args.eval_windows < 1:
        raise ConfigError(f"--eval-windows must be >= 1, got {args.eval_windows}")
    layers = [name.strip() for name in args.layers.split(",") if name.strip()]
    if not layers:
        raise ConfigError(f"--layers names no layer ({args.layers!r}); e.g. --layers "
                          f"attn.qkv,ffn.up")
    return layers


def _cmd_compress(args: argparse.Namespace) -> int:
    from tinylm.commands.compress import (
        compress_checkpoint,
        format_report,
        format_sweep,
        sweep_checkpoint,
    )

    layers = _check_compress_flags(args)
    common = {"layers": layers, "eval_windows": args.eval_windows, "device": args.device}
    if args.sweep:
        rows, plot = sweep_checkpoint(args.model, args.data, _parse_fractions(args.fractions),
                                      plot=args.plot, **common)
        print(format_sweep(rows))
        if plot is not None:
            print(f"plot: {plot}")
        return 0
    mode = {k: v for k, v in (("rank", args.rank), ("energy", args.energy),
                              ("params_fraction", args.params_fraction)) if v is not None}
    r = compress_checkpoint(args.model, args.out, mode=mode, data_dir=args.data,
                            finetune_steps=args.finetune, lr=args.lr,
                            batch_size=args.batch_size, force=args.force, **common)
    print(format_report(r.report))
    if r.before is not None and r.after is not None:
        print(f"val loss: {r.before.loss:.4f} -> {r.after.loss:.4f} "
              f"(perplexity {r.before.perplexity:.3f} -> {r.after.perplexity:.3f}, "
              f"{100 * (r.after.loss / r.before.loss - 1):+.1f} %)")
    if r.tuned is not None and r.before is not None:
        print(f"after fine-tuning {r.finetune_steps} steps: val loss {r.tuned.loss:.4f} "
              f"(perplexity {r.tuned.perplexity:.3f}, "
              f"{100 * (r.tuned.loss / r.before.loss - 1):+.1f} % vs the uncompressed model)")
    print(f"file size: {r.bytes_in / 1e6:.2f} MB -> {r.bytes_out / 1e6:.2f} MB "
          f"({100 * (1 - r.bytes_out / r.bytes_in):.1f} % smaller)")
    print(f"wrote {r.dest}")
    return 0


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize",
        help="int8 or packed 4-bit weights (weight-only) for CPU inference, with a report",
        description="Store the chosen Linear layers' weights as int8 integers times float32 "
        "scales, one scale per output channel (default) or per --group-size G input "
        "features; activations stay float32. --bits 4 --group-size 32 stores GGUF's Q4_0 "
        "blocks (Q4_1 with --asymmetric): two weights per byte and an fp16 scale (and "
        "minimum) per 32. Writes a checkpoint that every command loads "
        "without flags ('convert --to-hf' exports it dequantized) and prints per layer the "
        "max and mean error per weight (both over the layer's largest |W|), the whole "
        "matrix's relative error and the bytes before and after; with --data (prepared "
        "with the model's tokenizer) also the validation loss before and after.",
    )
    p.add_argument("--model", required=True, metavar="DIR",
                   help="checkpoint (or training run) folder to quantize")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder for the quantized checkpoint (new or empty; an existing "
                   "checkpoint only with --force)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing checkpoint at --out (never a run folder or a "
                   "folder with other files)")
    p.add_argument("--bits", type=int, default=8, metavar="B",
                   help="bits per weight, 2-8, stored in int8, except 4 with --group-size "
                   "32: packed two per byte as GGUF's Q4_0 (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=None, metavar="G",
                   help="one scale per G consecutive input features (default: one per "
                   "output channel)")
    p.add_argument("--asymmetric", action="store_true",
                   help="with --bits 4 --group-size 32: a scale and a minimum per group "
                   "(GGUF's Q4_1) instead of a scale (Q4_0)")
    p.add_argument("--layers", default=None, metavar="NAMES",
                   help="comma-separated layer names or suffixes, e.g. attn.qkv,ffn.up "
                   "(default: every Linear layer of the blocks)")
    p.add_argument("--include-head", action="store_true",
                   help="quantize the LM head too (an untied one; a tied head is the "
                   "token embedding and stays float32)")
    p.add_argument("--data", metavar="DIR",
                   help="prepared data folder ('tinylm prepare --out', made with the "
                   "model's tokenizer): report validation loss and perplexity before and "
                   "after")
    p.add_argument("--eval-windows", type=int, metavar="N",
                   help="evaluate on at most N windows of the validation split (default: all)")
    _threads_flag(p)
    p.set_defaults(func=_cmd_quantize)


def _cmd_quantize(args: argparse.Namespace) -> int:
    from tinylm.commands.quantize import format_report, quantize_checkpoint
    from tinylm.core.errors import ConfigError

    layers = None
    if args.layers is not None:
        layers = [name.strip() for name in args.layers.split(",") if name.strip()]
        if not layers:
            raise ConfigError(f"--layers names no layer ({args.layers!r}); e.g. --layers "
                              f"attn.qkv,ffn.up")
    report, dest = quantize_checkpoint(
        args.model, args.out, bits=args.bits, group_size=args.group_size, layers=layers,
        include_head=args.include_head, data_dir=args.data, eval_windows=args.eval_windows,
        force=args.force, asymmetric=args.asymmetric)
    print(format_report(report))
    print(f"wrote {dest}")
    return 0


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="GGUF file or Hugging Face model -> tinylm checkpoint, and tinylm -> Hugging "
        "Face or GGUF",
        description="--from-gguf FILE --out DIR: a GGUF file (llama.cpp's format; llama, qwen2, "
        "qwen3 and gpt2 architectures; F32/F16/BF16, Q8_0, Q4_0/1, Q5_0/1, Q4_K/Q5_K/Q6_K "
        "tensors) with its tokenizer and chat template -> a tinylm checkpoint. --from-hf "
        "HF_DIR|ORG/NAME --out DIR: a Hugging Face GPT-2, Llama, Qwen2 or Mistral folder "
        "on disk (config.json, model.safetensors or pytorch_model.bin, tokenizer.json and "
        "tokenizer_config.json when present), or a Hub name fetched through huggingface_hub "
        "(safetensors and configs only; its cache alone with HF_HUB_OFFLINE=1) -> a tinylm "
        "checkpoint. --model DIR --to-hf HF_DIR: a tinylm checkpoint -> a folder that "
        "transformers' AutoModelForCausalLM and AutoTokenizer load (GPT-2, Llama or Qwen2, "
        "from the architecture). --to-gguf DIR --out FILE.gguf [--type T]: a tinylm "
        "checkpoint with its tokenizer and chat template -> a GGUF file llama.cpp runs "
        "(gpt2, llama, qwen2 or qwen3 from the architecture; byte-level BPE and char "
        "tokenizers). Every command's --model also takes a .gguf file directly.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--from-gguf", metavar="FILE", help="a GGUF file to import")
    src.add_argument("--from-hf", metavar="HF_DIR|ORG/NAME",
                     help="a Hugging Face GPT-2/Llama/Qwen2/Mistral folder (or Hub name) to "
                     "import; a GGUF file here is converted as --from-gguf would")
    src.add_argument("--to-gguf", metavar="DIR",
                     help="a tinylm checkpoint (or run folder) to write as the GGUF file "
                     "--out FILE.gguf")
    p.add_argument("--out", metavar="DIR|FILE",
                   help="the tinylm checkpoint to write (--from-gguf/--from-hf; a new or "
                   "empty folder), or the GGUF file (--to-gguf; a new name ending in .gguf)")
    p.add_argument("--type", default="f32", metavar="TYPE",
                   help="--to-gguf: the type of the weight matrices, f32, f16, q8_0 or q4_0 "
                   "(norms and biases stay f32) (default: %(default)s)")
    p.add_argument("--keep-quantized", action="store_true",
                   help="--from-gguf: keep the blocks' Q8_0/Q4_0/Q4_1 weights as tinylm "
                   "quantized layers (exactly the same function; less memory) instead of "
                   "dequantizing every tensor to float32")
    p.add_argument("--force", action="store_true",
                   help="--from-gguf/--from-hf: replace an existing tinylm checkpoint in "
                   "--out (never a folder holding other files); --to-gguf: replace an "
                   "existing GGUF file --out")
    p.add_argument("--model", metavar="DIR", help="a tinylm checkpoint to export")
    p.add_argument("--to-hf", metavar="HF_DIR",
                   help="the Hugging Face folder to write (--model); must not exist or be empty")
    p.add_argument("--weights-only", action="store_true",
                   help="--to-hf: export the model without its tokenizer (needed for char "
                   "tokenizers, which have no GPT-2 equivalent)")
    p.set_defaults(func=_cmd_convert)


def _cmd_convert(args: argparse.Namespace) -> int:
    from tinylm.commands.convert import export_model, import_model
    from tinylm.core.errors import ConfigError

    if args.to_gguf is not None:
        return _convert_to_gguf(args)
    if args.type != "f32":
        raise ConfigError("--type applies to --to-gguf only")
    source = args.from_gguf or args.from_hf
    importing = source is not None or args.out is not None
    exporting = args.model is not None or args.to_hf is not None
    if importing == exporting or (importing and not (source and args.out)) or (
            exporting and not (args.model and args.to_hf)):
        raise ConfigError("use either --from-gguf FILE or --from-hf HF_DIR with --out DIR "
                          "(import), or --model DIR --to-hf HF_DIR, or --to-gguf DIR --out "
                          "FILE.gguf (export)")
    if importing:
        if args.weights_only:
            raise ConfigError("--weights-only applies to --to-hf only")
        if args.from_gguf is not None and not args.from_gguf.lower().endswith(".gguf"):
            raise ConfigError(f"--from-gguf {args.from_gguf}: a GGUF file's name ends in "
                              f".gguf; for a Hugging Face folder use --from-hf")
        if args.keep_quantized and args.from_gguf is None:
            raise ConfigError("--keep-quantized applies to --from-gguf only")
        print(import_model(source, args.out, keep_quantized=args.keep_quantized,
                           force=args.force).line())
    else:
        if args.keep_quantized:
            raise ConfigError("--keep-quantized applies to --from-gguf only")
        print(export_model(args.model, args.to_hf, weights_only=args.weights_only))
    return 0


def _convert_to_gguf(args: argparse.Namespace) -> int:
    from tinylm.commands.convert import export_gguf
    from tinylm.core.errors import ConfigError

    if args.out is None:
        raise ConfigError("--to-gguf DIR needs --out FILE.gguf: where should the GGUF file go?")
    wrong = [flag for flag, given in (("--model", args.model), ("--to-hf", args.to_hf),
                                      ("--keep-quantized", args.keep_quantized),
                                      ("--weights-only", args.weights_only)) if given]
    if wrong:
        raise ConfigError(f"{wrong[0]} does not apply to --to-gguf (use --to-gguf DIR --out "
                          f"FILE.gguf [--type T] [--force])")
    print(export_gguf(args.to_gguf, args.out, type=args.type, force=args.force))
    return 0
