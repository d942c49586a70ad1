"""Layer 2 -- quantisation: the 4-bit group primitives (``q4g``), the QD04 file (``qd4``), GPTQ (``gptq``),
quantisation-aware training (``qat``) and the bf16 / int4 linear layers a draft computes with (``linear``)."""
