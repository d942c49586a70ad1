"""specdraft: build, pack, serve and evaluate standalone draft models for speculative decoding."""

__version__ = "0.1.0"
