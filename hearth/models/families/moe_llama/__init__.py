"""Mixtral and Qwen3-MoE: the Llama decoder with sparse MoE blocks."""
