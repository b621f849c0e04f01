"""What the demos, tests and benchmarks run on, not what an operator deploys: tiny models and their
tokenizer, vLLM engines in process, vLLM's KV cache manager driven by hand, KV caches laid out as
vLLM lays them out, the soak. bench/ and tests/ share code only through this package."""
