"""The validation data a command measures a model on (``quantize --data``, ``compress
--data``/``--sweep``): a prepared folder's val split, refused unless it was prepared with
the model's own tokenizer — the check ``tinylm eval`` and ``train`` make
(:func:`tinylm.use.evaluation.check_same_tokenizer`), here once for every command."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tinylm.core.errors import DataError
from tinylm.data import load_prepared
from tinylm.data.tokenizer_files import checkpoint_tokenizer_file
from tinylm.io.checkpoint import resolve_checkpoint_dir
from tinylm.use.evaluation import check_same_tokenizer


def validation_tokens(data_dir: str | os.PathLike, tokenizer: Any,
                      model_dir: str | os.PathLike) -> Any:
    """The val split (N,) of the ``tinylm prepare`` folder ``data_dir``, after checking
    that it was made with ``tokenizer`` (the model's, loaded from ``model_dir``; None
    skips the check): a DataError otherwise, and for a missing folder, whose fix names
    the model's tokenizer file (prepare's default would build a char vocabulary)."""
    tok_file = checkpoint_tokenizer_file(resolve_checkpoint_dir(model_dir))
    prepare = (f"tinylm prepare --input TEXT --tokenizer "
               f"{tok_file or 'MODEL_DIR/tokenizer.json'} --out")
    if not Path(data_dir).is_dir():  # prepare's own hint would make a char dataset
        raise DataError(f"prepared data folder {data_dir} does not exist; make it with the "
                        f"model's tokenizer: {prepare} {data_dir}")
    data = load_prepared(data_dir)
    check_same_tokenizer(tokenizer, data.tokenizer, str(data.dir),
                         fix=f"prepare it with the model's tokenizer ({prepare} DIR) and "
                             f"pass that folder to --data")
    return data.val


__all__ = ["validation_tokens"]
