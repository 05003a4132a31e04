"""Stock vLLM as a weightsync target: the adapter that drives weightsync's backend plugin in staged rounds
(docs/engines/vllm.md), and the model trace that runs with the engine's own vLLM code (docs/engines/vllm-trace.md)."""
