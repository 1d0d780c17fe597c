"""Runtimes that front a serving engine the user already runs (llama-server, vLLM).

The node never starts the engine: it sends token ids to it over HTTP and reads
token ids back, so the head's template and tokenizer stay the one source of truth.
Each engine speaks a dialect (:mod:`.llama_server`, :mod:`.vllm`: pure request
building and answer parsing); :mod:`.engine` does the IO for all of them.
"""
