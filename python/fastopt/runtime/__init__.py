"""What fastopt knows about ONNX Runtime: its ops, kernels, version floor, providers."""
