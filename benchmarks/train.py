"""Training-step throughput, peak memory and MFU: tinylm vs nanoGPT's model vs Hugging Face
GPT-2, each eager and under ``torch.compile``, in one run.

    python benchmarks/train.py [--repeats 15] [--steps 10] [--threads N] [--no-write]
        [--shapes 4x128,6x384] [--skip-memory]
    python benchmarks/train.py --profile 4x128:12    # where tinylm's step goes
    python benchmarks/train.py --scaling 4x128:12    # what the cores could give beyond
                                                     # torch's intra-op threads
    python benchmarks/train.py --heap 4x128:12       # the kept heap against glibc's own

For each shape the three models are built with the same weights (nanoGPT's model by
``benchmarks/nanogpt.from_tinylm``, HF's by ``tinylm.io.hf.to_hf``), all in train mode with
dropout 0, fp32, the same thread count, the same batches and the same optimizer
(``torch.optim.AdamW(fused=True)`` as tinylm trains, identical settings). One step is
zero_grad (set_to_none) + forward + mean cross-entropy over all B·C positions + backward +
optimizer step. tinylm runs with its fast paths (``tinylm.native.accelerate``, as
``tinylm train`` applies them; its heap setting, ``tinylm.training.heap``, is the
process's, so in this one process every model runs with it); compiled, each model's
loss function (forward + loss) is ``torch.compile``d with default settings -- tinylm's
through its plan (``Plan.compile``, what ``tinylm train --compile`` uses: its native
kernels as custom ops inside the graph) -- and its first step (the compile warm-up) is
timed apart. Timings alternate the six (model, mode) variants block by block so machine
noise hits all alike; the figure is the median step time over the repeats after warm-up.

Peak memory is measured per (model, shape, batch) in a fresh subprocess each: the peak
resident set size (VmHWM) during two training steps minus the RSS just before the
model is built (so imported libraries do not count). MFU is model FLOPs per second
(6·N per token for the matmul weights plus 12·L·C·E per token for attention, as in
nanoGPT/PaLM) divided by the fp32 matmul rate measured at the start and end of the run.

The vocabulary is 65 (the character vocabulary of tiny Shakespeare): both shapes are the
nanoGPT shakespeare_char configurations this project trains on a CPU.
The table is printed and written to BENCHMARKS.md between ``<!-- bench:train -->`` markers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nanogpt  # noqa: E402
from report import write_section  # noqa: E402
from tinylm import native  # noqa: E402
from tinylm.core.config import ModelConfig  # noqa: E402
from tinylm.core.model import GPT  # noqa: E402
from tinylm.native import gemm  # noqa: E402
from tinylm.training import heap  # noqa: E402

VOCAB = 65
# name -> (n_layer, n_head, n_embd, context_length)
SHAPES = {"4x128": (4, 4, 128, 64), "6x384": (6, 6, 384, 256)}
THROUGHPUT = [("4x128", 12), ("6x384", 8)]
MEMORY = [("4x128", 12), ("6x384", 8), ("6x384", 64)]
# The same for both models: torch's fused AdamW, as tinylm.training.loop uses on CPU.
OPTIMIZER = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def model_config(shape: str) -> ModelConfig:
    n_layer, n_head, n_embd, context = SHAPES[shape]
    return ModelConfig(vocab_size=VOCAB, context_length=context, n_layer=n_layer,
                       n_head=n_head, n_embd=n_embd, dropout=0.0)


MODELS = ("tinylm", "nanogpt", "hf")
MODES = ("eager", "compiled")
NAMES = {"tinylm": "tinylm", "nanogpt": "nanoGPT", "hf": "HF GPT-2"}


def build(kind: str, config: ModelConfig, *, same_as: GPT | None = None,
          compiled: bool = False):
    """A model in train mode and its ``step(x, y) -> loss`` closure (optimizer included);
    ``same_as``: a tinylm model whose weights it copies; ``compiled``: the loss function
    (forward + loss) under torch.compile."""
    if kind == "tinylm":
        model = GPT(config)
        if same_as is not None:
            model.load_state_dict(same_as.state_dict())
        plan = native.accelerate(model, "cpu")  # the fast paths, as tinylm.training applies them
        heap.keep_freed_memory()  # and its heap setting (for the whole process)

        def loss_fn(x, y):
            return model.loss(x, y)
        compile_fn = plan.compile  # tinylm train --compile: the plan decides the graph
    elif kind == "nanogpt":
        model = nanogpt.from_tinylm(same_as if same_as is not None else GPT(config))

        def loss_fn(x, y):
            return model(x, y)[1]  # nanoGPT's forward computes its loss
        compile_fn = torch.compile
    else:
        from tinylm.io.hf import to_hf

        model = to_hf(same_as if same_as is not None else GPT(config))

        def loss_fn(x, y):  # the same objective: mean CE of row t against y[:, t]
            logits = model(input_ids=x, use_cache=False).logits  # (B, C, V)
            return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        compile_fn = torch.compile
    if compiled:
        loss_fn = compile_fn(loss_fn)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), **OPTIMIZER)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(x, y)
        loss.backward()
        opt.step()
        return loss

    step.loss_fn = loss_fn
    return model, step


def batch(config: ModelConfig, B: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (B, config.context_length + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()  # ids (B, C), targets (B, C)


def matmul_rate(sizes: tuple[int, ...] = (512, 1024, 2048), seconds: float = 0.5) -> float:
    """Best observed fp32 GEMM rate (FLOP/s) of this machine at the current thread count,
    over square sizes and the three GEMMs tinylm.native.gemm chooses from (torch's mm,
    i.e. MKL; oneDNN's linear; tinylm's own kernel), each timed for about ``seconds``,
    best of 5 blocks."""
    best_rate = 0.0
    lib = native.load()
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        products = [lambda a=a, b=b: a @ b]
        if gemm._available():
            products.append(lambda a=a, b=b: torch.ops.mkldnn._linear_pointwise(
                a, b, None, "none", [], ""))
        if lib is not None:
            products.append(lambda a=a, b=b: lib.matmul(a, b))
        for product in products:
            product()
            t = time.perf_counter()
            product()
            reps = max(1, int(seconds / 5 / max(time.perf_counter() - t, 1e-6)))
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(reps):
                    product()
                best_rate = max(best_rate, 2 * n**3 * reps / (time.perf_counter() - t))
    return best_rate


def flops_per_token(model: GPT) -> float:
    c = model.config
    n = model.num_parameters() - model.pos_emb.weight.numel()  # weights used in matmuls
    return 6 * n + 12 * c.n_layer * c.context_length * c.inner_dim


def throughput(shape: str, B: int, repeats: int, steps: int, block_s: float = 1.0) -> dict:
    """Median step time of the six (model, mode) variants, in alternating blocks of up to
    ``steps`` steps (fewer when the slowest step is long, so a block lasts about
    ``block_s`` seconds); each compiled variant's first step (its warm-up) timed apart."""
    config = model_config(shape)
    torch.manual_seed(0)
    ref = GPT(config)  # the weights every variant starts from
    x, y = batch(config, B)
    variants, warmup = {}, {}
    for kind in MODELS:
        for mode in MODES:
            model, step = build(kind, config, same_as=ref, compiled=mode == "compiled")
            with torch.no_grad():  # same weights, same function: the losses must agree
                loss = step.loss_fn(x, y) if mode == "eager" else None
            t = time.perf_counter()
            first = step(x, y)  # compiled: tracing + code generation (or the cache)
            warmup[f"{kind}_{mode}"] = time.perf_counter() - t
            check = loss if loss is not None else first
            with torch.no_grad():
                expected = ref.loss(x, y)
            # nanoGPT's exact GELU against tinylm's and HF's tanh GELU: ~1e-4
            assert torch.allclose(check, expected, atol=1e-3), (kind, mode, check, expected)
            variants[f"{kind}_{mode}"] = step
    times: dict[str, list[float]] = {name: [] for name in variants}
    slowest = 0.0
    for step in variants.values():  # a second warm-up step each; the slowest sets the block
        t = time.perf_counter()
        step(x, y)
        slowest = max(slowest, time.perf_counter() - t)
    steps = max(1, min(steps, round(block_s / slowest)))
    for _ in range(repeats):
        for name, step in variants.items():
            t = time.perf_counter()
            for _ in range(steps):
                step(x, y)
            times[name].append((time.perf_counter() - t) / steps)
    tokens = B * config.context_length
    out = {"shape": shape, "B": B, "tokens_per_step": tokens,
           "flops_per_step": flops_per_token(ref) * tokens, "load": os.getloadavg()[0]}
    for name in times:
        out[f"{name}_step_s"] = statistics.median(times[name])
        out[f"{name}_tok_s"] = tokens / out[f"{name}_step_s"]
        out[f"{name}_first_s"] = warmup[name]
        out[f"{name}_rounds_s"] = times[name]  # per round, for the paired ratios
    return out


def paired(r: dict, a: str, b: str) -> str:
    """Speed of variant ``a`` over ``b`` (b's step time ÷ a's) in each round, where both
    ran within seconds of each other: the median, and the middle half of the rounds."""
    ratios = sorted(tb / ta for ta, tb in zip(r[f"{a}_rounds_s"], r[f"{b}_rounds_s"],
                                              strict=True))
    n = len(ratios)
    lo, hi = ratios[n // 4], ratios[(3 * n - 1) // 4]
    return f"{statistics.median(ratios):.2f}× ({lo:.2f}–{hi:.2f})"


#: What a profiled op's self time is counted as (the rest: "other").
GEMMS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm",
         "mkldnn::_linear_pointwise",  # oneDNN's products (tinylm.native.gemm)
         "tinylm::matmul")  # tinylm's kernel (csrc/gemm.c), marked by _timed_matmul
NATIVE = ("BlockFn", "BlockFnBackward", "VariantBlockFn", "VariantBlockFnBackward",
          "tinylm::block", "tinylm::block_backward", "tinylm::variant_block",
          "tinylm::variant_block_backward")  # ctypes kernels + their Python, in these ranges


@contextlib.contextmanager
def _timed_matmul():
    """tinylm's kernel is a ctypes call the profiler does not see: within this block each
    product is a ``tinylm::matmul`` range, and the blocks run composed kernel by kernel
    (functions.composed_blocks), so that no product hides inside one native call."""
    from torch.profiler import record_function

    from tinylm.native import functions, ops

    lib = ops.load()
    real = lib.matmul

    def matmul(*args, **kwargs):
        with record_function("tinylm::matmul"):
            return real(*args, **kwargs)
    lib.matmul = matmul
    try:
        with functions.composed_blocks():
            yield
    finally:
        lib.matmul = real


def profile(shape: str, B: int, rate: float, steps: int = 5) -> str:
    """Where tinylm's step goes (torch.profiler, self times per step), eager and compiled:
    the GEMMs, the native kernels (the time inside tinylm's block steps that is not a
    GEMM), the optimizer and the rest; and the ceiling it implies (a step of the GEMMs
    alone, and at the measured matmul rate). The blocks run composed kernel by kernel
    (:func:`_timed_matmul`), a little slower than the one native call they make where
    every product is on tinylm's kernel."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    config = model_config(shape)
    torch.manual_seed(0)
    ref = GPT(config)
    x, y = batch(config, B)
    flops = flops_per_token(ref) * B * config.context_length
    lines = [f"Profile of tinylm's {shape} B={B} step (self CPU time per step, "
             f"torch.profiler, mean of {steps} steps):", "",
             "| mode | step ms | GEMMs ms | native kernels ms | AdamW ms | other ms | "
             "GEMM share | step at GEMMs only | GEMMs at the matmul rate |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        _model, step = build("tinylm", config, same_as=ref, compiled=mode == "compiled")
        for _ in range(3):
            step(x, y)
        t = time.perf_counter()
        with _timed_matmul(), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step(x, y)
        wall = (time.perf_counter() - t) / steps
        cat = {"gemm": 0.0, "native": 0.0, "adamw": 0.0, "other": 0.0}
        for e in prof.key_averages():
            kind = "gemm" if e.key in GEMMS else "native" if e.key in NATIVE else \
                "adamw" if e.key == "aten::_fused_adamw_" else "other"
            cat[kind] += e.self_cpu_time_total / 1e6 / steps  # s per step
        total = sum(cat.values())
        lines.append(f"| {mode} | {total * 1e3:.1f} (wall {wall * 1e3:.1f}) | "
                     f"{cat['gemm'] * 1e3:.1f} | {cat['native'] * 1e3:.1f} | "
                     f"{cat['adamw'] * 1e3:.1f} | {cat['other'] * 1e3:.1f} | "
                     f"{cat['gemm'] / total:.0%} | {total / cat['gemm']:.2f}× faster | "
                     f"{total / (flops / rate):.2f}× faster |")
    return "\n".join(lines)


#: --scaling's rows: (model, mode) of train.py's variants.
SCALING = (("tinylm", "eager"), ("tinylm", "compiled"), ("nanogpt", "compiled"))


def scaling_child(kind: str, mode: str, shape: str, B: int, threads: int,
                  seconds: float) -> None:
    """Run in a fresh process: warm up, say "ready", read the wall-clock start time from
    stdin, then train steps from then until ``seconds`` later; print JSON with the
    steps and the time they took."""
    torch.set_num_threads(threads)
    config = model_config(shape)
    x, y = batch(config, B)
    _model, step = build(kind, config, compiled=mode == "compiled")
    for _ in range(3):
        step(x, y)
    print("ready", flush=True)
    start = float(sys.stdin.readline())
    while time.time() < start:
        time.sleep(0.001)
    n, t = 0, time.perf_counter()
    while time.time() < start + seconds:
        step(x, y)
        n += 1
    print(json.dumps({"steps": n, "seconds": time.perf_counter() - t}), flush=True)


def _scaling_run(kind: str, mode: str, shape: str, parts: list[tuple[int, int]],
                 seconds: float) -> float:
    """Tokens/s of the processes ``parts`` ((batch, threads) each) training at once:
    each is started and warmed up, then all begin together."""
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--scaling-child", kind, mode, shape, str(b),
         "--threads", str(th), "--seconds", str(seconds)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for b, th in parts]
    for proc in procs:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"--scaling-child {kind} {mode} failed before its steps")
    start = time.time() + 0.5
    for proc in procs:
        proc.stdin.write(f"{start!r}\n")
        proc.stdin.flush()
    context = SHAPES[shape][3]
    total = 0.0
    for (b, _th), proc in zip(parts, procs, strict=True):
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"--scaling-child {kind} {mode} failed")
        got = json.loads(out.strip().splitlines()[-1])
        total += got["steps"] * b * context / got["seconds"]
    return total


def scaling(shape: str, B: int, threads: int, rounds: int = 3, seconds: float = 6.0
            ) -> str:
    """Can the cores do more than torch's intra-op threads get from them? For each model,
    tokens/s of one process at 1 thread, one at ``threads`` threads (the benchmark's
    setting), and ``threads`` processes at 1 thread each on B/threads rows, training at
    the same time (data parallel without any communication: the most a split of the
    batch over the cores could give). Each process runs as its tool does: tinylm's with
    its heap setting (``build``), the others with glibc's defaults. Medians over
    ``rounds`` alternated rounds."""
    if B % threads:
        raise SystemExit(f"--scaling: B={B} does not split over {threads} threads")
    setups = {"1 thread": [(B, 1)], f"{threads} threads": [(B, threads)],
              f"{threads} processes × 1 thread, B={B // threads} each":
                  [(B // threads, 1)] * threads}
    got: dict[tuple, list[float]] = {}
    for _ in range(rounds):
        for kind, mode in SCALING:
            for name, parts in setups.items():
                got.setdefault((kind, mode, name), []).append(
                    _scaling_run(kind, mode, shape, parts, seconds))
    names = list(setups)
    lines = [f"Scaling of the {shape} B={B} training step over {threads} cores (tokens/s, "
             f"median of {rounds} rounds of {seconds:.0f} s each; every process alone with "
             f"its model, tinylm's with tinylm train's heap setting):", "",
             "| model | " + " | ".join(names) + f" | {names[1]} ÷ 1 thread | "
             f"{names[2].split(',')[0]} ÷ {names[1]} |", "|---" * (len(names) + 3) + "|"]
    for kind, mode in SCALING:
        tok = [statistics.median(got[(kind, mode, n)]) for n in names]
        lines.append(f"| {NAMES[kind]} {mode} | " + " | ".join(f"{t:,.0f}" for t in tok)
                     + f" | {tok[1] / tok[0]:.2f}× | {tok[2] / tok[1]:.2f}× |")
    return "\n".join(lines)


def heap_ab(shape: str, B: int, rounds: int = 12, steps: int = 10) -> str:
    """What tinylm.training.heap's setting saves: tinylm's step (eager, compiled) with
    glibc's trim threshold at its default (128 KiB: the heap handed back at the end of a
    step) and at the kept setting, alternated block by block in this process (the mmap
    threshold fixed at 32 MiB in both, as keep_freed_memory leaves it); step time and
    page faults per step, and the paired ratio."""
    import resource

    settings = {"glibc default (trim 128 KiB)": 128 * 1024, "kept (trim 2 GiB)": heap.KEPT_TRIM}
    config = model_config(shape)
    torch.manual_seed(0)
    ref = GPT(config)
    x, y = batch(config, B)
    lines = [f"Heap setting A/B, tinylm's {shape} B={B} step ({rounds} alternated blocks of "
             f"{steps} steps):", "", "| mode | trim threshold | step ms | page faults per step |"
             " default ÷ kept (paired) |", "|---|---|---|---|---|"]
    for mode in MODES:
        _model, step = build("tinylm", config, same_as=ref, compiled=mode == "compiled")
        times: dict[str, list[float]] = {k: [] for k in settings}
        faults: dict[str, list[float]] = {k: [] for k in settings}
        for _ in range(rounds):
            for name, threshold in settings.items():
                heap.mallopt(heap.M_TRIM_THRESHOLD, threshold)
                step(x, y)  # the step that frees under the new setting
                f0, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
                for _ in range(steps):
                    step(x, y)
                times[name].append((time.perf_counter() - t) / steps)
                faults[name].append(
                    (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps)
        default, kept = settings
        ratio = statistics.median(a / b for a, b in zip(times[default], times[kept],
                                                          strict=True))
        for name in settings:
            lines.append(f"| {mode} | {name} | {statistics.median(times[name]) * 1e3:.1f} | "
                         f"{statistics.median(faults[name]):,.0f} | "
                         + (f"**{ratio:.2f}×** |" if name == kept else "|"))
    heap.mallopt(heap.M_TRIM_THRESHOLD, heap.KEPT_TRIM)
    return "\n".join(lines)


def _status_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process; unlike ru_maxrss, VmHWM starts afresh
    at exec, so a child does not inherit its parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB -> bytes
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(kind: str, shape: str, B: int, threads: int) -> None:
    """Run in a fresh process: print JSON with the RSS before build and the peak after."""
    torch.set_num_threads(threads)
    if kind == "hf":
        import transformers  # noqa: F401  (imported before the baseline, like torch)
    config = model_config(shape)
    x, y = batch(config, B)
    before = _status_bytes("VmRSS")
    _model, step = build(kind, config)
    for _ in range(2):  # the second step holds activations and the AdamW moments
        step(x, y)
    peak = _status_bytes("VmHWM")
    print(json.dumps({"before": before, "peak": peak}))


def memory(kind: str, shape: str, B: int, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--memory-child", kind, shape, str(B),
           "--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def render(rate: float, rows: list[dict], mem: list[dict], threads: int, command: str
           ) -> str:
    import transformers

    lines = [
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{threads} threads, fp32. Measured fp32 matmul rate (best square GEMM of torch's "
        f"mm, oneDNN's linear and tinylm's kernel, measured before and after the timings): "
        f"**{rate / 1e9:.1f} GFLOP/s**. Load average (1 min) at the end of each shape: "
        + ", ".join(f"{r['shape']} {r['load']:.1f}" for r in rows) + ".",
        "",
        f"Vocabulary {VOCAB} (tiny Shakespeare characters). Same weights, fused AdamW "
        f"(lr 3e-4, betas 0.9/0.95, wd 0.1) for all, dropout 0, train mode; nanoGPT's model "
        f"as in its model.py (SDPA attention, exact GELU); HF GPT-2 with its default "
        f"attention implementation. Compiled: `torch.compile` of each loss function "
        f"(forward + loss), default settings; tinylm's through its plan (native kernels "
        f"as custom ops in the graph). tinylm train's heap setting (freed memory kept in "
        f"the process, tinylm.training.heap) is the process's, so every model here runs "
        f"with it (`--scaling` runs each in its own process). Median step time after "
        f"warm-up; MFU = model "
        f"FLOPs/s ÷ matmul rate; warm-up = the first compiled step (tracing and code "
        f"generation, or inductor's cache).",
        "",
        "| shape (L×E, C) | B | model | eager tok/s | compiled tok/s | compiled ÷ eager | "
        "eager MFU | compiled MFU | compile warm-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n_layer, _h, n_embd, ctx = SHAPES[r["shape"]]
        for kind in MODELS:
            e, c = r[f"{kind}_eager_step_s"], r[f"{kind}_compiled_step_s"]
            lines.append(
                f"| {n_layer}×{n_embd}, C={ctx} | {r['B']} | {NAMES[kind]} | "
                f"{r[f'{kind}_eager_tok_s']:,.0f} | {r[f'{kind}_compiled_tok_s']:,.0f} | "
                f"{e / c:.2f}× | {r['flops_per_step'] / e / rate:.0%} | "
                f"{r['flops_per_step'] / c / rate:.0%} | "
                f"{r[f'{kind}_compiled_first_s']:.0f} s |")
    pairs = (("tinylm_compiled", "nanogpt_compiled"), ("tinylm_compiled", "tinylm_eager"),
             ("tinylm_compiled", "hf_compiled"), ("tinylm_eager", "nanogpt_eager"),
             ("tinylm_eager", "hf_eager"), ("tinylm_eager", "nanogpt_compiled"))
    lines += ["", "Speed ratios, paired round by round (each round runs every variant within "
              "seconds): the median over the rounds, and in brackets the middle half of "
              "them.", "",
              "| shape (L×E, C) | B | tinylm compiled ÷ nanoGPT compiled | "
              "tinylm compiled ÷ tinylm eager | tinylm compiled ÷ HF compiled | "
              "tinylm eager ÷ nanoGPT eager | tinylm eager ÷ HF eager | "
              "tinylm eager ÷ nanoGPT compiled |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n_layer, _h, n_embd, ctx = SHAPES[r["shape"]]
        cells = [paired(r, a, b) for a, b in pairs]
        cells[:2] = [f"**{c}**" for c in cells[:2]]
        lines.append(f"| {n_layer}×{n_embd}, C={ctx} | {r['B']} | " + " | ".join(cells) + " |")
    lines += [] if not mem else [
        "",
        "Peak memory of two training steps (peak RSS minus RSS before the model is "
        "built; fresh process per cell):",
        "",
        "| shape (L×E, C) | B | tinylm MiB | HF MiB | tinylm / HF |",
        "|---|---|---|---|---|",
    ]
    for m in mem:
        n_layer, _h, n_embd, ctx = SHAPES[m["shape"]]
        lines.append(f"| {n_layer}×{n_embd}, C={ctx} | {m['B']} | {m['tinylm'] / 2**20:,.0f} | "
                     f"{m['hf'] / 2**20:,.0f} | **{m['tinylm'] / m['hf']:.2f}×** |")
    lines += ["", f"Command: `{command}`"]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed blocks per model")
    parser.add_argument("--steps", type=int, default=10, help="most steps per timed block")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--shapes", default=",".join(f"{s}:{b}" for s, b in THROUGHPUT),
                        help="SHAPE:B,... of the throughput table (default: %(default)s)")
    parser.add_argument("--memory-child", nargs=3, metavar=("KIND", "SHAPE", "B"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--profile", metavar="SHAPE:B",
                        help="print where tinylm's step goes (eager, compiled) and exit")
    parser.add_argument("--scaling", metavar="SHAPE:B",
                        help="print the step's tokens/s at 1 thread, at --threads, and as "
                             "--threads one-thread processes on B/threads rows each; exit")
    parser.add_argument("--heap", metavar="SHAPE:B",
                        help="print tinylm's step with glibc's default heap trimming and "
                             "with tinylm train's kept heap, alternated; exit")
    parser.add_argument("--scaling-child", nargs=4, metavar=("KIND", "MODE", "SHAPE", "B"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=6.0, help=argparse.SUPPRESS)
    return parser


def _shape_b(text: str) -> tuple[str, int]:
    """"SHAPE:B" -> (shape, B)."""
    shape, B = text.split(":")
    return shape, int(B)


def _probe(args: argparse.Namespace) -> str | None:
    """The printout of a one-off measurement the flags ask for (None: the tables' run)."""
    if args.profile:
        return profile(*_shape_b(args.profile), matmul_rate())
    if args.heap:
        if not heap.keep_freed_memory():
            raise SystemExit("--heap: needs glibc and TINYLM_HEAP unset (or keep)")
        return heap_ab(*_shape_b(args.heap))
    if args.scaling:
        return scaling(*_shape_b(args.scaling), args.threads)
    return None


def _tables(args: argparse.Namespace) -> str:
    """The throughput rows and the memory cells, rendered."""
    heap.keep_freed_memory()  # tinylm train's setting, for every model of this one process
    torch.manual_seed(0)
    rate = matmul_rate()
    rows = []
    for item in args.shapes.split(","):
        rows.append(throughput(*_shape_b(item), args.repeats, args.steps))
        print(json.dumps(rows[-1]), file=sys.stderr)
    rate = max(rate, matmul_rate())
    mem = []
    if not args.skip_memory:
        for shape, B in MEMORY:
            cell = {"shape": shape, "B": B}
            for kind in ("tinylm", "hf"):
                m = memory(kind, shape, B, args.threads)
                cell[kind] = m["peak"] - m["before"]
            mem.append(cell)
            print(json.dumps(cell), file=sys.stderr)
    command = " ".join(["python benchmarks/train.py",
                        *(a for a in sys.argv[1:] if a != "--no-write")])
    return render(rate, rows, mem, args.threads, command)


def main() -> None:
    args = _parser().parse_args()
    if args.scaling_child:
        kind, mode, shape, B = args.scaling_child
        scaling_child(kind, mode, shape, int(B), args.threads, args.seconds)
        return
    if args.memory_child:
        kind, shape, B = args.memory_child
        memory_child(kind, shape, int(B), args.threads)
        return
    torch.set_num_threads(args.threads)
    probe = _probe(args)
    if probe is not None:
        print(probe)
        return
    table = _tables(args)
    print(table)
    if not args.no_write:
        write_section("train", "Training throughput", table)


if __name__ == "__main__":
    main()
