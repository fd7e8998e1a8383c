"""quantgate's converter: bf16 Hugging Face MoE checkpoints -> MXFP4 checkpoints for sglang and vLLM."""

__version__ = "0.1.0"
