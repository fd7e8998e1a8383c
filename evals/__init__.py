"""quantgate's evaluation side: run bundles, paired statistics and the release gate."""

from quant.user_cache import use_user_cache

use_user_cache()  # before torch loads: lm-eval's and transformers' imports make torch's compile folder
