"""Stock vLLM as a weightsync target: so far the model trace that runs with the engine's own vLLM code
(docs/engines/vllm-trace.md)."""
