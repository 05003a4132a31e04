"""What runs inside an engine's own interpreter, where weightsync is not installed.

The stock engines' shard-map trace (``trace.py``, run by path with the engine's Python: ``trace_core`` and one
``<engine>/trace_model.py`` per engine kind) and the vLLM backend plugin (``vllm/``, loaded by vLLM in every process
of a server). Nothing here imports any other weightsync root, and no other root imports this one: the agent only
finds ``trace.py``'s path. Kept free of imports: vLLM imports the plugin's package in every process.
"""
