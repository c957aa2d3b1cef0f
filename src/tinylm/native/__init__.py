"""tinylm's fast paths, applied from outside the reference model.

    plan = tinylm.native.accelerate(model, device)   # decide once, apply to the modules
    with plan.decoder(batch_size) as decoder: ...     # the decoding plan (changes nothing)
    with tinylm.native.disabled(): ...                # every fast path off (TINYLM_NATIVE=0)

- :mod:`~tinylm.native.build`: compile, cache (private, sha256-verified) and load the C
  sources in ``csrc/`` (one shared header, one file per op family);
- :mod:`~tinylm.native.ops`: the checked op wrappers, signatures read from the header;
- :mod:`~tinylm.native.selfcheck`: every op against torch, before first use;
- :mod:`~tinylm.native.functions`: the autograd Functions of the training paths;
- :mod:`~tinylm.native.plan`: the one eligibility decision and the accelerated modules;
- :mod:`~tinylm.native.decoding`: the decoding plans;
- :mod:`~tinylm.native.bpe`: the byte-level BPE encoder of ``prepare``, equal to Hugging
  Face tokenizers (``bpe_encoder(tokenizer)``, None where it steps aside).

Nothing in tinylm.core.model or tinylm.core.attention imports this package; deleting it leaves a
working, slower tinylm (tinylm.acceleration then hands out reference plans).
"""

from __future__ import annotations

from tinylm.native.bpe import NativeBPE, bpe_encoder
from tinylm.native.ops import OpError, disabled, enabled, load, loaded
from tinylm.native.plan import Eligibility, Plan, accelerate, eligibility, plan

__all__ = ["Eligibility", "NativeBPE", "OpError", "Plan", "accelerate", "available",
           "bpe_encoder", "disabled", "eligibility", "enabled", "load", "loaded", "plan"]


def available() -> bool:
    """True when the native library built, loaded and passed its self-check (this call
    builds it if needed)."""
    return load() is not None
