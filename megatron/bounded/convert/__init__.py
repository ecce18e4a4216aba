"""Conversion between Hugging Face checkpoints and this project's torch_dist checkpoints.

One module per model family (``qwen3_moe``, ``mixtral``, ``glm4_moe``, ``gpt_oss``,
``deepseek_v3``, which Kimi-K2's ``kimi_k2`` shares, ``deepseek_v32``, ``qwen3_next``,
``qwen3_5_moe`` and its text model's ``qwen3_5_moe_text``) says which flags build the
architecture of a ``config.json`` (refusing what it does not map) and which rules tie our
checkpoint's tensors to the Hugging Face tensors; ``core`` holds what the families share,
``hf_files`` and ``torch_dist`` the two formats (``quantized`` and ``dequantize``: FP8 and MXFP4
weights read dequantized), ``pipeline`` the import and the export. A family
is added as a module with ``MODEL_TYPE``, ``flags(config)``, ``rules(config)`` and optionally
``skipped(config, name)`` (what a tensor of the files that the model does not use is part of)
and ``decoder_config(config)`` (where a vision-language model keeps the decoder's fields),
listed in ``families``.
"""
