"""Text in and out of the engine: tokenizers (HF and GGUF), incremental detokenizing, chat
templates."""
