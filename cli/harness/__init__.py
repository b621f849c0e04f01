"""What the demos, tests and benchmarks run on, not what an operator deploys: tiny models and their
tokenizer, vLLM engines in process, vLLM's KV cache manager driven by hand, the soak."""
