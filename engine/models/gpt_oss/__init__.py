"""gpt-oss's home: spec, config and parameters (config.py), tensor names HF and GGUF
(names.py), the torch reference modules (model.py) and its native step (step.py)."""
