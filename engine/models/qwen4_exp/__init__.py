"""Qwen4-Exp (Qwen3.8-Flash-Next, ``Qwen4ExpForConditionalGeneration``): Qwen3.5-MoE's hybrid of
Gated DeltaNet and gated attention with hyper-connections, Per-Layer Embeddings (PLE, hashed
n-gram tables) and QSA (indexed sparse attention) on the attention layers.

Files: spec.py (ArchSpec), config.py (config.json, Qwen4ExpParams, validations, counts),
names.py (HF tensor names: VLM layout, split PLE shards), tensors.py (expected tensors),
ngram.py (n-gram hashing), ple_table.py (the PLE tables the model reads), ple.py (the PLE layer),
hyper.py (hyper-connections), qsa_reference.py (QSA: indexer and dense-selection attention),
state.py (per-sequence PLE conv and n-gram context), model.py (the torch model), info.py
(``moestream info`` lines), published/ (a reconstructed config of the published shape).
"""
