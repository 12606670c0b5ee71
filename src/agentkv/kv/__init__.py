"""KV cache formats, the per-layer quantized cache, and attention over it."""
