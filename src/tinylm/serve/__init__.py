"""``tinylm serve``: an OpenAI-compatible HTTP server with continuous batching.

- :mod:`tinylm.serve.engine`     the batching loop (one batched decoding step for all)
- :mod:`tinylm.serve.prefix`     prefix reuse: prompt keys/values by blocks, LRU
- :mod:`tinylm.serve.speculate`  prompt-lookup decoding's n-gram drafts
- :mod:`tinylm.serve.schemas`    request bodies, validated; OpenAI's error fields
- :mod:`tinylm.serve.responses`  engine events -> OpenAI response bodies and chunks
- :mod:`tinylm.serve.constrain`  structured output: llguidance grammars, the logits mask
- :mod:`tinylm.serve.tools`      tool calls: tools in the prompt, calls parsed and streamed
- :mod:`tinylm.serve.app`        the Starlette routes; ``page.html`` is the web page
- :mod:`tinylm.serve.metrics`    Prometheus counters, gauges and histograms
- :mod:`tinylm.serve.lifecycle`  request ids and log lines; the drain at shutdown
- :mod:`tinylm.serve.admission`  the explorer's memory budget and queue
- :mod:`tinylm.serve.guard`      the Host check (DNS rebinding)
- :mod:`tinylm.serve.protocol`   uvicorn with header, body and idle timeouts, a connection cap

Starlette and uvicorn come with the ``[serve]`` extra (``pip install 'tinylm[serve]'``).
"""

from __future__ import annotations

import os
from pathlib import Path

from tinylm.core.errors import CheckpointError, ConfigError
from tinylm.io.checkpoint import load_checkpoint, read_config, resolve_checkpoint_dir
from tinylm.io.checkpoint_files import TOKENIZER_FILE

LOOPBACK = ("127.0.0.1", "localhost", "::1")
API_KEY_ENV = "TINYLM_API_KEY"
MIN_KEY_CHARS = 16  # an API key on a non-loopback address

__all__ = ["API_KEY_ENV", "LOOPBACK", "default_model_name", "make_server", "serve"]


def _require_serve_extra():
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise ConfigError(f"tinylm serve needs Starlette and uvicorn ({exc.name} is missing); "
                          f"install them with: pip install 'tinylm[serve]'") from exc
    return uvicorn


def default_model_name(model_dir: str | os.PathLike, folder: Path) -> str:
    """The model id clients send when --model-name is not given: a GGUF file's name
    without ``.gguf`` (not its private cache folder's), else the folder's name (a run
    folder's own, not ``latest``)."""
    given = Path(model_dir)
    if given.suffix.lower() == ".gguf" and given.is_file():
        return given.stem
    if folder.resolve() != given.resolve() and folder.parent.resolve() == given.resolve():
        return given.resolve().name
    return folder.resolve().name


def check_api_key(host: str, api_key: str | None) -> None:
    """A blank key is refused; a host other than loopback needs a key of at least
    MIN_KEY_CHARS characters."""
    if api_key is not None and not api_key.strip():
        raise ConfigError(f"the API key is blank; pass --api-key KEY (or set {API_KEY_ENV}) "
                          f"with a key of at least {MIN_KEY_CHARS} characters")
    if host in LOOPBACK:
        return
    if not api_key:
        raise ConfigError(f"serving on {host} (not 127.0.0.1) needs an API key: pass "
                          f"--api-key KEY or set {API_KEY_ENV}")
    if len(api_key) < MIN_KEY_CHARS:
        raise ConfigError(f"the API key is {len(api_key)} characters; serving on {host} (not "
                          f"127.0.0.1) needs one of at least {MIN_KEY_CHARS} (e.g. python -c "
                          f"'import secrets; print(secrets.token_urlsafe())')")


def make_server(model_dir: str | os.PathLike, *, host: str = "127.0.0.1",
                api_key: str | None = None, **settings):
    """A not-yet-loaded :class:`~tinylm.serve.app.Server` for a checkpoint folder, after
    the checks that can fail fast: the folder and its tokenizer exist, and a host other
    than loopback has an API key of at least 16 characters (``api_key`` or
    ``$TINYLM_API_KEY``)."""
    _require_serve_extra()
    from tinylm.serve.app import Server, Settings

    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    check_api_key(host, api_key)
    folder = resolve_checkpoint_dir(model_dir)
    read_config(folder)
    if not (folder / TOKENIZER_FILE).is_file():
        raise CheckpointError(f"{folder} has no {TOKENIZER_FILE}; the server needs the "
                              f"model's tokenizer to turn text into tokens")
    settings.setdefault("model_name", default_model_name(model_dir, folder))
    return Server(Settings(api_key=api_key, host=host, **settings),
                  lambda: load_checkpoint(folder))


def serve(model_dir: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, max_connections: int = 128,
          shutdown_timeout: float = 30.0, **settings) -> None:
    """Run the server until SIGTERM or SIGINT (the model loads in the background;
    ``/health`` answers 503 until it is ready), then shut down gracefully: new requests
    get 503, running ones have ``shutdown_timeout`` seconds to finish before they are
    cancelled, and the function returns. ``settings`` are
    :class:`~tinylm.serve.app.Settings` fields (max_batch, max_queue, max_tokens,
    timeout, allowed_hosts, ...); ``max_connections`` caps open connections
    (:mod:`tinylm.serve.protocol`)."""
    _require_serve_extra()
    from tinylm.serve.app import create_app  # Starlette: the optional [serve] extra
    from tinylm.serve.protocol import graceful_server

    server = make_server(model_dir, host=host, api_key=api_key, port=port, **settings)
    graceful_server(create_app(server), server, host=host, port=port,
                    max_connections=max_connections, shutdown_timeout=shutdown_timeout).run()
