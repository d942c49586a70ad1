"""Layer 2 -- quantisation: the 4-bit group primitives (``q4g``), the QD04 file (``qd4``), GPTQ (``gptq``),
quantisation-aware training (``qat``), the bf16 / int4 linear layers a draft computes with (``linear``), and the
measured choices between formats: serving's (``compute_choice``) and training's precision (``train_precision``)."""
