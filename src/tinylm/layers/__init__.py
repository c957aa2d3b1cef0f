"""Replaced layers: modules that stand in for an ``nn.Linear`` of the reference model.

Low-rank factors (``lowrank``), int8 weights (``quantized``) and LoRA adapters (``lora``),
each written once as reference math; ``registry`` declares every kind once (its
config.json section, how it is rebuilt and made dense, which fast paths take it), and
``selection`` is the one rule by which the commands name the layers they replace. This
room imports only :mod:`tinylm.core`.
"""
