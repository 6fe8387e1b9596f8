"""onnxruntime-genai: genai_config.json and the Whisper layout."""
