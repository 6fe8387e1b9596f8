"""The pass pipeline: registry and presets, options, the shape-inference step."""
