"""Configuration as frozen, validated dataclasses.

Configs are checked on construction so a bad value fails early with a message that
names the field and the fix. They travel as JSON inside checkpoints (never pickle)
and can be read from TOML files by the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tinylm.core.checks import check_fraction, check_int, check_positive, is_int
from tinylm.core.display import display_name
from tinylm.core.errors import ConfigError

#: The largest integer any field of a config accepts (sizes are int32 in every kernel and
#: file format tinylm writes; counters and seeds are int64), and tighter bounds on sizes
#: that no real model reaches (the deepest published models have ~100 blocks): a value
#: past these is a typo or a hostile file, refused before anything is allocated.
_INT_MAX = {"ModelConfig": 2**31 - 1}
_INT64_MAX = 2**63 - 1
_PLAUSIBLE_MAX = {"n_layer": 10_000}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_plausible(kind: str, data: dict[str, Any]) -> None:
    """Every integer value of ``data`` within the limits above (generic over fields)."""
    limit = _INT_MAX.get(kind, _INT64_MAX)
    for name, value in data.items():
        if not is_int(value):
            continue
        bound = min(limit, _PLAUSIBLE_MAX.get(name, limit)) if kind == "ModelConfig" else limit
        if abs(value) > bound:
            shown = display_name(str(name))
            raise ConfigError(f"{shown} = {_short(value)} is not a plausible value (at most "
                              f"{bound:,}); fix {shown} in the config")


class _JSONMixin:
    """to_dict/from_dict/JSON for frozen dataclasses, rejecting unknown keys."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[arg-type]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        if not isinstance(data, dict):
            raise ConfigError(f"a {cls.__name__} must be a JSON object / TOML table of "
                              f"fields, got {type(data).__name__} {_short(data)}")
        _check_plausible(cls.__name__, data)
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(display_name(str(k)) for k in set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown {cls.__name__} field(s) {', '.join(unknown[:8])}"
                f"{f' and {len(unknown) - 8} more' if len(unknown) > 8 else ''}; "
                f"known fields are {', '.join(sorted(known))}"
            )
        return cls(**data)

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True)
class ModelConfig(_JSONMixin):
    """Shape of a GPT model, in the seed's letters.

    vocab_size      V, rows of the token embedding and columns of the LM head
    context_length  C, the longest sequence the positional embedding covers
    n_layer         number of stacked Attention+FFN blocks
    n_head          H, attention heads per block
    n_embd          E, the embedding (residual stream) width
    head_dim        D, query/key/value width per head; defaults to E // H
    dropout         dropout probability used in training
    bias            biases in Linear layers and LayerNorms (GPT-2 has them)
    tie_embeddings  the LM head shares the token embedding matrix (GPT-2 does)
    norm_eps        epsilon of every LayerNorm/RMSNorm (GPT-2 uses 1e-5); old
                    checkpoints spell it ``layer_norm_eps``
    norm            ``layernorm`` (GPT-2) or ``rmsnorm`` (Llama: no mean, no bias)
    position        ``learned`` (a (C, E) table added to the embeddings, GPT-2) or
                    ``rope`` (rotary: queries and keys rotated by position, no table)
    rope_theta      RoPE base θ: pair i of a head turns by angle m·θ^(-2i/D)
    mlp             ``gelu`` (GPT-2), ``swiglu`` (Llama: gated SiLU) or ``relu2``
                    (squared ReLU, modded-nanogpt/nanochat)
    ffn_hidden      hidden width of the MLP; default 4·E, and for swiglu 8·E/3
                    rounded up to a multiple of 8 (about as many weights as 4·E)
    n_kv_head       key/value heads: n_head (default) is multi-head attention, fewer is
                    grouped-query (each K/V head serves n_head / n_kv_head query heads),
                    1 is multi-query
    qk_norm         RMSNorm over each head's query and key before the scores
    qkv_bias        biases on the QKV projection only (Qwen2); defaults to ``bias``

    :attr:`gpt2_layout` says whether the config is plain GPT-2, the layout of the
    native GPT-2 fast paths; the other layouts take the variants' fused training block
    and decoding step (tinylm.native.plan), or the reference modules.
    """

    vocab_size: int = 50257
    context_length: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    head_dim: int | None = None
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    norm: str = "layernorm"
    position: str = "learned"
    rope_theta: float = 10000.0
    mlp: str = "gelu"
    ffn_hidden: int | None = None
    n_kv_head: int | None = None
    qk_norm: bool = False
    qkv_bias: bool | None = None

    def __post_init__(self) -> None:
        check_int("vocab_size", self.vocab_size)
        check_int("context_length", self.context_length)
        check_int("n_layer", self.n_layer)
        check_int("n_head", self.n_head)
        check_int("n_embd", self.n_embd)
        if self.head_dim is None:
            if self.n_embd % self.n_head != 0:
                raise ConfigError(
                    f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}, so the "
                    f"default head_dim (n_embd // n_head) does not fit; choose n_head dividing "
                    f"n_embd or set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        else:
            check_int("head_dim", self.head_dim)
        check_fraction("dropout", self.dropout)
        if not isinstance(self.bias, bool):
            raise ConfigError(f"bias must be true or false, got {self.bias!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        check_positive("norm_eps", self.norm_eps)
        if self.norm_eps == 0:
            raise ConfigError("norm_eps must be > 0 (it keeps the norm's division finite); "
                              "use e.g. 1e-5")
        self._check_variants()

    def _check_variants(self) -> None:
        """The architecture options: each value, and the combinations that cannot work."""
        for name, allowed in (("norm", NORMS), ("position", POSITIONS), ("mlp", MLPS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}; "
                                  f"set --{name} {allowed[0]} (or --arch gpt2|llama|modern)")
        check_positive("rope_theta", self.rope_theta)
        if self.rope_theta == 0:
            raise ConfigError("rope_theta must be > 0 (10000 as in Llama), got 0")
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} is odd, but position=rope rotates pairs "
                              f"of dimensions; choose an even head_dim (or n_embd/n_head) or "
                              f"position=learned")
        if self.ffn_hidden is not None:
            check_int("ffn_hidden", self.ffn_hidden)
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        check_int("n_kv_head", self.n_kv_head)
        if self.n_head % self.n_kv_head:
            raise ConfigError(f"n_kv_head={self.n_kv_head} does not divide n_head={self.n_head}: "
                              f"each key/value head serves n_head / n_kv_head query heads; "
                              f"choose n_kv_head among the divisors of {self.n_head}")
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.bias)
        for name in ("qk_norm", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """As for every config, plus the spelling of checkpoints written before the
        architecture options: ``layer_norm_eps`` is read as ``norm_eps``."""
        if "layer_norm_eps" in data:
            data = dict(data)
            eps = data.pop("layer_norm_eps")
            if "norm_eps" in data and data["norm_eps"] != eps:
                raise ConfigError(f"config has both layer_norm_eps={eps!r} and norm_eps="
                                  f"{data['norm_eps']!r}; keep only norm_eps")
            data["norm_eps"] = eps
        return super().from_dict(data)

    @property
    def layer_norm_eps(self) -> float:
        """The old name of :attr:`norm_eps`."""
        return self.norm_eps

    @property
    def kv_dim(self) -> int:
        """n_kv_head·D, the width of the keys (and of the values)."""
        return self.n_kv_head * self.head_dim  # type: ignore[operator]

    @property
    def gpt2_layout(self) -> bool:
        """Whether this is plain GPT-2 — LayerNorm, learned positions, GELU MLP, full
        multi-head attention, no QK-norm, one bias setting for every layer: the layout of
        the native GPT-2 paths (tinylm.native.plan); the variants have their own."""
        return (self.norm == "layernorm" and self.position == "learned"
                and self.mlp == "gelu" and self.n_kv_head == self.n_head
                and not self.qk_norm and self.qkv_bias == self.bias)

    @property
    def inner_dim(self) -> int:
        """H·D, the width of the concatenated heads."""
        return self.n_head * self.head_dim  # type: ignore[operator]

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the MLP: ``ffn_hidden``, else 4·E (GPT-2), or for swiglu
        8·E/3 rounded up to a multiple of 8 (three matrices instead of two)."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.mlp == "swiglu":
            return _round_up(-(-8 * self.n_embd // 3), 8)
        return 4 * self.n_embd


#: ModelConfig.norm, .position and .mlp values.
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
MLPS = ("gelu", "swiglu", "relu2")

#: ``tinylm train --arch NAME``: the ModelConfig fields each preset fills (explicit
#: flags, --config and a resumed run's saved config override them).
ARCH_PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": {"norm": "layernorm", "position": "learned", "mlp": "gelu", "qk_norm": False,
             "bias": True, "tie_embeddings": True},
    "llama": {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu", "qk_norm": False,
              "bias": False, "tie_embeddings": False},
    "modern": {"norm": "rmsnorm", "position": "rope", "mlp": "relu2", "qk_norm": True,
               "bias": False, "tie_embeddings": False},
}


def resolve_arch(arch: str | None, fields: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields for preset ``arch`` (None: no preset) with ``fields`` on top:
    a field given explicitly always wins over the preset."""
    if arch is None:
        return dict(fields)
    if arch not in ARCH_PRESETS:
        raise ConfigError(f"unknown --arch {arch!r}; choose one of {', '.join(ARCH_PRESETS)}")
    return {**ARCH_PRESETS[arch], **fields}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


#: Optimizers TrainConfig.optimizer accepts (built in tinylm.training.optim.build_optimizer).
OPTIMIZERS = ("adamw", "muon")

#: Multi-process strategies TrainConfig.strategy accepts (applied in tinylm.training.distributed).
STRATEGIES = ("ddp", "fsdp", "zero1")


def _field(default: Any, help: str) -> Any:
    """A dataclass field whose help text the CLI shows for its flag."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TrainConfig(_JSONMixin):
    """How to train: optimizer, schedule, batches, evaluation, checkpoints, device.

    One optimizer step uses ``batch_size * grad_accum * world_size`` windows of C
    tokens (``batch_size`` per process per micro-step). The learning rate warms up
    linearly for ``warmup_steps``, then follows a cosine down to ``lr * min_lr_ratio``
    at ``max_steps`` (or at the step where ``time_budget`` runs out, estimated from
    the measured speed). Every field is a ``tinylm train`` flag (``--batch-size`` ...).
    """

    batch_size: int = _field(32, "sequences per micro-batch per process")
    grad_accum: int = _field(1, "micro-batches accumulated into one optimizer step")
    tokens_per_step: int | None = _field(
        None, "target tokens per optimizer step; sets grad_accum from batch, context "
              "length and world size (leave grad_accum at 1)")
    lr: float = _field(1e-3, "peak learning rate")
    min_lr_ratio: float = _field(0.1, "cosine floor as a fraction of the peak lr")
    warmup_steps: int = _field(100, "linear warm-up steps (0 = none)")
    max_steps: int = _field(2000, "optimizer steps to train")
    time_budget: float | None = _field(
        None, "stop after this many seconds of training; the cosine is stretched over it")
    embedding_lr_ratio: float = _field(
        1.0, "lr multiplier for an untied token embedding (its own table, not the LM "
             "head): such tables learn from sparse lookups only; nanochat trains its at "
             "50x the head's lr")
    weight_decay: float = _field(0.1, "AdamW decoupled weight decay on weight matrices")
    beta1: float = _field(0.9, "AdamW beta1")
    beta2: float = _field(0.95, "AdamW beta2")
    grad_clip: float = _field(1.0, "clip the global gradient norm to this (0 = off)")
    optimizer: str = _field("adamw", f"optimizer: {', '.join(OPTIMIZERS)}")
    strategy: str = _field(
        "ddp", "under torchrun: ddp (replicate everything), zero1 (shard the optimizer "
               "state), fsdp (shard parameters, gradients and optimizer state per block); "
               "zero1/fsdp write sharded checkpoints (also from one process)")
    eval_every: int = _field(250, "evaluate on the validation split every N steps")
    eval_windows: int | None = _field(
        64, "a fixed random sample of this many validation windows for each periodic "
            "estimate (the final evaluation covers the whole split)")
    save_every: int = _field(500, "write OUT/latest every N steps")
    log_every: int = _field(10, "log train loss, lr, tokens/s every N steps")
    seed: int = _field(1337, "seed for init, batches and dropout")
    device: str = _field("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    compile: bool = _field(False, "torch.compile the model (falls back with a warning)")
    plot_log_scale: bool = _field(False, "draw loss.png with a log-scale loss axis")
    threads: int | None = _field(
        None, "CPU threads for torch's kernels (default: the free cores: OMP_NUM_THREADS "
              "if set, else the cores the machine's load leaves free)")

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size)
        check_int("grad_accum", self.grad_accum)
        if self.tokens_per_step is not None:
            check_int("tokens_per_step", self.tokens_per_step)
            if self.grad_accum != 1:
                raise ConfigError(f"set either tokens_per_step ({self.tokens_per_step}) or "
                                  f"grad_accum ({self.grad_accum}), not both")
        check_positive("lr", self.lr)
        check_fraction("min_lr_ratio", self.min_lr_ratio, high_open=False)
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        check_int("max_steps", self.max_steps)
        if self.time_budget is not None:
            check_positive("time_budget", self.time_budget)
        check_positive("embedding_lr_ratio", self.embedding_lr_ratio)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_fraction("beta1", self.beta1)
        check_fraction("beta2", self.beta2)
        check_positive("grad_clip", self.grad_clip, allow_zero=True)
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; choose one of "
                              f"{', '.join(OPTIMIZERS)}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"unknown strategy {self.strategy!r}; choose one of "
                              f"{', '.join(STRATEGIES)}")
        check_int("eval_every", self.eval_every)
        if self.eval_windows is not None:
            check_int("eval_windows", self.eval_windows)
        check_int("save_every", self.save_every)
        check_int("log_every", self.log_every)
        check_int("seed", self.seed, minimum=0)
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(f"device must be a name such as auto, cpu, cuda or mps, "
                              f"got {self.device!r}")
        if self.threads is not None:
            check_int("threads", self.threads)
        for name in ("compile", "plot_log_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")


def read_toml(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model fields, train fields) of a run TOML file.

    Keys may sit at the top level or under ``[model]`` / ``[train]`` tables; each top-level
    key goes to the config that has a field of that name. Unknown keys are errors.
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
        import tomli as tomllib

    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {p} does not exist; pass an existing --config "
                          f"TOML file") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from exc
    # "layer_norm_eps": run.toml files written before norm_eps (ModelConfig.from_dict reads it)
    names = {"model": {f.name for f in fields(ModelConfig)} | {"layer_norm_eps"},
             "train": {f.name for f in fields(TrainConfig)}}
    out: dict[str, dict[str, Any]] = {"model": {}, "train": {}}
    for key, value in data.items():
        if key in out and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                if sub_key not in names[key]:
                    raise ConfigError(f"{p}: unknown [{key}] key {sub_key!r}; known keys "
                                      f"are {', '.join(sorted(names[key]))}")
                out[key][sub_key] = sub_value
            continue
        for section, known in names.items():
            if key in known:
                out[section][key] = value
                break
        else:
            raise ConfigError(f"{p}: unknown key {key!r}; use ModelConfig or TrainConfig "
                              f"field names (see tinylm train --help)")
    return out["model"], out["train"]


def to_toml(sections: dict[str, dict[str, Any]]) -> str:
    """A TOML document of flat tables (str, int, float, bool values; None is omitted),
    readable by :func:`read_toml`."""
    lines: list[str] = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, (int, float)):
                text = repr(value)
            else:
                text = json.dumps(str(value))
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads() -> int:
    """A sane default for torch's intra-op threads: OMP_NUM_THREADS when set, else the
    CPUs left free by the current load (1-minute load average, whole processes only: a
    load under 1 on an idle machine is the tail of earlier work and keeps every core), at
    least 1 and at most the available CPUs. On a busy machine, oversubscribed threads
    spin and wait on each other."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    cpus = available_cpus()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return max(1, min(cpus, cpus - int(load)))


def resolve_device(name: str | None = "auto"):
    """The torch device for ``name``: "auto" picks cuda > mps > cpu; others are checked."""
    import torch

    if name in (None, "", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {name!r} requested but MPS is not available; use --device cpu")
    return device


# --- memory: estimated before a model is allocated ----------------------------------------

#: Python objects of one block (modules, parameters, hooks), beyond its weights.
_BLOCK_OVERHEAD_BYTES = 64 * 1024


def estimate_parameters(config: ModelConfig) -> int:
    """About how many parameters a model of ``config`` has, without building it.

    Closed form over the embedding, the positional table, and per block the QKV and
    output projections, the MLP and the norms; exact for GPT-2 layouts, within a few
    percent for the other architecture options.
    """
    V, C, L, E = config.vocab_size, config.context_length, config.n_layer, config.n_embd
    inner = config.inner_dim
    kv = getattr(config, "kv_dim", inner)
    ffn = getattr(config, "ffn_dim", 4 * E)
    mats = 3 if getattr(config, "mlp", "gelu") in ("swiglu", "geglu") else 2
    bias = bool(getattr(config, "bias", True))
    norm = 2 * E if bias else E  # a norm's weight (and bias)
    per_block = E * (inner + 2 * kv) + inner * E + mats * E * ffn + 2 * norm
    if bias:
        per_block += (inner + 2 * kv) + E + (mats - 1) * ffn + E
    total = V * E + L * per_block + norm
    if getattr(config, "position", "learned") == "learned":
        total += C * E
    if not config.tie_embeddings:
        total += V * E
    return total


def estimate_model_bytes(config: ModelConfig, *, training: bool = False,
                         parameters: int | None = None) -> int:
    """Bytes a float32 model of ``config`` needs: weights (x4 when ``training``: gradients
    and two AdamW moments) plus a fixed overhead per block. ``parameters`` replaces the
    closed-form estimate when the caller knows the count."""
    count = estimate_parameters(config) if parameters is None else parameters
    return 4 * count * (4 if training else 1) + config.n_layer * _BLOCK_OVERHEAD_BYTES


def available_memory(device: Any = "cpu") -> int | None:
    """Bytes that can still be allocated on ``device`` (None when it cannot be told).

    CPU: MemAvailable + SwapFree from /proc/meminfo (Linux), else psutil, else the
    physical memory; CUDA: the free memory torch reports.
    """
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda":
        import torch

        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError, ValueError):
            return None
    if kind != "cpu":
        return None
    try:
        info = dict(line.split(":", 1) for line in
                    Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return 1024 * sum(int(info[k].split()[0]) for k in ("MemAvailable", "SwapFree")
                          if k in info) or None
    except (OSError, ValueError):
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available + psutil.swap_memory().free)
    except (ImportError, OSError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(n: float) -> str:
    """``n`` bytes as "1.5 GB" (decimal units, as disks and free(1) -h --si print)."""
    if abs(n) >= 1e18:
        return f"{n:.1e} bytes"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def check_model_fits(config: ModelConfig, device: Any = "cpu", *, training: bool = False,
                     parameters: int | None = None) -> int:
    """The estimated bytes of a model of ``config``; ConfigError when they cannot fit in
    the memory available on ``device`` (the message gives the estimate). Call it before
    allocating: ``training=True`` counts gradients and optimizer moments too."""
    need = estimate_model_bytes(config, training=training, parameters=parameters)
    have = available_memory(device)
    if have is not None and need > have:
        params = estimate_parameters(config) if parameters is None else parameters
        extra = " with gradients and AdamW moments" if training else ""
        raise ConfigError(
            f"a model of this config needs about {format_bytes(need)} "
            f"({params:,} float32 parameters{extra}) but only {format_bytes(have)} is "
            f"available on {device}; make vocab_size, "
            f"n_layer or n_embd smaller, or use a machine with more memory")
    return need
