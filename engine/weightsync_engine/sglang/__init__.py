"""Stock SGLang's side of the shard-map trace (``trace_model.py``), run with SGLang's Python through ``../trace.py``."""
