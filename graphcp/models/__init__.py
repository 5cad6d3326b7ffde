"""Models: one folder per family (``llama/``, ``deepseek/``, ``deepseek_v4/``, ``qwen3_next/``), each
registered by one ``Family`` record in ``registry.py``; the layers they share in ``common/``. Plain
modules that read the forward context: they know nothing of CP or graphs."""
