"""DeepSeek-V3's home: spec, config and parameters (config.py), tensor names HF and GGUF
(names.py), multi-head latent attention (mla.py), the torch reference modules (model.py) and
its native step (step.py)."""
