"""DeepSeek-V2/V3 and Kimi K2: MLA attention and DeepSeek MoE."""
