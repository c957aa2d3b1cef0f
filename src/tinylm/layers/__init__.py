"""Replaced layers: modules that stand in for an ``nn.Linear`` of the reference model.

Low-rank factors (``lowrank``), quantized weights (``quantize``) and LoRA adapters
(``lora``). Each is written once, as reference math; the fast paths take it or step aside.
"""
