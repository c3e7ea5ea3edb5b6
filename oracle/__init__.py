"""moe-oracle: numerical validation of MoE LLM backends against HF transformers fp32."""

__version__ = "0.1.0"
