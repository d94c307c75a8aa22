"""specgate: the load-aware gateway between a speculative and a baseline inference server (SGLang, vLLM, llama.cpp)."""
