"""Quantization: quantize(), its settings and checks, precision and activation ranges."""
