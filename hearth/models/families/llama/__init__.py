"""The Llama family: Llama, Mistral, Qwen2, Qwen3."""
