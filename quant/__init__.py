"""quantgate's converter: bf16 Hugging Face MoE checkpoints -> MXFP4 checkpoints for sglang and vLLM."""

from quant.user_cache import use_user_cache

__version__ = "0.1.0"

use_user_cache()  # before numba or torch loads, in every process (conversion workers too)
