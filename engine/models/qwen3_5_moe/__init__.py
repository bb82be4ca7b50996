"""Qwen3.5 / Qwen3.6 MoE's home (``Qwen3_5MoeForConditionalGeneration``, model_type
``qwen3_5_moe``; 35B-A3B, 122B-A10B, 397B-A17B): Qwen3-Next's text model (Gated DeltaNet + gated
full attention, routed experts + a sigmoid-gated shared expert, zero-centred norms, partial RoPE)
shipped as a vision-language checkpoint, served text-only by Qwen3-Next's layers, model and
native step (engine.models.qwen3_next). What differs lives here: spec.py; config.py (nested
``text_config``, multimodal RoPE sections, an always-renormalised router); names.py (the
``model.language_model.`` prefix, split DeltaNet projections fused on load, the vision tower and
MTP head never read, block-FP8 dequantized); gguf.py (llama.cpp's ``qwen35moe``); published/
(the released configs); mtp.py and mtp_draft.py (the MTP head drafting for ``--speculative mtp``).
A request carrying images is refused (services.http.schemas).
"""
