"""Files in and out: atomic writes and locks (``files``), bounded JSON (``jsonio``),
safetensors + JSON checkpoints (``checkpoint``) and Hugging Face folders (``hf``)."""
